"""The warp-specialized Gluon float8 consumer (templates/all_gather_matmul_pingpong.py) on one
Hopper GPU with simulated peers: against the dequantized product with fast and exact
accumulation, exact against _scaled_mm's, a chunk that never lands reported, and back-to-back
calls (chunks landing while it runs: test_consumer_gpu.py). Skipped
elsewhere."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import all_gather_matmul_pingpong as pingpong

from tests.consumer_cases import EPOCH, fp8_problem, run_fp8_consumer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not pingpong.usable(torch.device("cuda", 0)), reason="needs a Hopper GPU"
)


def _check(out, ref, tol=1e-2):
    assert not torch.isnan(out).any(), "some output rows were never written"
    err = ((out.float().cpu() - ref.float().cpu()).norm() / ref.float().norm()).item()
    assert err <= tol, err


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("config", pingpong.CONFIGS, ids=str)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rank, shard_shape, gather_dim, ns, bias",
    [
        (2, 1, (1000, 512), 0, (1024,), False),
        (4, 2, (2, 333, 256), 1, (384, 128, 144), True),  # Q, K, V of unequal N, [batch, seq, dim]
        (3, 0, (3, 77, 384), 1, (200,), True),  # chunks far shorter than a tile, 3 blocks each
    ],
)
def test_matches_dequantized(config, rowwise, world, rank, shard_shape, gather_dim, ns, bias, fast_accum):
    """Against the dequantized product in fp32; exact accumulation (the cooperative form) to
    bf16's rounding, fast accumulation within its looser error."""
    outs, timeouts, refs = run_fp8_consumer(
        world, rank, shard_shape, gather_dim, ns, rowwise, bias, world + rowwise, config, "cuda",
        launch=pingpong.all_gather_matmul_pingpong, fast_accum=fast_accum, spin_limit=1 << 20,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert not timeouts.any()
    for out, ref in zip(outs, refs):
        _check(out, ref, 1e-2 if fast_accum else 5e-3)


def test_exact_accumulation_agrees_with_scaled_mm():
    """use_fast_accum=False (the cooperative form) against torch._scaled_mm's exact accumulation
    on the gathered rows: as close as two fp32 sums of the same K-block products can be, where
    fast accumulation is visibly further off."""
    gathered, a_scale, mat2s, b_scales, biases, _, inner = fp8_problem(2, (512, 1024), (384,), 0, True, False, 3, "cuda")
    exact = torch._scaled_mm(gathered, mat2s[0], a_scale.view(-1, 1), b_scales[0], out_dtype=torch.bfloat16)
    fast = torch._scaled_mm(gathered, mat2s[0], a_scale.view(-1, 1), b_scales[0], out_dtype=torch.bfloat16, use_fast_accum=True)
    out = torch.full_like(exact, float("nan"))
    timeouts = torch.zeros(2, dtype=torch.int32, device="cuda")
    pingpong.all_gather_matmul_pingpong(
        gathered, mat2s, biases, [out], torch.full((2,), EPOCH, dtype=torch.int32, device="cuda"),
        torch.tensor([EPOCH], dtype=torch.int32, device="cuda"), rank=0, world_size=2, inner=inner,
        scales=agm.Scales(a_scale, None, tuple(b_scales), fast_accum=False), config=pingpong.CONFIGS[0],
        spin_limit=100_000, timeouts=timeouts,
    )  # fmt: skip
    torch.cuda.synchronize()
    agm.raise_on_timeouts(timeouts, 0)
    ours, theirs = _relative(out, exact), _relative(fast, exact)
    assert ours < 1e-3 and ours < theirs, (ours, theirs)


def _relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_late_chunk_is_reported():
    """A chunk whose flag never comes: the loader gives up after its bounded poll, the kernel
    ends, and the chunk is named."""
    world, rank, late = 4, 2, 1
    gathered, a_scale, mat2s, b_scales, biases, _, inner = fp8_problem(world, (256, 256), (256,), 0, False, False, 2, "cuda")
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device="cuda")
    flags[late] = EPOCH - 1
    out = torch.empty(gathered.shape[0], 256, dtype=torch.bfloat16, device="cuda")
    timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
    pingpong.all_gather_matmul_pingpong(
        gathered, mat2s, biases, [out], flags, torch.tensor([EPOCH], dtype=torch.int32, device="cuda"),
        rank=rank, world_size=world, inner=inner, scales=agm.Scales(a_scale, None, tuple(b_scales), fast_accum=True),
        config=pingpong.CONFIGS[0], spin_limit=10_000, timeouts=timeouts,
    )  # fmt: skip
    torch.cuda.synchronize()
    with pytest.raises(agm.ChunkTimeout, match="rank 2 gave up waiting for the flags of chunks \\[1\\]"):
        agm.raise_on_timeouts(timeouts, rank)


