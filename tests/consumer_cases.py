"""Simulated-peer cases for the all-gather consumer GEMM, shared by the interpreter tests (CPU)
and the GPU tests."""

import torch

from overlap_pass.templates import all_gather_matmul as agm

EPOCH = 7


def problem(world, shard_shape, n, dtype, bias, gather_dim, seed=0, device="cpu"):
    """Simulated peers: every rank's shard already stacked in A; the reference output."""
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(shard_shape, generator=gen).to(dtype) for _ in range(world)]
    k = shard_shape[-1]
    mat2 = torch.randn(n, k, generator=gen).to(dtype).t()  # a transposed weight, as in linear
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    stacked = torch.cat([s.reshape(-1, k) for s in shards])
    gathered = torch.cat(shards, dim=gather_dim)
    ref = gathered.float() @ mat2.float() + (b.float() if bias else 0)
    inner = 1
    for size in shard_shape[gather_dim:-1]:
        inner *= size
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(stacked), to(mat2), to(b), to(ref.reshape(-1, n).to(dtype)), inner


def run_consumer(stacked, mat2, b, world, rank, inner, flags, config=agm.TEST_CONFIG, **kwargs):
    """Runs the consumer on a NaN-poisoned output; returns it and the per-chunk timeouts."""
    out = torch.full(
        (stacked.shape[0], mat2.shape[1]), float("nan"), dtype=stacked.dtype, device=stacked.device
    )
    timeouts = torch.zeros(world, dtype=torch.int32, device=stacked.device)
    agm.all_gather_matmul_consumer(
        stacked, mat2, b, out, flags, rank=rank, world_size=world, inner=inner, epoch=EPOCH,
        config=config, timeouts=timeouts, **kwargs,
    )
    return out, timeouts
