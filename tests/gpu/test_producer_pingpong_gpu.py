"""The warp-specialized Gluon float8 producer (templates/matmul_reduce_scatter_pingpong.py) on one
Hopper GPU with simulated peers (tests/producer_cases.py): every rank's partials in every
owner's slot against the dequantized product, every chunk flagged, the counters left at zero
for the next call, back to back. Skipped elsewhere."""

import pytest
import torch

from overlap_pass.templates import matmul_reduce_scatter_pingpong as pingpong

from tests.producer_cases import check_partials, simulate

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not pingpong.usable(torch.device("cuda", 0)), reason="needs a Hopper GPU"
)
FP8 = torch.float8_e4m3fn


def _scales(world, rows, n, rowwise, seed):
    gen = torch.Generator().manual_seed(seed)
    if rowwise:  # one per row of A (A's row order), one per column of B
        return [(torch.rand(world * rows, generator=gen) + 0.25, torch.rand(n, generator=gen) + 0.25) for _ in range(world)]
    return [(torch.rand(1, generator=gen) + 0.25, torch.rand(1, generator=gen) + 0.25) for _ in range(world)]


def _run(world, rows, k, n, bias, rowwise, outer=1, seed=0, num_programs=None, config=pingpong.CONFIGS[0], epoch=5,
         counters=None):  # fmt: skip
    scales = [tuple(s.cuda() for s in pair) for pair in _scales(world, rows, n, rowwise, seed)]
    results = simulate(
        world, rows, k, n, FP8, bias, seed=seed, num_programs=num_programs, config=config, outer=outer,
        device="cuda", scales=scales, out_dtype=torch.bfloat16, launch=pingpong.matmul_reduce_scatter_pingpong,
        epoch=epoch, counters=counters, fast_accum=True,
    )  # fmt: skip
    torch.cuda.synchronize()
    return results, scales


@pytest.mark.parametrize("config", pingpong.CONFIGS, ids=str)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rows, outer, k, n, bias",
    [
        (2, 256, 1, 256, 384, False),
        (4, 200, 2, 384, 136, True),  # blocks of 100 rows: shorter than a tile; N not a tile multiple
        (3, 231, 3, 256, 200, True),  # 77-row blocks, three of them per chunk
    ],
)
@pytest.mark.parametrize("num_programs", [None, 3], ids=["programs=SMs", "programs=3"])
def test_partials_land_in_the_owners_slots(config, rowwise, world, rows, outer, k, n, bias, num_programs):
    (inputs, mat2, b, partials, flags, counters), scales = _run(
        world, rows, k, n, bias, rowwise, outer, num_programs=num_programs, config=config
    )
    check_partials(inputs, mat2, b, partials, world, rows, 3e-2, outer, scales)
    assert (flags == 5).all(), flags  # every owner saw every producer's chunk
    assert all((c == 0).all() for c in counters), counters  # left ready for the next call


def test_back_to_back_calls_with_growing_epochs():
    """New operands, shapes, scale kinds, configs and epoch on every call, each rank's counters
    the previous call's (which the kernel must have left at zero)."""
    world, counters = 3, None
    for call in range(8):
        rows = 128 + 64 * (call % 4)
        (inputs, mat2, b, partials, flags, counters), scales = _run(
            world, rows, 256, 128 + 8 * call, call % 2 == 0, call % 3 == 0, seed=call, num_programs=7 + call,
            config=pingpong.CONFIGS[call % 2], epoch=10 + call, counters=counters,
        )  # fmt: skip
        check_partials(inputs, mat2, b, partials, world, rows, 3e-2, 1, scales)
        assert (flags == 10 + call).all() and all((c == 0).all() for c in counters), call
