"""The all-gather consumer GEMM on one GPU with simulated peers (chunks in place, flags preset or
held back). Skipped without a GPU."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
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


def test_late_chunk_is_reported_on_the_gpu():
    world, rank, late = 4, 2, 1
    gathered, mat2s, biases, _, inner = problem(world, (256, 128), 256, torch.bfloat16, False, 0, device="cuda")
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device="cuda")
    flags[late] = EPOCH - 1
    _, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, spin_limit=10_000)
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
