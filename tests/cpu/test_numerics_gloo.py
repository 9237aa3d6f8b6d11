"""Compiled with backend="overlap" on real gloo ranks, equal to eager in float32."""

import collections
import itertools

import pytest

from tests import plain_tp_cases
from tests.plain_tp_cases import AGM, MRS, SPLIT

from . import numerics_cases as cases

# at W=2 Inductor's full compile (its kernels, its lowering of overlap's ops), but where a
# case is marked graphs_only: the float8 tests but one, and repeats of a lowering another case
# compiles fully (bias or none, reduce op, shape) stop after the post-grad passes
# (tests/rank_pool.py)
pytestmark = pytest.mark.kernels

# W=8's numerics are the MLP's (test_tp_mlp): 8 ranks compiling the block on CI's two cores took
# 80 s; the block's decisions at W=8 are test_graphs_fake_pg.py's
@pytest.mark.parametrize(
    "world_size, bias", [pytest.param(2, False, marks=pytest.mark.graphs_only), (2, True), (4, False), (4, True)]
)
def test_tp_transformer_block(gloo_world, world_size, bias):
    decisions = gloo_world(world_size).run(cases.tp_block, bias)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    # forward: attention and MLP gather once and scatter once each; backward: both output-grad
    # gathers (input and weight grads of O and down), and the reduce-scatters of the summed
    # input grads of Q + K + V and gate + up
    assert decisions[0] == [(AGM, True, None)] * 4 + [(MRS, True, None)] * 4


def test_tp_transformer_block_under_autocast(gloo_world):
    """fp32 block, bf16 autocast: the forward's gathers carry bf16 (their casts moved onto the
    shards), the backward's reduce-scatters of bf16 input grads widened to fp32 write fp32, and
    every collective of both graphs is fused; numerics as eager's, to bf16."""
    decisions = gloo_world(2).run(cases.tp_block, False, 0, True)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert sorted(decisions[0]) == [(AGM, True, None)] * 4 + [(MRS, True, None)] * 4, decisions[0]


@pytest.mark.parametrize(
    "world_size, bias, batch",
    [pytest.param(2, False, 1, marks=pytest.mark.graphs_only), (2, True, 4), (4, True, 1), (4, False, 4)],
)
def test_plain_tp_block(gloo_world, world_size, bias, batch):
    """No sequence parallel: forward and backward equal eager at fp32 tolerance with every
    all-reduce split; the split's reduce-scatters fuse with the row-parallel matmuls and its
    gathers with the column-parallel ones; the gathers of saved activations ride in the FFN's
    as passengers, those of the graph outputs stay plain (plain_tp_cases.block_decisions).
    Chunks of the flattened tokens cross sequence boundaries (3 W tokens a sequence)."""
    decisions = gloo_world(world_size).run(cases.plain_tp_block, bias, batch)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert decisions[0] == plain_tp_cases.block_decisions()


@pytest.mark.parametrize("world_size, bias, batch", [(2, True, 1), (4, True, 3)])
def test_plain_tp_block_at_token_counts_not_divisible_by_the_world(gloo_world, world_size, bias, batch):
    """3 W + 1 tokens a sequence: the shards are padded with zero rows to ceil(T / W) each;
    forward and backward equal eager's (the bias and norm weight gradients, reductions over
    the tokens, read the real rows alone), decided as at a divisible count."""
    decisions = gloo_world(world_size).run(cases.plain_tp_block, bias, batch, 0, False, 1)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    # (the plain gathers' readers are slices taking the padding off rather than the outputs)
    assert [d[:2] for d in decisions[0]] == [d[:2] for d in plain_tp_cases.block_decisions()], decisions[0]


@pytest.mark.graphs_only  # (the SP block under autocast compiles fully)
def test_plain_tp_block_under_autocast(gloo_world):
    """bf16 matmuls and all-reduces, an fp32 residual stream and norms: split as in fp32, every
    reduce-scatter and the FFN's gather fused; numerics as eager's, to bf16."""
    decisions = gloo_world(2).run(cases.plain_tp_block, False, 2, 0, True)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    counts = {(kind, done): decisions[0].count((kind, done, None)) for kind in (SPLIT, AGM, MRS) for done in (True,)}
    assert counts == {(SPLIT, True): 7, (AGM, True): 2, (MRS, True): 4}, decisions[0]


