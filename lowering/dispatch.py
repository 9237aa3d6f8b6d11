"""The CUDA kernels of the overlap ops: pick a variant per shape (choose.py) and run it."""

import functools

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
    return group.size() > 1 and str(dist.get_backend(group)) == "nccl"


def all_gather_matmul(shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False):
    dim = ops._check_all_gather_matmul(shard, mat2s, biases, gather_dim, world_size)
    args = (shard, mat2s, biases, dim, world_size, group_name, return_gathered)
    group = _resolve_process_group(group_name)
    if config.implementation == "reference" or not _symmetric_memory_usable(group):
        return ops.all_gather_matmul_reference(*args)
    key = choose.shape_key(
        agm.KIND, world_size, all_gather_matmul_shapes(shard.shape, mat2s, biases, dim), shard.dtype
    )
    name = choose.choose(key, _ag_variants(), args, group, shard.device)
    return _ag_variants()[name](*args)
