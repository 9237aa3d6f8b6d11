"""The all-gather consumer GEMM in float8 (A and B float8, scales in the epilogue) on one GPU with
simulated peers, against the dequantized product in fp32. Skipped without a GPU."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import gemm

from tests.consumer_cases import EPOCH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _fp8_problem(world, shard_shape, ns, gather_dim, rowwise, bias, seed):
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
    cuda = lambda ts: [None if t is None else t.cuda() for t in ts]  # noqa: E731
    mat2s = [w.cuda().t() for w in weights]  # linear weights: [N, K] transposed
    return gathered.cuda(), a_scale.cuda(), mat2s, cuda(b_scales), cuda(biases), refs, inner


@pytest.mark.parametrize("config", gemm.CONFIGS[:3], ids=str)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rank, shard_shape, gather_dim, ns, bias",
    [
        (2, 1, (1000, 512), 0, (1024,), False),
        (4, 2, (2, 333, 256), 1, (384, 128, 144), True),  # Q, K, V of unequal N, [batch, seq, dim]
    ],
)
def test_fp8_consumer_matches_dequantized(config, rowwise, world, rank, shard_shape, gather_dim, ns, bias):
    gathered, a_scale, mat2s, b_scales, biases, refs, inner = _fp8_problem(
        world, shard_shape, ns, gather_dim, rowwise, bias, seed=world + rowwise
    )
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device="cuda")
    outs = [torch.full((gathered.shape[0], m.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda") for m in mat2s]
    timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
    local_scale = agm.own_rows(a_scale[:, None], rank, world, inner)[:, 0].contiguous() if rowwise else None
    scales = agm.Scales(a_scale, local_scale, tuple(b_scales))
    a_local = agm.own_rows(gathered, rank, world, inner).contiguous() if gather_dim else None
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, flags, torch.tensor([EPOCH], dtype=torch.int32, device="cuda"),
        rank=rank, world_size=world, inner=inner, a_local=a_local, config=config, timeouts=timeouts,
        spin_limit=1 << 20, scales=scales,
    )
    torch.cuda.synchronize()
    assert not timeouts.any()
    for out, ref in zip(outs, refs):
        assert not torch.isnan(out).any(), "some output rows were never written"
        err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, err


def test_fp8_consumer_agrees_with_scaled_mm():
    """Tensorwise, against torch._scaled_mm itself (cuBLAS) on the same operands."""
    gathered, a_scale, mat2s, b_scales, biases, _, inner = _fp8_problem(2, (512, 256), (256,), 0, False, False, 3)
    flags = torch.full((2,), EPOCH, dtype=torch.int32, device="cuda")
    out = torch.full((gathered.shape[0], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, [out], flags, torch.tensor([EPOCH], dtype=torch.int32, device="cuda"),
        rank=0, world_size=2, inner=inner, config=gemm.CONFIGS[2], spin_limit=1 << 20,
        scales=agm.Scales(a_scale, None, tuple(b_scales)),
    )
    ref = torch._scaled_mm(gathered, mat2s[0], a_scale, b_scales[0], out_dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