@pytest.mark.parametrize("name", ["row_then_column", "mean_over_tokens", "rank_local_operand"])
def test_hand_written_plain_tp(gloo_world, name):
    """Split with a plain gather for h (returned), for a mean over the tokens, and for an add of
    a rank-local tensor (not cut to the shard); equal to eager."""
    decisions = gloo_world(2).run(cases.plain_tp_functional, name)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert (SPLIT, True, None) in decisions[0] and (MRS, True, None) in decisions[0]


@pytest.mark.parametrize("name", ["row_then_column", "sums_over_tokens"])
def test_hand_written_plain_tp_at_tokens_not_divisible_by_the_world(gloo_world, name):
    """4 W + 3 tokens at W=4: padded shards; the sums, maxima and minima over the tokens read
    the real rows alone (the padding rows hold the bias added after the all-reduce); equal to
    eager."""
    decisions = gloo_world(4).run(cases.plain_tp_functional, name, 0, 3)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert (SPLIT, True, None) in decisions[0] and (MRS, True, None) in decisions[0], decisions[0]


@pytest.mark.parametrize("world_size, bias", [(2, False), (2, True), (4, False), (4, True), (8, False)])
def test_tp_mlp(gloo_world, world_size, bias):
    (decisions, *_) = gloo_world(world_size).run(cases.tp_mlp, bias)
    assert decisions == [(AGM, True, None)] * 2 + [(MRS, True, None)] * 2


def _functional_mlp_cases():
    """Every shape, bias and reduce op; each shape compiles fully at one of its four (both
    biases and both reduce ops among those), the rest stop after the post-grad passes."""
    shapes = [((6, 8), 0, "2d"), ((2, 3, 8), 0, "3d-dim0"), ((2, 3, 8), 1, "3d-dim1"), ((3, 2, 5, 8), 2, "4d-dim2")]
    fully = [(False, "sum"), (True, "avg"), (True, "sum"), (False, "avg")]
    for (shape, gather_dim, name), full in zip(shapes, fully):
        for bias, reduce_op in itertools.product((False, True), ("sum", "avg")):
            marks = () if (bias, reduce_op) == full else pytest.mark.graphs_only
            yield pytest.param(shape, gather_dim, bias, reduce_op, id=f"{reduce_op}-{bias}-{name}", marks=marks)


