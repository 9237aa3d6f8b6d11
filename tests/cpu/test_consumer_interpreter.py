"""The all-gather consumer GEMM under TRITON_INTERPRET=1 with simulated peers: chunks already
in place, flags preset (or held back). Tile order, flag waits, masking, bias, several mat2s,
gather dims."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from overlap_pass.ops import schedule  # noqa: E402
from overlap_pass.templates import all_gather_matmul as agm  # noqa: E402
from overlap_pass.templates import gemm  # noqa: E402
from tests.consumer_cases import EPOCH, fp8_problem, problem, run_consumer, run_fp8_consumer  # noqa: E402


def _assert_all_close(outs, refs, tol):
    for out, ref in zip(outs, refs):
        assert not torch.isnan(out).any(), "some output rows were never written"
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "world, shard_shape, gather_dim",
    [(2, (13, 24), 0), (3, (2, 5, 20), 1), (4, (3, 2, 3, 17), 2), (3, (2, 5, 20), 0)],
)
def test_matches_torch(dtype, bias, world, shard_shape, gather_dim):
    gathered, mat2s, biases, refs, inner = problem(world, shard_shape, 19, dtype, bias, gather_dim)
    flags = torch.full((world,), EPOCH + 1, dtype=torch.int32)  # epochs only grow: >= passes
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, world - 1, inner, flags, num_programs=3)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "ns, bias",
    [((19, 7, 33), (True, False, True)), ((16, 16, 16, 16, 5), False), ((40, 8), (False, True))],
    ids=["qkv-mixed-bias", "five-mats", "two-mats"],
)
def test_several_mat2s_share_one_gather(ns, bias):
    world = 3
    gathered, mat2s, biases, refs, inner = problem(world, (2, 5, 20), ns, torch.float32, bias, 1)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, 1, inner, flags, num_programs=2)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-5)


@pytest.mark.parametrize("world, rank", [(2, 0), (4, 1), (4, 3), (8, 5)])
def test_tiles_go_chunk_by_chunk_in_schedule_order(world, rank):
    gathered, mat2s, biases, _, inner = problem(world, (20, 16), 40, torch.float32, False, 0)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    tiles_per_chunk = 2 * 3  # ceil(20 / 16) x ceil(40 / 16)
    log = torch.zeros(world * tiles_per_chunk + 1, dtype=torch.int32)
    run_consumer(gathered, mat2s, biases, world, rank, inner, flags, num_programs=1, tile_log=log)
    started = log[:-1].argsort()  # tile ids in the order they started
    chunk_of_tile = [(rank + int(t) // tiles_per_chunk) % world for t in started]
    expected = [c for c in schedule.all_gather_order(rank, world) for _ in range(tiles_per_chunk)]
    assert chunk_of_tile == expected


def test_a_late_chunk_is_reported_not_waited_for_forever():
    world, rank, late = 4, 1, 3
    gathered, mat2s, biases, refs, inner = problem(world, (8, 16), 16, torch.float32, True, 0)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    flags[late] = EPOCH - 1  # the previous call's value: not arrived yet
    (out,), timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, spin_limit=3)
    assert timeouts.tolist() == [0, 0, 0, EPOCH]  # the call's epoch: given up in this call
    with pytest.raises(agm.ChunkTimeout, match="rank 1 gave up waiting for the flags of chunks \\[3\\]"):
        agm.raise_on_timeouts(timeouts, rank)
    rows = gathered.shape[0] // world
    for c in [c for c in range(world) if c != late]:
        torch.testing.assert_close(out[c * rows : (c + 1) * rows], refs[0][c * rows : (c + 1) * rows])


def test_own_chunk_needs_no_flag():
    world, rank = 3, 2
    gathered, mat2s, biases, refs, inner = problem(world, (6, 8), 8, torch.float32, False, 0)
    flags = torch.tensor([EPOCH, EPOCH, 0], dtype=torch.int32)  # its own flag never set
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, spin_limit=1)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-5)


def test_bad_shapes_are_rejected():
    a, mat2 = torch.randn(10, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        agm.all_gather_matmul_consumer(
            a, [mat2], [None], [torch.empty(10, 4)], torch.zeros(3, dtype=torch.int32),
            rank=0, world_size=3, inner=1, epoch=1,
        )


@pytest.mark.parametrize("shard_shape, gather_dim", [((6, 8), 0), ((3, 4, 8), 1)], ids=["one-block", "batch-3"])
def test_own_chunk_is_read_in_place_from_a_local(shard_shape, gather_dim):
    world, rank = 3, 1
    gathered, mat2s, biases, refs, inner = problem(world, shard_shape, 8, torch.float32, True, gather_dim)
    own = agm.own_rows(gathered, rank, world, inner).clone()
    outer = gathered.shape[0] // (world * inner)
    gathered.view(outer, world, inner, -1)[:, rank] = float("nan")  # the own rows are never read
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, a_local=own)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-5)


@pytest.mark.parametrize(
    "world, shard_shape, gather_dim, ns", [(2, (13, 24), 0, 19), (3, (2, 5, 24), 1, (16, 8)), (4, (9, 40), 0, 24)]
)
def test_tma_loads_match_torch(world, shard_shape, gather_dim, ns):
    """TMA descriptors: rows past a chunk's end and N past the block are dropped by the store."""
    gathered, mat2s, biases, refs, inner = problem(world, shard_shape, ns, torch.float16, True, gather_dim)
    assert all(gemm.tma_fits(gathered, m) for m in mat2s)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, 1, inner, flags, config=config, num_programs=3)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-2)


