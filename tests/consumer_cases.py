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


def fp8_problem(world, shard_shape, ns, gather_dim, rowwise, bias, seed, device="cpu"):
    """Float8 shards (e4m3) and linear weights with their scales (rowwise: one per row of A, in
    A's order, and one per column of B; else one each), bf16 biases, and the dequantized
    products in fp32 (on the CPU). Returns (gathered A, a scale, mat2s, b scales, biases, refs,
    inner), all but refs on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    k = shard_shape[-1]
    shards = [torch.randn(shard_shape, generator=gen).to(torch.float8_e4m3fn) for _ in range(world)]
    scale_shape = (*shard_shape[:-1], 1) if rowwise else ()
    shard_scales = [torch.rand(scale_shape, generator=gen) + 0.25 for _ in range(world)]
    gathered = torch.cat(shards, dim=gather_dim).reshape(-1, k)
    # rowwise: every row's scale, in A's row order; tensorwise: the one value this rank uses
    a_scale = torch.cat(shard_scales, dim=gather_dim).reshape(-1) if rowwise else shard_scales[0]
    weights = [torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn) for n in ns]
    b_scales = [(torch.rand(1, n, generator=gen) + 0.25) if rowwise else torch.rand((), generator=gen) + 0.25 for n in ns]
    biases = [torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None for n in ns]
    refs = []
    for w, sb, b in zip(weights, b_scales, biases):
        a = gathered.float() * (a_scale[:, None] if rowwise else a_scale)
        ref = a @ (w.float().t() * sb)
        refs.append(ref + (b.float() if b is not None else 0))
    inner = 1
    for size in shard_shape[gather_dim:-1]:
        inner *= size
    to = lambda ts: [None if t is None else t.to(device) for t in ts]  # noqa: E731
    mat2s = [w.to(device).t() for w in weights]  # linear weights: [N, K] transposed
    return gathered.to(device), a_scale.to(device), mat2s, to(b_scales), to(biases), refs, inner


def run_fp8_consumer(
    world, rank, shard_shape, gather_dim, ns, rowwise, bias, seed, config, device="cpu",
    launch=agm.all_gather_matmul_consumer, fast_accum=False, **kwargs,
):  # fmt: skip
    """fp8_problem's consumer call (``launch``: all_gather_matmul_consumer or a kernel taking its
    arguments) as rank ``rank``, every chunk flagged, on NaN-poisoned bf16 outputs (a [batch,
    seq, dim] gather's own rows and row scales apart, as the ops pass them); returns the
    outputs, the timeouts and the references."""
    gathered, a_scale, mat2s, b_scales, biases, refs, inner = fp8_problem(
        world, shard_shape, ns, gather_dim, rowwise, bias, seed, device
    )
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device=device)
    outs = [torch.full((gathered.shape[0], m.shape[1]), float("nan"), dtype=torch.bfloat16, device=device) for m in mat2s]
    timeouts = torch.zeros(world, dtype=torch.int32, device=device)
    local_scale = agm.own_rows(a_scale[:, None], rank, world, inner)[:, 0].contiguous() if rowwise else None
    a_local = agm.own_rows(gathered, rank, world, inner).contiguous() if gather_dim else None
    launch(
        gathered, mat2s, biases, outs, flags, torch.tensor([EPOCH], dtype=torch.int32, device=device),
        rank=rank, world_size=world, inner=inner, a_local=a_local, config=config, timeouts=timeouts,
        scales=agm.Scales(a_scale, local_scale, tuple(b_scales), fast_accum), **kwargs,
    )  # fmt: skip
    return outs, timeouts, refs
