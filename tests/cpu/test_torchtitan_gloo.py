"""torchtitan 0.3.0's Llama 3 on 2 gloo ranks, as its users run it: its own TP plan with sequence
parallel, each TransformerBlock compiled by its apply_compile with backend="overlap", batch 1
and 4, under its default spmd_backend (spmd_types) and the DTensor one. Every all-gather and
reduce-scatter of the forward and backward graphs is rewritten; loss and gradients equal eager
(tests/torchtitan_cases.py). Also its Qwen3 and DeepSeek-V3 (MLA, MoE) under spmd_types."""

import pytest

pytest.importorskip("torchtitan", reason="pip install -e .[torchtitan]")

from overlap_pass.regions import passengers  # noqa: E402
from tests import torchtitan_cases as cases  # noqa: E402
from tests.dumps import assert_same_collectives  # noqa: E402
from tests.rank_pool import RankPool  # noqa: E402

@pytest.fixture(scope="module")
def pool():
    """Ranks of their own: torchtitan's setup changes process-wide settings (its device type,
    spmd backend, Dynamo's capture_scalar_outputs, autograd's threads)."""
    pool = RankPool(cases.TP, "gloo")
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "spmd_backend, batch, backend",
    [
        ("spmd_types", 1, "overlap"),
        ("spmd_types", 4, "overlap"),
        ("partial_dtensor", 1, "overlap"),
        ("partial_dtensor", 4, "overlap"),
        ("spmd_types", 4, "inductor"),  # --compile.backend inductor under overlap_pass.launch
    ],
)
def test_llama3_every_collective_is_rewritten_and_training_matches_eager(pool, spmd_backend, batch, backend):
    results = pool.run(cases.forward_backward, spmd_backend, batch, backend)
    cases.assert_every_block_collective_rewritten(results)
    assert results[0]["loss"] == results[1]["loss"]



@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_other_models_every_matmul_collective_is_rewritten_and_training_matches_eager(pool, family):
    """torchtitan's Qwen3 (QK norm, cos/sin RoPE) and DeepSeek-V3 (MLA; a dense layer, then an
    MoE layer of routed bf16 experts and shared ones, expert parallel off) under their own TP/SP
    plans, batch 2. Every gather a matmul reads and every scatter of a matmul's result is
    rewritten. What is left is the MoE layer's, with its reason: in the forward the scatter of
    the combine (a scatter-add of the routed experts' outputs into their tokens), in the backward
    that of the dispatch's gradient (an index_put): neither is a matmul's result. Loss and grads
    equal eager."""
    results = pool.run(cases.forward_backward, "spmd_types", 2, "overlap", 0, True, False, cases.TOL, family)
    assert results[0]["loss"] == results[1]["loss"]
    assert_same_collectives([r["graphs"] for r in results])
    if family == "qwen3":
        cases.assert_every_block_collective_rewritten(results)
        return
    dense = [(AGM, True), (AGM, True), (MRS, True), (MRS, True)]
    combine = (MRS, False, "reduce-scatter input is not a matmul result: deterministic_scatter_add")
    dispatch = (MRS, False, "reduce-scatter input is not a matmul result: index_put")
    expected = sorted([
        ("forward", dense), ("forward", dense + [combine]),
        ("backward", dense), ("backward", [(AGM, True), (AGM, True), (MRS, True), dispatch]),
    ])  # fmt: skip
    for rank, result in enumerate(results):
        found = sorted(
            ("forward" if "forward" in name else "backward",
             sorted((kind, ok, *([reason.split(" (")[0]] if not ok else [])) for kind, ok, reason in candidates))
            for name, candidates in result["decisions"].items()
        )  # fmt: skip
        assert found == sorted((graph, sorted(c)) for graph, c in expected), (rank, result["decisions"])


AGM, MRS, SPLIT = cases.AGM, cases.MRS, "all_reduce_split"
PLAIN = "no matmul reads the gathered rows; users: output (output)"


def test_llama3_under_fsdp2_and_tp_on_a_2d_mesh():
    """FSDP2 x TP on 4 ranks (dp_shard 2 x tp 2: torchtitan's parallelize_llama whole, its
    DTensor backend): every TP collective of every block graph is rewritten, and one training
    step's loss and gradients equal eager's (FSDP's own collectives stay NCCL's; gloo sums
    them, then divides)."""
    pool, batch = RankPool(2 * cases.TP, "gloo"), 2
    try:
        # (positional: spmd backend, batch, backend, seed, sequence parallel, float8, tolerance, family, dp_shard)
        results = pool.run(cases.forward_backward, "partial_dtensor", batch, "overlap", 0, True, False, cases.TOL, "llama3", 2)
    finally:
        pool.close()
    cases.assert_every_block_collective_rewritten(results)
    assert len({r["loss"] for r in results}) == 1, [r["loss"] for r in results]


