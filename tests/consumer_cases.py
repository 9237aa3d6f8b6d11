"""Simulated-peer cases for the all-gather consumer GEMM, shared by the interpreter tests (CPU)
and the GPU tests."""

import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import gemm

EPOCH = 7


def problem(world, shard_shape, ns, dtype, bias, gather_dim, seed=0, device="cpu"):
    """Simulated peers: every rank's shard already in place in A (the gathered rows, in the
    gather's own order), one mat2 per entry of ``ns`` (bias: True for all, False for none, or
    one flag per mat2), and the reference outputs."""
    gen = torch.Generator().manual_seed(seed)
    ns = [ns] if isinstance(ns, int) else list(ns)
    with_bias = [bias] * len(ns) if isinstance(bias, bool) else list(bias)
    shards = [torch.randn(shard_shape, generator=gen).to(dtype) for _ in range(world)]
    k = shard_shape[-1]
    mat2s = [torch.randn(n, k, generator=gen).to(dtype).t() for n in ns]  # linear weights
    biases = [torch.randn(n, generator=gen).to(dtype) if b else None for n, b in zip(ns, with_bias)]
    gathered = torch.cat(shards, dim=gather_dim).reshape(-1, k)
    refs = [
        (gathered.float() @ m.float() + (b.float() if b is not None else 0)).to(dtype)
        for m, b in zip(mat2s, biases)
    ]
    inner = 1
    for size in shard_shape[gather_dim:-1]:
        inner *= size
    to = lambda ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
    return gathered.to(device), to(mat2s), to(biases), to(refs), inner


def run_consumer(gathered, mat2s, biases, world, rank, inner, flags, config=gemm.TEST_CONFIG, **kwargs):
    """Runs the consumer on NaN-poisoned outputs; returns them and the per-chunk timeouts."""
    outs = [
        torch.full((gathered.shape[0], m.shape[1]), float("nan"), dtype=gathered.dtype, device=gathered.device)
        for m in mat2s
    ]
    timeouts = torch.zeros(world, dtype=torch.int32, device=gathered.device)
    epoch = torch.tensor([EPOCH], dtype=torch.int32, device=gathered.device)
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, flags.to(torch.int32), epoch, rank=rank, world_size=world,
        inner=inner, config=config, timeouts=timeouts, **kwargs,
    )
    return outs, timeouts
