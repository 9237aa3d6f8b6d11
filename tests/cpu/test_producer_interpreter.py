"""The matmul + reduce-scatter kernels under TRITON_INTERPRET=1 with simulated peers: every
rank's partials land in the owner's buffer, in its slot, with the bias (pointer and TMA loads);
every chunk is published with the epoch; tiles go rank + 1 first, own chunk last; a chunk of
several blocks ([batch, seq, dim] scattered along seq) is read in place; the owner's reduction
sums in fp32 in rank order, scales for avg, and names a peer whose partial never came, both as a
kernel of its own and in the epilogue of the producer's own chunk."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from overlap_pass.ops import schedule  # noqa: E402
from overlap_pass.templates import gemm  # noqa: E402
from overlap_pass.templates import matmul_reduce_scatter as mrs  # noqa: E402
from tests.producer_cases import EPOCH, check_partials, simulate  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("world, rows, k, n, bias", [(2, 13, 24, 19, True), (3, 16, 20, 40, False), (4, 5, 33, 17, True)])
def test_partials_land_in_the_owners_slots_and_sum_to_the_reduce_scatter(dtype, world, rows, k, n, bias):
    inputs, mat2, b, partials, flags, counters = simulate(world, rows, k, n, dtype, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_partials(inputs, mat2, b, partials, world, rows, tol)
    for owner in range(world):  # every rank's matmul + bias, summed: the op's semantics
        total = partials[owner].float().view(world, rows, n).sum(0)
        full = sum(x.float() @ mat2.float() + (b.float() if bias else 0) for x in inputs)
        torch.testing.assert_close(total, full[owner * rows : (owner + 1) * rows], atol=10 * tol, rtol=10 * tol)
    assert (flags == EPOCH).all(), flags
    assert all(not c.any() for c in counters), "the last tile of each chunk resets its counter"


@pytest.mark.parametrize("config", ["pointer", "tma"])
@pytest.mark.parametrize("world, rows, outer", [(2, 12, 4), (3, 10, 2), (2, 64, 2)])
def test_a_chunk_of_several_blocks_is_read_in_place(config, world, rows, outer):
    """[batch, seq, dim] scattered along seq: chunk j is ``outer`` blocks of rows; each owner's
    slot holds them in block order, as its output rows; tiles never straddle two blocks (blocks
    of 3, 5 and 32 rows against BLOCK_M 16)."""
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=config == "tma")
    inputs, mat2, b, partials, flags, counters = simulate(
        world, rows, 16, 24, torch.float16, True, config=config, outer=outer
    )
    check_partials(inputs, mat2, b, partials, world, rows, 1e-2, outer)
    assert (flags == EPOCH).all() and all(not c.any() for c in counters)


@pytest.mark.parametrize("a_scale, b_scale", [("one", "one"), ("rows", "columns"), ("rows", "one")])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("world, rows, outer, bias", [(2, 16, 1, True), (3, 12, 2, False)])
def test_float8_partials_are_dequantized_before_the_bias(a_scale, b_scale, dtype, world, rows, outer, bias):
    """Float8 operands (TMA only): each tile's fp32 accumulator times A's scale (one, or its
    rows', read from A's row order, also for chunks of several blocks) and B's (one, or its
    columns'), then the bias, stored as bf16 in the owner's slot."""
    k, n = 32, 48
    gen = torch.Generator().manual_seed(7)
    sizes = {"one": 1, "rows": world * rows, "columns": n}
    scales = [tuple(torch.rand(sizes[s], generator=gen) + 0.5 for s in (a_scale, b_scale)) for _ in range(world)]
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    inputs, mat2, b, partials, flags, counters = simulate(
        world, rows, k, n, dtype, bias, config=config, outer=outer, scales=scales, out_dtype=torch.bfloat16
    )
    check_partials(inputs, mat2, b, partials, world, rows, 2e-2, outer, scales=scales)
    assert (flags == EPOCH).all() and all(not c.any() for c in counters)


def test_float8_refuses_pointer_loads_and_a_scale_of_the_wrong_size():
    world, rows, k, n = 2, 16, 32, 48
    a = torch.randn(world * rows, k).to(torch.float8_e4m3fn)
    mat2 = torch.randn(n, k).to(torch.float8_e4m3fn).t()
    one = torch.ones(1)
    args = (
        a, mat2, None, torch.zeros(world, dtype=torch.int64), torch.zeros(world, dtype=torch.int64),
        torch.zeros(world, dtype=torch.int32), torch.tensor([EPOCH], dtype=torch.int32),
    )  # fmt: skip
    tma = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    with pytest.raises(ValueError, match="float8 needs a TMA config"):
        mrs.matmul_reduce_scatter_producer(*args, rank=0, world_size=world, config=gemm.TEST_CONFIG, scales=(one, one))
    with pytest.raises(ValueError, match="got 5 and 1"):
        mrs.matmul_reduce_scatter_producer(*args, rank=0, world_size=world, config=tma, scales=(torch.ones(5), one))
    with pytest.raises(ValueError, match="take scales"):
        mrs.matmul_reduce_scatter_producer(*args, rank=0, world_size=world, config=tma)


@pytest.mark.parametrize("world, rank", [(2, 0), (4, 1), (4, 3), (8, 5)])
def test_tiles_go_rank_plus_one_first_and_own_chunk_last(world, rank):
    rows, k, n = 20, 16, 40
    a = torch.randn(world * rows, k)
    mat2 = torch.randn(k, n)
    partials = [torch.empty(world * rows, n) for _ in range(world)]
    flags = torch.zeros(world, dtype=torch.int32)
    tiles_per_chunk = 2 * 3  # ceil(20 / 16) x ceil(40 / 16)
    log = torch.zeros(world * tiles_per_chunk + 1, dtype=torch.int32)
    mrs.matmul_reduce_scatter_producer(
        a, mat2, None, torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64),
        torch.tensor([flags[j].data_ptr() for j in range(world)], dtype=torch.int64),
        torch.zeros(world, dtype=torch.int32), torch.tensor([EPOCH], dtype=torch.int32),
        rank=rank, world_size=world, config=gemm.TEST_CONFIG, num_programs=1, tile_log=log,
    )  # fmt: skip
    started = log[:-1].argsort()
    chunk_of_tile = [(rank + 1 + int(t) // tiles_per_chunk) % world for t in started]
    expected = [c for c in schedule.reduce_scatter_order(rank, world) for _ in range(tiles_per_chunk)]
    assert chunk_of_tile == expected


def test_back_to_back_calls_publish_each_epoch():
    """Counters left at zero by one call serve the next; flags take each call's epoch."""
    world, rows, k, n = 2, 8, 16, 16
    a, mat2 = torch.randn(world * rows, k), torch.randn(k, n)
    partials = [torch.empty(world * rows, n) for _ in range(world)]
    flags = torch.zeros(world, dtype=torch.int32)
    counters = torch.zeros(world, dtype=torch.int32)
    for epoch in (1, 2, 3):
        mrs.matmul_reduce_scatter_producer(
            a, mat2, None, torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64),
            torch.tensor([flags[j].data_ptr() for j in range(world)], dtype=torch.int64),
            counters, torch.tensor([epoch], dtype=torch.int32), rank=0, world_size=world,
            config=gemm.TEST_CONFIG, num_programs=2,
        )  # fmt: skip
        assert flags.tolist() == [epoch, epoch] and not counters.any()


