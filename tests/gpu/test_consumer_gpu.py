"""The all-gather consumer GEMM on one GPU with simulated peers (chunks in place, flags preset or
held back). Skipped without a GPU."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import all_gather_matmul_pingpong as pingpong
from overlap_pass.templates import gemm

from tests.consumer_cases import EPOCH, problem, run_consumer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _check(outs, refs, dtype):
    for out, ref in zip(outs, refs):
        assert not torch.isnan(out).any(), "some output rows were never written"
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err <= REL_TOL[dtype], err


@pytest.mark.parametrize("config", gemm.CONFIGS + [gemm.TEST_CONFIG], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "world, shard_shape, gather_dim, ns, bias",
    [
        (4, (1000, 520), 0, 1000, True),
        (2, (2, 333, 256), 1, (384, 128, 130), (True, False, True)),  # Q, K, V of unequal N
        (4, (3, 77, 64), 1, (200, 200), False),
    ],
)
def test_matches_torch(config, dtype, world, shard_shape, gather_dim, ns, bias):
    gathered, mat2s, biases, refs, inner = problem(
        world, shard_shape, ns, dtype, bias, gather_dim, device="cuda"
    )
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device="cuda")
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, 1, inner, flags, config=config)
    torch.cuda.synchronize()
    assert not timeouts.any()
    _check(outs, refs, dtype)


@pytest.mark.parametrize("kernel", ["bf16", "float8", "float8 gluon"])
def test_chunks_landing_while_the_consumer_runs(kernel):
    """Peer chunks NaN until they land, from another stream, long after the consumer started
    (a sleep first), each copied in and then flagged. The TMA consumer's pipeline issues loads
    stages ahead and across tiles: a load above its chunk's wait would read the NaNs; the Gluon
    one's loader warp must wait, then fence, before its TMA loads. Few programs, so that each
    goes through every chunk and the landing stream finds free SMs."""
    float8 = kernel != "bf16"
    world, rank, rows, k, n = 4, 1, 512, 512, 640
    gen = torch.Generator(device="cuda").manual_seed(3)
    dtype = torch.float8_e4m3fn if float8 else torch.bfloat16
    real = torch.randn(world * rows, k, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    gathered = real.clone()
    for chunk in range(world):
        if chunk != rank:  # e4m3's NaN is 0x7f
            gathered[chunk * rows : (chunk + 1) * rows].view(torch.uint8).fill_(0x7F)
    scales, config, launch = None, gemm.CONFIGS[0], agm.all_gather_matmul_consumer
    if float8:
        one = torch.ones((), device="cuda")
        scales, config = agm.Scales(one, None, (one,), fast_accum=True), gemm.FLOAT8_CONFIGS[0]
    if kernel == "float8 gluon":
        if not pingpong.usable(torch.device("cuda", 0)):
            pytest.skip("the Gluon consumer needs a Hopper GPU")
        config, launch = pingpong.CONFIGS[0], pingpong.all_gather_matmul_pingpong
    ref = (real.float() @ weight.float().t()).to(torch.bfloat16)
    out = torch.full((world * rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    flags = torch.full((world,), EPOCH - 1, dtype=torch.int32, device="cuda")
    landed = torch.full((1,), EPOCH, dtype=torch.int32, device="cuda")
    timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
    lander = torch.cuda.Stream()
    with torch.cuda.stream(lander):  # loaded before: loading a kernel waits for running ones
        torch.cuda._sleep(1)
    torch.cuda.synchronize()
    launch(
        gathered, [weight.t()], [None], [out], flags, torch.tensor([EPOCH], dtype=torch.int32, device="cuda"),
        rank=rank, world_size=world, inner=rows, config=config, num_programs=4, timeouts=timeouts,
        scales=scales, spin_limit=5_000_000,
    )  # fmt: skip
    with torch.cuda.stream(lander):
        torch.cuda._sleep(2_000_000)  # about a millisecond: the consumer is well into its own chunk
        for step in range(1, world):
            chunk = (rank + step) % world
            gathered[chunk * rows : (chunk + 1) * rows].copy_(real[chunk * rows : (chunk + 1) * rows])
            flags[chunk : chunk + 1].copy_(landed)
    torch.cuda.synchronize()
    agm.raise_on_timeouts(timeouts, rank)
    _check([out], [ref], torch.bfloat16)


@pytest.mark.parametrize("config", [gemm.TEST_CONFIG, gemm.CONFIGS[0]], ids=str)
def test_late_chunk_is_reported_on_the_gpu(config):
    """Pointer loads (wait_flag) and TMA (the inline-PTX poll of wait_flag_in_pipeline)."""
    world, rank, late = 4, 2, 1
    gathered, mat2s, biases, _, inner = problem(world, (256, 128), 256, torch.bfloat16, False, 0, device="cuda")
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device="cuda")
    flags[late] = EPOCH - 1
    _, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, config=config, spin_limit=10_000)
    torch.cuda.synchronize()
    with pytest.raises(agm.ChunkTimeout, match="rank 2 gave up waiting for the flags of chunks \\[1\\]"):
        agm.raise_on_timeouts(timeouts, rank)


def test_back_to_back_calls_with_growing_epochs():
    world = 4
    for call in range(50):
        epoch = EPOCH + call
        shape = (64 + 17 * (call % 5), 96)
        ns = (80, 48)[: 1 + call % 2]
        gathered, mat2s, biases, refs, inner = problem(
            world, shape, ns, torch.bfloat16, call % 3 == 0, 0, seed=call, device="cuda"
        )
        flags = torch.full((world,), epoch, dtype=torch.int32, device="cuda")
        outs = [torch.full_like(r, float("nan")) for r in refs]
        timeouts = torch.zeros(world, dtype=torch.int32, device="cuda")
        agm.all_gather_matmul_consumer(
            gathered, mat2s, biases, outs, flags, torch.tensor([epoch], dtype=torch.int32, device="cuda"),
            rank=call % world, world_size=world, inner=inner, config=gemm.CONFIGS[2],
            timeouts=timeouts, spin_limit=100_000,
        )
        agm.raise_on_timeouts(timeouts, call % world)
        _check(outs, refs, torch.bfloat16)
