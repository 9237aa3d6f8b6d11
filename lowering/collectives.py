"""NCCL collectives as Inductor's graphs call them: the functional C++ ops
(torch.ops._c10d_functional), each waited for on the calling stream. A call costs the host a
fraction of what torch.distributed's Python API costs (its logging wrapper, argument checks and
Work object), and the NCCL + cuBLAS variants run where every such microsecond counts: a
signature's first calls, the token counts no fused variant takes."""

import torch

from overlap_pass.torch_compat import functional_collectives


def all_gather(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """The ranks' ``shard`` one after another along dim 0."""
    c10d = functional_collectives()
    return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world_size, group_name))


def reduce_scatter(full: torch.Tensor, reduce_op: str, world_size: int, group_name: str, under=None) -> torch.Tensor:
    """This rank's 1/W of ``full``'s rows (dim 0), reduced over the ranks; ``under()`` runs on
    the calling stream while NCCL's kernel runs."""
    c10d = functional_collectives()
    out = c10d.reduce_scatter_tensor(full, reduce_op, world_size, group_name)
    if under is not None:
        under()
    return c10d.wait_tensor(out)


def all_reduce(inp: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    c10d = functional_collectives()
    return c10d.wait_tensor(c10d.all_reduce(inp, reduce_op, group_name))