@pytest.mark.parametrize("world, rows, k, n, bias", [(2, 20, 32, 40, True), (4, 9, 16, 24, False)])
def test_tma_producer_matches_pointer_semantics(world, rows, k, n, bias):
    """TMA loads: rows of the next chunk and N past the block are dropped by the masked store."""
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    inputs, mat2, b, partials, flags, counters = simulate(world, rows, k, n, torch.float16, bias, config=config)
    assert gemm.tma_fits(inputs[0], mat2)
    check_partials(inputs, mat2, b, partials, world, rows, 1e-2)
    assert (flags == EPOCH).all() and all(not c.any() for c in counters)


def _reduce_in_epilogue(world, rank, rows, outer, config, dtype, out_dtype, scale, flags=None, spin_limit=1000, **kw):
    """Every rank's producer (simulate: the peers' partials land in ``rank``'s buffer, flagged),
    then ``rank``'s again, summing its own chunk in the epilogue, with its own slot poisoned
    first; returns (out, the partials buffer, what the sum should be, timeouts)."""
    n = 24
    inputs, mat2, b, partials, all_flags, counters = simulate(world, rows, 16, n, dtype, True, config=config, outer=outer, **kw)
    mine = partials[rank].view(world, rows, n)
    want = mine[rank].float().clone()  # own first, then the peers in rank order, in fp32
    for peer in range(world):
        if peer != rank:
            want += mine[peer].float()
    want = (want * scale).to(out_dtype)
    mine[rank].fill_(float("nan"))
    out = torch.full((rows, n), float("nan"), dtype=out_dtype)
    timeouts = torch.zeros(world, dtype=torch.int32)
    flags = all_flags[rank] if flags is None else flags
    reduction = mrs.OwnReduction(out, flags, timeouts, scale, spin_limit)
    mrs.matmul_reduce_scatter_producer(
        inputs[rank], mat2, b, torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64),
        torch.tensor([all_flags[j, rank].data_ptr() for j in range(world)], dtype=torch.int64), counters[rank],
        torch.tensor([EPOCH], dtype=torch.int32), rank=rank, world_size=world, config=config, num_programs=3,
        inner=rows // outer, own_reduction=reduction, **kw,
    )  # fmt: skip
    return out, mine, want, timeouts