@pytest.mark.parametrize("spmd_backend", ["spmd_types", "partial_dtensor"])
def test_llama3_without_sequence_parallel_splits_its_all_reduces(pool, spmd_backend):
    """--parallelism.enable_sequence_parallel off: each block's forward all-reduces after wo and
    w2 split; wo and w2 fuse with their reduce-scatters and w1/w3 with the gather; the
    activations saved for the backward ride in that gather as passengers, the block output is
    gathered plainly. Under spmd_types the
    backward all-reduces the summed input grads of wqkv and of w1/w3: both split, the
    reduce-scatters fused, the grad of the residual gathered once for wo's grads. DTensor's
    backward has no all-reduce in the block graph (it leaves the input grads Partial). Loss and
    grads equal eager."""
    results = pool.run(cases.forward_backward, spmd_backend, 2, "overlap", 0, False)
    assert results[0]["loss"] == results[1]["loss"]
    assert_same_collectives([r["graphs"] for r in results])
    for rank, result in enumerate(results):
        for name, candidates in result["decisions"].items():
            riders = [ok for kind, ok, _ in candidates if kind == passengers.KIND]
            done = sorted((kind, ok) for kind, ok, reason in candidates if ok and kind != passengers.KIND)
            plain = [c for c in candidates if c[2] == PLAIN]
            if "forward" in name:
                assert done == [(AGM, True), (SPLIT, True), (SPLIT, True), (MRS, True), (MRS, True)], (rank, name, candidates)
                assert len(plain) == len(candidates) - 5 - len(riders), (rank, name, candidates)
                # the residual stream and the FFN norm's rsqrt (saved) ride; the block output
                # cannot (nothing gathers after it), nor DTensor's gathers of other rows
                assert riders.count(True) == 2 and False in riders, (rank, name, candidates)
            elif spmd_backend == "spmd_types":
                assert done == [(AGM, True), (SPLIT, True), (SPLIT, True), (MRS, True), (MRS, True)], (rank, name, candidates)
                assert plain == [(AGM, False, PLAIN)], (rank, name, candidates)
            else:
                assert SPLIT not in {kind for kind, _, _ in candidates}, (rank, name, candidates)


MAX = "reduce op 'max' (only sum)"
SCALE = "the gathered tensor is a scaled matmul's scale: it goes with its rows' all-gather"
PLAIN_SAVED = "no matmul reads the gathered rows"


@pytest.mark.parametrize("spmd_backend", ["spmd_types", "partial_dtensor"])
def test_llama3_float8_rowwise_fuses_every_scaled_matmul(pool, spmd_backend):
    """torchtitan's Float8LinearConverter (rowwise, its recipe; torchao's Float8Linear on CPU),
    sequence parallel, batch 2, both spmd backends: in the forward and the backward block graph, the
    quantizations of the gathered activations (gradients) run on the shards, both gathers feed
    all_gather_scaled_matmul (their row scales travel with them), both scatters come from
    scaled_matmul_reduce_scatter; the token-wise quantizations for the weight gradients, no
    matmul's rows, ride in those ops as passengers (passengers.py); DTensor's all-reduces of the
    weights' amax stay collectives, each an overlap::all_reduce (small_all_reduces.py). Loss and
    every gradient equal eager at fp32 tolerance."""
    pytest.importorskip("torchao", reason="pip install -e .[float8]")
    results = pool.run(cases.forward_backward, spmd_backend, 2, "overlap", 0, True, True)
    assert results[0]["loss"] == results[1]["loss"]
    assert_same_collectives([r["graphs"] for r in results])
    for rank, result in enumerate(results):
        graphs = result["decisions"]
        forward = [g for g in graphs if "forward" in g]
        assert forward and 2 * len(forward) == len(graphs), (rank, sorted(graphs))
        for name, candidates in graphs.items():
            done = sorted(kind for kind, ok, _ in candidates if ok)
            assert done == sorted(
                ["all_gather_matmul", "all_gather_passenger", "matmul_reduce_scatter", "quantize_before_gather"] * 2
            ), (rank, name, candidates)
            left = sorted(reason.split(";")[0] for kind, ok, reason in candidates if not ok and kind != SPLIT)
            assert left == [PLAIN_SAVED] * 2 + [SCALE] * 2, (rank, name, candidates)
            # DTensor all-reduces the amax of each sharded weight (and gradient): kept
            splits = {reason for kind, _, reason in candidates if kind == SPLIT}
            assert splits <= {MAX}, (rank, name, candidates)
            ops = result["ops"][name]
            assert ops == ["all_gather_scaled_matmul"] * 2 + ["scaled_matmul_reduce_scatter"] * 2, (rank, name, ops)
            assert result["all_reduces"][name][1] == 0, (rank, name, result["all_reduces"])
        assert sum(ours for ours, _ in result["all_reduces"].values()) > 0, (rank, result["all_reduces"])