@pytest.mark.parametrize(
    "ns, bias, row_major",
    [
        ((40, 8, 8), (True, False, True), ()),  # Q, K, V in one launch, mixed biases
        ((24, 16, 8), False, (1,)),  # one [K, N] matrix: a launch of its own beside Q and V's
        ((8, 16, 24, 8, 16, 8), (False, True) * 3, ()),  # more than MAX_B: two launches
        ((8, 56), True, (0, 1)),  # both [K, N]
    ],
    ids=["qkv-one-launch", "mixed-layouts", "six-mats", "row-major"],
)
def test_tma_several_mat2s_in_one_launch(ns, bias, row_major):
    """Several B matrices in one TMA launch: each tile picks its B, bias, output and N."""
    world, rank = 3, 2
    gathered, mat2s, biases, refs, inner = problem(world, (2, 9, 16), ns, torch.float16, bias, 1)
    mat2s = [m.contiguous() if i in row_major else m for i, m in enumerate(mat2s)]
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, config=config, num_programs=4)
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-2)


def test_tma_several_mat2s_report_a_late_chunk():
    world, rank, late = 3, 0, 2
    gathered, mat2s, biases, refs, inner = problem(world, (16, 16), (16, 32), torch.float16, False, 0)
    flags = torch.full((world,), EPOCH, dtype=torch.int32)
    flags[late] = EPOCH - 1
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    outs, timeouts = run_consumer(gathered, mat2s, biases, world, rank, inner, flags, config=config, spin_limit=3)
    assert timeouts.tolist() == [0, 0, EPOCH]
    for out, ref in zip(outs, refs):  # every chunk but the late one is right
        torch.testing.assert_close(out[:32], ref[:32], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "world, rank, shard_shape, gather_dim, ns, bias",
    [
        (2, 0, (32, 24), 0, (24,), True),  # N past the last tile's end
        (3, 2, (2, 16, 32), 1, (40, 8, 16), (True, False, True)),  # Q, K, V, batch 2
        (4, 1, (16, 16), 0, (56, 8), False),
    ],
)
def test_tma_outputs_in_column_slices_of_wider_buffers(world, rank, shard_shape, gather_dim, ns, bias):
    """Outputs that are column slices of wider buffers (row stride past N): every output element
    written, nothing beside them."""
    gathered, mat2s, biases, refs, inner = problem(world, shard_shape, ns, torch.float16, bias, gather_dim)
    buffers = [torch.full((gathered.shape[0], m.shape[1] + 24), float("nan"), dtype=torch.float16) for m in mat2s]
    outs = [buf[:, 8 : 8 + m.shape[1]] for buf, m in zip(buffers, mat2s)]
    timeouts = torch.zeros(world, dtype=torch.int32)
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, torch.full((world,), EPOCH, dtype=torch.int32),
        torch.tensor([EPOCH], dtype=torch.int32), rank=rank, world_size=world, inner=inner,
        config=dataclasses.replace(gemm.TEST_CONFIG, tma=True), timeouts=timeouts, num_programs=3,
    )  # fmt: skip
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-2)
    for buf, m in zip(buffers, mat2s):
        assert torch.isnan(buf[:, :8]).all() and torch.isnan(buf[:, 8 + m.shape[1] :]).all()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rank, shard_shape, gather_dim, ns, bias",
    [
        (2, 1, (24, 32), 0, (48,), True),
        (3, 2, (2, 5, 32), 1, (48, 16), False),
        (2, 0, (2, 16, 32), 1, (40, 24), True),  # whole M tiles per chunk
    ],
)
def test_float8_tiles_are_dequantized_before_the_bias(rowwise, world, rank, shard_shape, gather_dim, ns, bias):
    """Float8 through TMA: each tile's fp32 accumulator times A's scale (one, or its rows', the
    own chunk's from its own scales) and B's (one, or its columns'), then the bias."""
    config = dataclasses.replace(gemm.TEST_CONFIG, tma=True)
    outs, timeouts, refs = run_fp8_consumer(
        world, rank, shard_shape, gather_dim, ns, rowwise, bias, 5, config, num_programs=3
    )
    assert not timeouts.any()
    for out, ref in zip(outs, refs):
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_float8_weights_with_rowwise_and_tensorwise_scales_in_one_call():
    """One weight scaled per column, the next by one value, in one launch: each tile takes its
    own weight's kind of scale (B_ROWWISE_MASK)."""
    world, rank = 2, 1
    gathered, a_scale, mat2s, b_scales, biases, refs, inner = fp8_problem(world, (16, 32), (24, 40), 0, True, False, 3)
    b_scales[1] = torch.tensor(0.75)
    refs[1] = (gathered.float() * a_scale[:, None]) @ (mat2s[1].float() * 0.75)
    outs = [torch.full((gathered.shape[0], m.shape[1]), float("nan"), dtype=torch.bfloat16) for m in mat2s]
    timeouts = torch.zeros(world, dtype=torch.int32)
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, torch.full((world,), EPOCH, dtype=torch.int32),
        torch.tensor([EPOCH], dtype=torch.int32), rank=rank, world_size=world, inner=inner,
        config=dataclasses.replace(gemm.TEST_CONFIG, tma=True), timeouts=timeouts,
        scales=agm.Scales(a_scale, a_scale[inner:].contiguous(), tuple(b_scales)),
    )  # fmt: skip
    assert not timeouts.any()
    for out, ref in zip(outs, refs):
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_barrier_names_the_ranks_that_never_came():
    """The barrier kernel on simulated pads: ranks 0 and 1 arrive first and give up on the ranks
    not there yet; rank 2 arrives last and finds everyone. Pads hold each rank's epoch."""
    from overlap_pass.templates.signals import barrier_kernel

    world = 3
    pads = [torch.full((world,), 41, dtype=torch.int32) for _ in range(world)]  # last call: 41
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    epochs = [torch.tensor([41], dtype=torch.int32) for _ in range(world)]
    timeouts = []
    for rank in range(world):
        timeouts.append(torch.zeros(world, dtype=torch.int32))
        barrier_kernel[(1,)](pad_ptrs, epochs[rank], timeouts[rank], rank, world, SPIN_LIMIT=3, BLOCK_W=4)
    assert [e.item() for e in epochs] == [42, 42, 42]
    assert all(p.tolist() == [42, 42, 42] for p in pads)
    assert [t.tolist() for t in timeouts] == [[0, 42, 42], [0, 0, 42], [0, 0, 0]]


def test_waits_are_wrap_safe():
    """An epoch that passed 2**31 is negative in int32; a flag one call behind still waits and
    a flag at the epoch passes."""
    world, rank = 2, 0
    gathered, mat2s, biases, refs, inner = problem(world, (8, 16), 16, torch.float32, False, 0)
    outs = [torch.full_like(refs[0], float("nan"))]
    epoch = torch.tensor([-(2**31) + 1], dtype=torch.int32)  # 2**31 + 1 calls in
    behind = torch.tensor([0, 2**31 - 1], dtype=torch.int32)  # the previous call's value
    timeouts = torch.zeros(world, dtype=torch.int32)
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, behind, epoch, rank=rank, world_size=world, inner=inner,
        config=gemm.TEST_CONFIG, timeouts=timeouts, spin_limit=2,
    )
    assert timeouts.tolist() == [0, epoch.item()]
    timeouts.zero_()
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, outs, torch.tensor([0, epoch.item()], dtype=torch.int32), epoch,
        rank=rank, world_size=world, inner=inner, config=gemm.TEST_CONFIG, timeouts=timeouts, spin_limit=2,
    )
    assert not timeouts.any()
    _assert_all_close(outs, refs, 1e-5)
