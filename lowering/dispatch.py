"""The CUDA kernels of the overlap ops: pick a variant per shape (choose.py) and run it."""

import functools

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from overlap_pass import config, ops

from . import all_gather_matmul as agm
from . import choose


@functools.cache
def _ag_variants() -> dict:
    return agm.variants()


def all_gather_matmul_shapes(shard_shape, mat2s, biases, gather_dim) -> dict:
    """What the all_gather_matmul choice depends on; decide.py builds the same from graph
    metadata to show a cached choice in decisions.json."""
    return {
        "shard": list(shard_shape),
        "gather_dim": gather_dim,
        "mat2s": [[*m.shape, "t" if m.stride(0) == 1 and m.dim() == 2 else "n"] for m in mat2s],
        "bias": [b is not None for b in biases],
    }


def _symmetric_memory_usable(group) -> bool:
    # "nccl", or "cpu:gloo,cuda:nccl" for a group made without naming a backend
    return group.size() > 1 and "nccl" in str(dist.get_backend(group))


# (shapes, strides, dtype, dims, group, implementation) of a call -> the variant it runs, so
# that later calls skip validation and key building (host time is on the critical path)
_RESOLVED: dict[tuple, str] = {}


def all_gather_matmul(shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False):
    fast_key = (
        shard.shape, shard.stride(), shard.dtype, shard.device, gather_dim, world_size, group_name,
        tuple((m.shape, m.stride(), m.dtype) for m in mat2s),
        tuple(None if b is None else (b.shape, b.stride(), b.dtype) for b in biases),
        config.implementation,
    )  # fmt: skip
    name = _RESOLVED.get(fast_key)
    if name is not None:
        return _ag_variants()[name](shard, mat2s, biases, gather_dim % shard.dim(), world_size, group_name, return_gathered)
    dim = ops._check_all_gather_matmul(shard, mat2s, biases, gather_dim, world_size)
    args = (shard, mat2s, biases, dim, world_size, group_name, return_gathered)
    group = _resolve_process_group(group_name)
    torch._check(
        group.size() == world_size,
        lambda: f"group {group_name} has {group.size()} ranks, the op was given {world_size}",
    )
    if config.implementation == "reference" or not _symmetric_memory_usable(group):
        return ops.all_gather_matmul_reference(*args)
    key = choose.shape_key(
        agm.KIND, world_size, all_gather_matmul_shapes(shard.shape, mat2s, biases, dim), shard.dtype
    )
    name = choose.choose(key, _ag_variants(), args, group, shard.device)
    if not torch.cuda.is_current_stream_capturing():  # a capture's fallback is not a choice
        _RESOLVED[fast_key] = name
    return _ag_variants()[name](*args)
