"""overlap::all_reduce on CUDA: the variants that choose.py picks from.

- one_shot: every rank stores its elements into its slot of every rank's workspace and reduces
  the W slots it received (templates/all_reduce.py): the barrier kernel and one more, which a
  per-call CUDA graph replays in one launch (replay.py).
- nccl_cublas (choose.BASELINE, the name every op's baseline has): NCCL's all-reduce. The
  baseline, and the fallback.

Workspace data: [flags: MAX_PROGRAMS x W int32 | slot 0 | ... | slot W-1], a slot per rank of
the input's size. Both take the op's arguments and return its output; one_shot writes into
``outputs=allocate(...)`` when given (replay.py).
"""

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.templates import all_reduce as kernel

from . import choose, collectives, symm

KIND = "all_reduce"


def allocate(inp, reduce_op, world_size, group_name):
    """The op's output, empty and contiguous (made apart from the call: replay.py)."""
    return torch.empty_like(inp, memory_format=torch.contiguous_format)


NCCL_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def nccl(inp, reduce_op, world_size, group_name):
    return collectives.all_reduce(inp.contiguous(), reduce_op, group_name)


def one_shot(inp, reduce_op, world_size, group_name, outputs=None):
    out = allocate(inp, reduce_op, world_size, group_name) if outputs is None else outputs
    if inp.numel() == 0:
        return out
    src = inp.contiguous().view(-1)
    ws = symm.workspace(KIND, group_name, inp.device)
    spin, flag_bytes = config.spin_limit, kernel.flag_bytes(world_size)
    ws.enter(flag_bytes + world_size * src.numel() * src.element_size(), spin)
    try:
        kernel.ONE_SHOT[(kernel.programs(src.numel()),)](
            src, out.view(-1), ws.peer_data_addresses(), ws.epoch, ws.chunk_timeouts,
            src.numel(), ws.rank, world_size,
            OP=kernel.OPS[reduce_op], FLAG_BYTES=flag_bytes, SPIN_LIMIT=spin,
            BLOCK=kernel.BLOCK, num_warps=kernel.NUM_WARPS,
        )  # fmt: skip
    finally:
        ws.leave()
    return out


def variants() -> dict:
    return {"one_shot": one_shot, choose.BASELINE: nccl}
