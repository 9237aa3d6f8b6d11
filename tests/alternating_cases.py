"""Per-rank body of the GPU test of calls of both kinds in turn on one group, as a model's
layers make them, with ranks out of step: the two kinds' workspaces, flags and epochs stay
apart, and every output stays right."""

import torch
import torch.distributed as dist

from overlap_pass.lowering import all_gather_matmul as agm
from tests import fused_ag_cases as ag
from tests import fused_rs_cases as rs
from tests.gpu_common import assert_all_close, error, group_name

LATE_CYCLES = 200_000  # about 100 us of GPU clock: one rank starts each step late


def alternating_kinds(steps: int, seed=0) -> int:
    """``steps`` pairs of calls, all_gather_matmul then matmul_reduce_scatter on one group and
    stream, as a model's layers make them: shapes and symmetric-memory variants change from
    call to call, one rank (in turn) starts each step late, nothing syncs in between (the
    references are computed locally); outputs checked at the end. Returns the calls checked."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16
    ag_variants = {n: v for n, v in agm.variants().items() if n != "nccl_cublas"}
    ag_names = list(ag_variants)
    errors, labels = [], []
    for step in range(steps):
        if rank == step % world:
            torch.cuda._sleep(LATE_CYCLES)
        shape, gather_dim, ns, bias = ag.SHAPES[step % len(ag.SHAPES)]
        shard, mat2s, biases = ag._problem(shape, gather_dim, ns, bias, dtype, seed + step)
        _, refs = ag._local_reference(shape, gather_dim, ns, bias, dtype, seed + step)
        name = ag_names[step % len(ag_names)]
        _, outs = ag_variants[name](shard, mat2s, biases, gather_dim, world, group_name())
        errors += [error(o, r) for o, r in zip(outs, refs)]
        labels += [(step, name)] * len(outs)

        index = step % len(rs.SHAPES)
        rs_variants = {n: v for n, v in rs._variants(index).items() if n != "nccl_cublas"}
        name = list(rs_variants)[step % len(rs_variants)]
        out = rs._call(rs_variants[name], index, dtype, seed + step)
        errors.append(error(out, rs._reference(index, dtype, seed + step)))
        labels.append((step, name))
    assert_all_close(errors, labels)
    return len(labels)
