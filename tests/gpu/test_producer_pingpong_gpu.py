"""The warp-specialized Gluon float8 producer (templates/matmul_reduce_scatter_pingpong.py) on one
Hopper GPU with simulated peers (tests/producer_cases.py): every rank's partials in every
owner's slot against the dequantized product (one matmul or a sum of them; fast and exact
accumulation), exact against _scaled_mm's, every chunk flagged, the counters left at zero for
the next call, back to back. Skipped elsewhere."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
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
         counters=None, fast_accum=True, launch=pingpong.matmul_reduce_scatter_pingpong):  # fmt: skip
    scales = [tuple(s.cuda() for s in pair) for pair in _scales(world, rows, n, rowwise, seed)]
    results = simulate(
        world, rows, k, n, FP8, bias, seed=seed, num_programs=num_programs, config=config, outer=outer,
        device="cuda", scales=scales, out_dtype=torch.bfloat16, launch=launch, epoch=epoch, counters=counters,
        fast_accum=fast_accum,
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
@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
def test_partials_land_in_the_owners_slots(config, rowwise, world, rows, outer, k, n, bias, num_programs, fast_accum):
    """Fast accumulation (pingpong) and exact (the cooperative form)."""
    (inputs, mat2, b, partials, flags, counters), scales = _run(
        world, rows, k, n, bias, rowwise, outer, num_programs=num_programs, config=config, fast_accum=fast_accum
    )
    check_partials(inputs, mat2, b, partials, world, rows, 3e-2 if fast_accum else 1e-2, outer, scales)
    assert (flags == 5).all(), flags  # every owner saw every producer's chunk
    assert all((c == 0).all() for c in counters), counters  # left ready for the next call


def test_back_to_back_calls_with_growing_epochs():
    """New operands, shapes, scale kinds, configs and epoch on every call, exact accumulation on
    every third (the cooperative form counts each tile twice), each rank's counters the previous
    call's (which the kernel must have left at zero)."""
    world, counters = 3, None
    for call in range(8):
        rows = 128 + 64 * (call % 4)
        (inputs, mat2, b, partials, flags, counters), scales = _run(
            world, rows, 256, 128 + 8 * call, call % 2 == 0, call % 3 == 0, seed=call, num_programs=7 + call,
            config=pingpong.CONFIGS[call % 2], epoch=10 + call, counters=counters, fast_accum=call % 3 != 1,
        )  # fmt: skip
        check_partials(inputs, mat2, b, partials, world, rows, 3e-2, 1, scales)
        assert (flags == 10 + call).all() and all((c == 0).all() for c in counters), call


def _sum_launch(extra):
    """The producer with rank r's further terms ``extra[r]`` summed in."""

    def launch(*args, rank, **kwargs):
        return pingpong.matmul_reduce_scatter_pingpong(*args, rank=rank, terms=extra[rank], **kwargs)

    return launch


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rows, outer, ks, n, num_programs",
    [
        (2, 256, 1, (512, 128, 320), 384, None),  # Q, K, V's input gradient: unequal K, a partial K block
        (3, 154, 2, (256, 384), 200, 5),  # gate and up; 77-row blocks, N not a tile multiple
    ],
)
def test_sum_of_matmuls(rowwise, world, rows, outer, ks, n, num_programs, fast_accum):
    """A sum: every rank's partial is sum_t (A_t * its scales) @ (B_t * its scales) + bias,
    each term with scales of its own; the cooperative form, whatever the accumulation."""
    gen = torch.Generator().manual_seed(len(ks) + world)
    extra = []  # per rank: [(a, mat2, scales)] of the terms after the first
    for _ in range(world):
        terms = []
        for k in ks[1:]:
            a = torch.randn(world * rows, k, generator=gen).to(FP8).cuda()
            mat2 = torch.randn(n, k, generator=gen).to(FP8).cuda().t()
            a_scale = torch.rand(world * rows if rowwise else 1, generator=gen) + 0.25
            b_scale = torch.rand(n if rowwise else 1, generator=gen) + 0.25
            terms.append((a, mat2, (a_scale.cuda(), b_scale.cuda())))
        extra.append(terms)
    (inputs, mat2, b, partials, flags, counters), scales = _run(
        world, rows, ks[0], n, True, rowwise, outer, num_programs=num_programs, fast_accum=fast_accum,
        launch=_sum_launch(extra),
    )  # fmt: skip
    inner = rows // outer
    for owner in range(world):
        for producer in range(world):
            got = partials[owner][producer * rows : (producer + 1) * rows].float()
            want = b.float().expand(rows, n).clone()
            for a, m, (a_scale, b_scale) in [(inputs[producer], mat2, scales[producer]), *extra[producer]]:
                dequantized = a.float() * a_scale.view(-1, 1)
                want += agm.own_rows(dequantized, owner, world, inner) @ (m.float() * b_scale.view(1, -1))
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert (flags == 5).all(), flags
    assert all((c == 0).all() for c in counters), counters


def test_exact_accumulation_agrees_with_scaled_mm():
    """use_fast_accum=False (the cooperative form) against torch._scaled_mm's exact accumulation
    of each rank's chunk: as close as two fp32 sums of the same K-block products can be, where
    fast accumulation is visibly further off."""
    world, rows, k, n = 2, 512, 2048, 384
    (inputs, mat2, _, partials, _, _), scales = _run(world, rows, k, n, False, True, fast_accum=False)
    for owner in range(world):
        for producer in range(world):
            a_scale, b_scale = scales[producer]
            a = agm.own_rows(inputs[producer], owner, world, rows)
            a_scale = agm.own_rows(a_scale.view(-1, 1), owner, world, rows)
            exact, fast = (
                torch._scaled_mm(a, mat2, a_scale, b_scale.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=f)
                for f in (False, True)
            )  # fmt: skip
            got = partials[owner][producer * rows : (producer + 1) * rows]
            ours, theirs = _relative(got, exact), _relative(fast, exact)
            assert ours < 1e-3 and ours < theirs, (owner, producer, ours, theirs)


def _relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