@pytest.mark.parametrize("config", ["pointer", "tma"])
@pytest.mark.parametrize(
    "world, rank, rows, outer, scale", [(2, 0, 13, 1, 1.0), (3, 2, 12, 2, 1.0 / 3), (4, 1, 10, 2, 1.0)]
)
def test_own_chunk_is_summed_in_the_epilogue(config, world, rank, rows, outer, scale):
    """The producer that reduces its own chunk: out = scale * (its own partial, then each
    peer's slot in rank order, in fp32), bit for bit; its own slot is never written (it stays
    poisoned); no wait gives up."""
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=config == "tma")
    out, mine, want, timeouts = _reduce_in_epilogue(world, rank, rows, outer, config, torch.float16, torch.float16, scale)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert mine[rank].isnan().all(), "the own chunk's partial is summed in place, not stored"
    assert not timeouts.any()


def test_epilogue_sum_writes_a_wider_output():
    """fp16 partials (the inputs' dtype), an fp32 output (autocast's input gradients)."""
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    out, _, want, _ = _reduce_in_epilogue(2, 1, 16, 1, config, torch.float16, torch.float32, 1.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_epilogue_sum_names_a_peer_whose_partial_never_came():
    world, rank = 4, 0
    flags = torch.tensor([0, EPOCH, EPOCH - 1, EPOCH], dtype=torch.int32)  # rank 2 is a call behind
    *_, timeouts = _reduce_in_epilogue(world, rank, 8, 1, gemm.TEST_CONFIG, torch.float32, torch.float32, 1.0,
                                       flags=flags, spin_limit=50)  # fmt: skip
    assert timeouts.tolist() == [0, 0, EPOCH, 0]


def test_epilogue_sum_refuses_an_output_of_another_shape():
    world, rows, n = 2, 8, 16
    a, mat2 = torch.randn(world * rows, 8), torch.randn(8, n)
    words = torch.zeros(world, dtype=torch.int32)
    with pytest.raises(ValueError, match="is not a contiguous"):
        mrs.matmul_reduce_scatter_producer(
            a, mat2, None, torch.zeros(world, dtype=torch.int64), torch.zeros(world, dtype=torch.int64), words,
            torch.tensor([1], dtype=torch.int32), rank=0, world_size=world, config=gemm.TEST_CONFIG,
            own_reduction=mrs.OwnReduction(torch.empty(rows + 1, n), words, words),
        )  # fmt: skip


def _reduce(partials, flags, world, rank, scale, spin_limit=1000):
    rows_n = partials.shape[0] // world, partials.shape[1]
    out = torch.full(rows_n, float("nan"), dtype=partials.dtype)
    timeouts = torch.zeros(world, dtype=torch.int32)
    mrs.reduce_partials(
        partials, out, flags, torch.tensor([EPOCH], dtype=torch.int32), timeouts, rank=rank,
        world_size=world, scale=scale, spin_limit=spin_limit, block=64,
    )  # fmt: skip
    return out, timeouts


@pytest.mark.parametrize("world, rank, scale", [(2, 0, 1.0), (3, 2, 1.0 / 3), (4, 1, 1.0), (8, 7, 1.0 / 8)])
def test_reduction_sums_every_slot_in_fp32_and_scales(world, rank, scale):
    rows, n = 7, 45  # 315 elements: the last block is partial
    partials = torch.randn(world * rows, n)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    flags[rank] = 0  # the own slot needs no flag
    out, timeouts = _reduce(partials, flags, world, rank, scale)
    want = torch.zeros(rows, n)
    for slot in partials.view(world, rows, n):  # rank order, fp32: the kernel's exact sum
        want += slot
    torch.testing.assert_close(out, want * scale, atol=0, rtol=0)
    assert not timeouts.any()


def test_reduction_names_a_peer_whose_partial_never_came():
    world, rank = 4, 0
    partials = torch.randn(world * 4, 8)
    flags = torch.tensor([0, EPOCH, EPOCH - 1, EPOCH], dtype=torch.int32)  # rank 2 is a call behind
    _, timeouts = _reduce(partials, flags, world, rank, 1.0, spin_limit=50)
    assert timeouts.tolist() == [0, 0, EPOCH, 0]


def _term(rows, k, n, dtype=torch.float8_e4m3fn):
    """A further matmul of a sum: (A, its [N, K] weight transposed, one scale each)."""
    return torch.zeros(rows, k).to(dtype), torch.zeros(n, k).to(torch.float8_e4m3fn).t(), (torch.ones(1), torch.ones(1))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dest_ptrs=torch.zeros(3, dtype=torch.int64)), "dest_ptrs must hold 2 int64 addresses"),
        (dict(counters=torch.zeros(2, dtype=torch.int64)), "counters must be 2 int32 words"),
        (dict(scales=(torch.ones(5), torch.ones(1))), "scales of their sizes"),
        (dict(terms=[_term(256, 64, 64)] * 4), "at most 4 matmuls, not 5"),
        (dict(terms=[_term(128, 64, 64)]), "do not join the sum"),  # other rows
        (dict(terms=[_term(256, 64, 32)]), "do not join the sum"),  # other columns
        (dict(terms=[_term(256, 64, 64, torch.float8_e5m2)]), "do not join the sum"),  # another float8 type
    ],
)
def test_gluon_producer_refuses_what_it_cannot_take(change, message):
    """The Gluon float8 producer's host checks, before any launch (so on any machine): the
    protocol's address and counter words, scales of other sizes, sums of more matmuls than a
    launch takes or of terms that do not line up."""
    from overlap_pass.templates import matmul_reduce_scatter_pingpong as pingpong

    fp8 = torch.float8_e4m3fn
    args = dict(
        a=torch.zeros(256, 128).to(fp8), mat2=torch.zeros(64, 128).to(fp8).t(), bias=None,
        dest_ptrs=torch.zeros(2, dtype=torch.int64), flag_ptrs=torch.zeros(2, dtype=torch.int64),
        counters=torch.zeros(2, dtype=torch.int32), epoch=torch.ones(1, dtype=torch.int32), rank=0, world_size=2,
        config=pingpong.CONFIGS[0], scales=(torch.ones(1), torch.ones(1)), out_dtype=torch.bfloat16,
        fast_accum=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        pingpong.matmul_reduce_scatter_pingpong(**{**args, **change})


@pytest.mark.parametrize(
    "config_kind, terms, mixed, message",
    [
        ("triton", 2, False, "up to 1 matmul"),
        ("gluon", 5, False, "up to 4 matmul"),
        ("gluon", 2, True, "one float8 type on each side"),
    ],
)
def test_fused_float8_reduce_scatter_refuses_before_the_protocol(config_kind, terms, mixed, message):
    """lowering/scaled.py's fused reduce-scatter refuses what its kernel cannot take before it
    enters the protocol (so every rank refuses alike and nobody waits; the choice then logs a
    refusal, not a failure): a sum for the Triton producer, more matmuls than the Gluon one
    sums, a sum mixing float8 types."""
    from overlap_pass.lowering import scaled
    from overlap_pass.templates import matmul_reduce_scatter_pingpong as pingpong

    config = gemm.FLOAT8_CONFIGS[0] if config_kind == "triton" else pingpong.CONFIGS[0]
    dtypes = [torch.float8_e5m2 if mixed and t else torch.float8_e4m3fn for t in range(terms)]
    inputs = [torch.zeros(2, 64, 32).to(d) for d in dtypes]
    mat2s = [torch.zeros(48, 32).to(torch.float8_e4m3fn).t() for _ in range(terms)]
    ones = [torch.ones(()) for _ in range(terms)]
    with pytest.raises(NotImplementedError, match=message):
        scaled.fused_scaled_mm_reduce_scatter(
            inputs, ones, mat2s, ones, None, "sum", 1, 2, "unused", torch.bfloat16, None, False, gemm_config=config
        )  # fmt: skip


class _StubCall:
    """lowering.matmul_reduce_scatter.Call's surface that reduce_produced uses, recording."""

    rows, n, world = 2, 3, 4

    def __init__(self):
        self.reduced, self.left = 0, 0
        self.ws = self

    def reduce(self):
        self.reduced += 1

    def leave(self):
        self.left += 1


@pytest.mark.parametrize("summed_by_producer", [True, False])
@pytest.mark.parametrize("reduce_op, scale", [("sum", 1.0), ("avg", 0.25)])
def test_the_owners_sum_runs_once(summed_by_producer, reduce_op, scale):
    """A producer that summed the own chunk in its epilogue (returns True) gets no reduction
    kernel after it; any other gets one; the call leaves the protocol either way, and also when
    the producer fails; the scale is 1/W for avg."""
    from overlap_pass.lowering import matmul_reduce_scatter as lowered

    call, out = _StubCall(), torch.empty(6)
    assert lowered.reduce_produced(call, lambda: summed_by_producer, reduce_op, out) is out
    assert (call.reduced, call.left) == (0 if summed_by_producer else 1, 1)
    assert call.out.shape == (2, 3) and call.scale == scale

    def fails():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        lowered.reduce_produced(call, fails, reduce_op, out)
    assert call.left == 2