def test_back_to_back_calls_with_growing_epochs():
    """New operands, rank, shapes and epoch on every call, exact accumulation on every third;
    each call's outputs poisoned first."""
    world = 4
    for call in range(20):
        epoch = EPOCH + call
        rows = 64 + 48 * (call % 5)
        gathered, a_scale, mat2s, b_scales, biases, refs, inner = fp8_problem(
            world, (rows, 256), (256, 128)[: 1 + call % 2], 0, call % 2 == 0, call % 3 == 0, call, "cuda"
        )
        outs = [torch.full((gathered.shape[0], m.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda") for m in mat2s]
        timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
        pingpong.all_gather_matmul_pingpong(
            gathered, mat2s, biases, outs, torch.full((world,), epoch, dtype=torch.int32, device="cuda"),
            torch.tensor([epoch], dtype=torch.int32, device="cuda"), rank=call % world, world_size=world,
            inner=inner, scales=agm.Scales(a_scale, None, tuple(b_scales), fast_accum=call % 3 != 1),
            config=pingpong.CONFIGS[call % 2], spin_limit=100_000, timeouts=timeouts,
        )  # fmt: skip
        torch.cuda.synchronize()
        agm.raise_on_timeouts(timeouts, call % world)
        for out, ref in zip(outs, refs):
            _check(out, ref)


def test_more_weights_than_a_launch_takes_with_mixed_scales_and_biases():
    """Five weights: two launches (MAX_B a launch); inside each, weights with a bias and without,
    with one scale and with one per column, of unequal N, against each one's dequantized
    product."""
    world, rank, ns = 2, 1, (256, 136, 200, 128, 384)
    assert len(ns) > pingpong.MAX_B
    gathered, a_scale, mat2s, b_scales, biases, _, inner = fp8_problem(world, (300, 256), ns, 0, True, True, 7, "cuda")
    b_scales[1], b_scales[4] = b_scales[1][0, 3].clone(), b_scales[4][0, 0].clone()  # one value each
    biases[0] = biases[3] = None
    a = gathered.float().cpu() * a_scale.cpu()[:, None]
    refs = [
        a @ (m.float().cpu() * s.cpu()) + (b.float().cpu() if b is not None else 0)
        for m, s, b in zip(mat2s, b_scales, biases)
    ]
    outs = [torch.full((gathered.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda") for n in ns]
    timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
    pingpong.all_gather_matmul_pingpong(
        gathered, mat2s, biases, outs, torch.full((world,), EPOCH, dtype=torch.int32, device="cuda"),
        torch.tensor([EPOCH], dtype=torch.int32, device="cuda"), rank=rank, world_size=world, inner=inner,
        scales=agm.Scales(a_scale, None, tuple(b_scales), fast_accum=True), config=pingpong.CONFIGS[0],
        spin_limit=100_000, timeouts=timeouts,
    )  # fmt: skip
    torch.cuda.synchronize()
    agm.raise_on_timeouts(timeouts, rank)
    for out, ref in zip(outs, refs):
        _check(out, ref)
