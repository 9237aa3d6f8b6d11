"""overlap::all_reduce: a small all-reduce as one op, run through symmetric memory on CUDA.

    all_reduce(input, reduce_op, world_size, group_name) -> reduce_op over ranks of input

The functional collective pair it replaces (all_reduce, then wait_tensor) costs a collective's
host steps (an NCCL enqueue, its work object, the wait) and an NCCL kernel on another stream;
for a tensor of a few KiB (float8's amaxes, a replicated norm weight's gradient) that is all it
costs. On CUDA, lowering/all_reduce.py's one-shot kernel replays from a per-call CUDA graph,
or NCCL where the per-shape choice finds it faster; elsewhere (gloo) the reference is the
functional collective itself. The output is a new contiguous tensor; sums and averages add in
fp32 (fp64 for fp64) in rank order, max and min are exact.
"""

import torch

from . import matmul_ops

REDUCE_OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

SCHEMAS = {"all_reduce": "(Tensor input, str reduce_op, int world_size, str group_name) -> Tensor"}


def _fake(inp, reduce_op, world_size, group_name):
    return torch.empty_like(inp, memory_format=torch.contiguous_format)


def all_reduce_reference(inp, reduce_op, world_size, group_name):
    matmul_ops.resolve_group(group_name, world_size)
    out = torch.ops._c10d_functional.all_reduce.default(inp.contiguous(), reduce_op, group_name)
    return torch.ops._c10d_functional.wait_tensor.default(out)


KERNELS = {"all_reduce": (_fake, all_reduce_reference)}