@pytest.mark.parametrize("shape, gather_dim, bias, reduce_op", _functional_mlp_cases())
def test_functional_collectives_mlp(gloo_world, shape, gather_dim, bias, reduce_op):
    (decisions, *_) = gloo_world(2).run(cases.functional_mlp, shape, gather_dim, bias, reduce_op)
    assert decisions == [(AGM, True, None), (MRS, True, None)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape, gather_dim", [((4, 3, 8), 1), ((3, 2, 5, 8), 2)], ids=["3d-dim1", "4d-dim2"])
def test_reduce_scatter_of_a_moved_dim(gloo_world, world_size, shape, gather_dim):
    """spmd_types' reduce-scatter along a later dim (the dim moved to the front and back)."""
    (decisions, *_) = gloo_world(world_size).run(cases.functional_mlp, shape, gather_dim, False, "sum", 0, True)
    assert decisions == [(AGM, True, None), (MRS, True, None)]


def _functional_training_cases():
    """W=2 and 4, two shapes, with and without a bias, saved and recomputed; at W=2 two of
    them compile fully (each shape once, a bias and checkpointing each once), the rest stop
    after the post-grad passes."""
    fully = {(2, "2d", True, False), (2, "3d-dim1", False, True)}
    for world_size, (shape, gather_dim, name), bias, checkpointed in itertools.product(
        (2, 4), [((6, 8), 0, "2d"), ((2, 3, 8), 1, "3d-dim1")], (False, True), (False, True)
    ):
        marks = () if (world_size, name, bias, checkpointed) in fully else pytest.mark.graphs_only
        saved = "recomputed" if checkpointed else "saved"
        yield pytest.param(
            world_size, shape, gather_dim, bias, checkpointed, id=f"{saved}-{bias}-{name}-{world_size}", marks=marks
        )


@pytest.mark.parametrize("world_size, shape, gather_dim, bias, checkpointed", _functional_training_cases())
def test_functional_mlp_forward_and_backward(gloo_world, world_size, shape, gather_dim, bias, checkpointed):
    """The weight grads contract the gathered rows: of down, the gathered output grad; of up,
    the gathered input (recomputed under checkpointing: its all-gather then feeds nothing
    else). Along dim 1 of a batch of 2, each rank's chunk is strided in the rows."""
    (decisions, *_) = gloo_world(world_size).run(
        cases.functional_mlp_training, shape, gather_dim, bias, checkpointed
    )
    gathers = 3 if checkpointed else 2  # forward, the output grad's, the recomputed input's
    assert decisions == [(AGM, True, None)] * gathers + [(MRS, True, None)] * 2


@pytest.mark.graphs_only
def test_float8_plain_tp_block_at_a_token_count_not_divisible_by_the_world(gloo_world):
    """torchao's rowwise Float8 linears without sequence parallel, 13 tokens at W=2: the split
    (forced) runs on padded shards; the scaled matmuls are not made again on padded rows (not
    yet), so their collectives stay plain, and forward and backward match eager's."""
    pytest.importorskip("torchao")
    decisions = gloo_world(2).run(cases.float8_plain_tp_block, "rowwise", 13)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert (SPLIT, True, None) in decisions[0], decisions[0]


@pytest.mark.parametrize(
    "world_size, recipe, batch, fold",
    [
        pytest.param(2, "tensorwise", 1, True, marks=pytest.mark.graphs_only),
        (2, "rowwise", 2, True),
        (4, "tensorwise", 2, True),
        pytest.param(2, "rowwise", 2, False, marks=pytest.mark.graphs_only),
    ],
)
def test_float8_tp_block(gloo_world, world_size, recipe, batch, fold):
    """torchao's Float8 linears under sequence parallel: every all-gather's quantization runs on
    the shards and its float8 data (with rowwise scales) is gathered inside the fused scaled op,
    every reduce-scatter is fused with its scaled matmuls, rowwise's column-quantized copies ride
    in the gathers of their rows (passengers.py); outputs and grads as eager's. Without the
    fold (config.fold_rowwise_float8), rowwise's backward matmuls keep torchao's scale-after
    form: only the forward's gathers and reduce-scatters fuse."""
    pytest.importorskip("torchao")
    decisions = gloo_world(world_size).run(cases.float8_tp_block, recipe, batch, 0, fold)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    done = [d for d in decisions[0] if d[1]]
    # rowwise: the column copies of the two gathers each way (the forward's only, without the fold)
    riders = (4 if fold else 2) if recipe == "rowwise" else 0
    want = {"quantize_before_gather": 4 if fold else 2, AGM: 4 if fold else 2, MRS: 4 if fold else 2, "all_gather_passenger": riders}
    assert collections.Counter(kind for kind, _, _ in done) == {k: v for k, v in want.items() if v}, done


@pytest.mark.parametrize("world_size", [2])  # (W=4's decisions: test_graphs_fake_pg.py)
def test_tp_transformer_block_gathered_again_in_the_backward(gloo_world, world_size):
    """config.regather_in_backward: the forward's gathers no longer return the gathered rows;
    the backward gathers Q, K and V's input and gate and up's again, each fused with the
    weight gradients it feeds; numerics as eager's; the forward saves no gathered activation,
    at least (W - 1) / W of each less (the shard itself may be recomputed from what the norm
    saves: at these sizes nothing is saved for it)."""
    found = gloo_world(world_size).run(cases.tp_block_regathered, False)
    assert all(f == found[0] for f in found), "ranks differ"
    result = found[0]
    assert result["decisions"] == [(AGM, True, None)] * 6 + [(MRS, True, None)] * 4, result["decisions"]
    saved, gathered = result["saved"], result["gathered"]
    assert saved[False] - saved[True] >= 2 * gathered * (world_size - 1) // world_size, saved
