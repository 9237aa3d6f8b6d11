"""Shapes that change between calls, on real gloo ranks: after torch.compile's automatic
dynamic recompile (and with ``mark_dynamic``), every call, at old and new token counts, runs the
fused ops, forward and backward, and matches eager."""

import collections

import pytest

from tests.plain_tp_cases import AGM, MRS

from . import dynamic_cases as cases

# at W=2 Inductor's full compile: symbolic sizes through its lowering of overlap's ops
pytestmark = pytest.mark.kernels

LENGTHS = [4, 6, 10, 4]  # tokens a rank: a new length, two more, then the first again


def _every_call_fused(counts: list[int], per_call: int) -> None:
    assert counts == [per_call] * len(LENGTHS), f"overlap op calls at {LENGTHS} tokens a rank: {counts}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("gather_dim", [0, 1])
@pytest.mark.parametrize("mark", [False, True], ids=["automatic", "mark_dynamic"])
def test_functional_collectives_at_changing_lengths(gloo_world, world_size, gather_dim, mark):
    results = gloo_world(world_size).run(cases.functional_at_lengths, LENGTHS, gather_dim, mark)
    decisions, (counts, graphs) = results[0]
    assert all(r == results[0] for r in results[1:]), "ranks decided or ran differently"
    # every graph compiled (static first, then symbolic, forward and backward) fused all four
    assert decisions and all(done for _, done, _ in decisions), decisions
    # and no count met after the symbolic graph compiled another graph: nothing guards on the count
    assert graphs == (1 if mark else 2), graphs
    # forward: gather -> up, down -> scatter; backward: the output grad's gather (input and
    # weight grads of down), up's input grad -> scatter
    _every_call_fused(counts, 4)


def test_new_counts_run_plain_inductor_first(gloo_world):
    """A symbolic graph's token counts run plain Inductor's graph (no overlap op) at their first
    fused_from_call - 1 calls and overlap's from then on, forward and backward, each call equal
    to eager's; with fused_from_call = 1, every call overlap's."""
    lengths = [4, 4, 4, 6, 4, 6, 6, 10]
    results = gloo_world(2).run(cases.functional_at_lengths, lengths, 0, True, 3)
    decisions, (counts, graphs) = results[0]
    assert all(r == results[0] for r in results[1:]), "ranks decided or ran differently"
    assert decisions and all(done for _, done, _ in decisions), decisions
    assert counts == [0, 0, 4, 0, 4, 0, 4, 0], f"overlap op calls at {lengths} tokens a rank: {counts}"
    assert graphs == 1, graphs
    _, (counts, _) = gloo_world(2).run(cases.functional_at_lengths, lengths[:4], 0, True, 1)[0]
    assert counts == [4] * 4, counts


@pytest.mark.parametrize("block", [False, True], ids=["mlp", "block"])
def test_dtensor_sequence_parallel_at_changing_lengths(gloo_world, block):
    results = gloo_world(2).run(cases.dtensor_at_lengths, LENGTHS, block)
    decisions, counts = results[0]
    assert all(done for _, done, _ in decisions), decisions
    _every_call_fused(counts, 8 if block else 4)


def test_tail_matmuls_at_changing_lengths(gloo_world):
    """With the weight gradients in the reduce-scatters' tails, the symbolic backward takes them
    as the static one does, and every call still fuses and matches eager."""
    for result in gloo_world(2).run(cases.block_tails_at_lengths, LENGTHS):
        assert result["taken"] == 10, result  # Q, K, V's and gate's and up's, in each backward
        _every_call_fused(result["calls"], 8)


FLOAT8_LENGTHS = [16, 24, 40, 16]  # multiples of 16, as _scaled_mm takes them


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.graphs_only)])
def test_float8_block_at_changing_lengths(gloo_world, recipe):
    """torchao's Float8 block: the symbolic graphs (forward and backward) fuse what the static
    ones do (test_numerics_gloo.test_float8_tp_block: the quantization moved onto the shards,
    the float8 gathers and reduce-scatters fused, rowwise's column copies riding), and every
    call runs the same number of fused ops."""
    pytest.importorskip("torchao")
    results = gloo_world(2).run(cases.float8_at_lengths, FLOAT8_LENGTHS, recipe)
    decisions, counts = results[0]
    done = collections.Counter(kind for kind, rewritten, _ in decisions if rewritten)
    per_graph_pair = {"quantize_before_gather": 4, AGM: 4, MRS: 4}
    if recipe == "rowwise":
        per_graph_pair["all_gather_passenger"] = 4
    # two compiles of the forward and the backward: static at 16 tokens, symbolic from 24 on
    assert done == {kind: 2 * n for kind, n in per_graph_pair.items()}, [d for d in decisions if not d[1]]
    assert counts == [counts[0]] * len(FLOAT8_LENGTHS) and counts[0] >= 8, counts


def test_plain_tp_prefill_at_changing_lengths(gloo_world):
    """Plain TP (Hugging Face's tp_plan's form), 2 sequences a batch at W=2: the token count
    2 * s is divisible by W for every length s, so the symbolic graph splits its all-reduces
    and fuses as the static one does, and every call runs as many fused ops."""
    results = gloo_world(2).run(cases.plain_tp_at_lengths, [6, 8, 11, 6], 2)
    decisions, counts = results[0]
    done = collections.Counter(kind for kind, rewritten, _ in decisions if rewritten)
    assert done and all(n % 2 == 0 for n in done.values()), done  # static and symbolic alike
    assert counts == [counts[0]] * 4 and counts[0] > 0, counts


def test_plain_tp_at_changing_batch_and_length(gloo_world):
    """Batch and length both change (both symbolic): the token count s0 * s1 is spelled in the
    graph as the product of the two dims, and the padded split fuses at every call."""
    results = gloo_world(2).run(cases.plain_tp_at_lengths, [6, 7, 9, 6], [1, 2, 3, 1])
    decisions, counts = results[0]
    assert any(kind == "all_reduce_split" and rewritten for kind, rewritten, _ in decisions), decisions
    assert not any("split failed" in (reason or "") for _, _, reason in decisions), decisions
    assert counts == [counts[0]] * 4 and counts[0] > 0, counts


def test_plain_tp_splits_from_the_count_where_it_pays(gloo_world):
    """A split that pays from 100 tokens on (config.split_min_bytes), in a graph traced at 80
    (the automatic dynamic recompile at the second call): backend="overlap" compiles it once
    more for counts from 100 on, and each call runs the graph of its count's range: the same op
    calls at 120 and 160 tokens as a split graph's, at 80 and 64 as an unsplit one's."""
    results = gloo_world(2).run(cases.plain_tp_at_lengths, [64, 80, 120, 160, 80, 64], 1, "overlap", 100)
    decisions, counts = results[0]
    splits = [(rewritten, reason) for kind, rewritten, reason in decisions if kind == "all_reduce_split"]
    # the static graph at 64 tokens, the symbolic one judged at 80, the same for 100 or more
    assert sum(rewritten for rewritten, _ in splits) == 2, splits
    assert sum("splits from 100 tokens" in (reason or "") for _, reason in splits) == 2, splits
    assert counts[2] == counts[3] and counts[1] == counts[4] and counts[2] > counts[1], counts


def test_plain_tp_training_splits_from_the_count_where_it_pays(gloo_world):
    """Training across the split line (100 tokens, the symbolic graphs traced at 80): the
    forward and the backward graph of counts from 100 on each split their all-reduce and fuse
    its matmul, those below keep it whole, and every step matches eager (output, input and
    weight gradients)."""
    results = gloo_world(2).run(cases.plain_tp_training_at_lengths, [64, 80, 120, 160, 80, 64], 100)
    decisions, counts = results[0]
    splits = [(rewritten, reason) for kind, rewritten, reason in decisions if kind == "all_reduce_split"]
    # static at 64 and symbolic at 80 (forward, backward) whole; the range from 100 split in both
    assert sum(rewritten for rewritten, _ in splits) == 2, splits
    assert sum("splits from 100 tokens" in (reason or "") for _, reason in splits) == 2, splits
    assert counts == [0, 0, 2, 2, 0, 0], counts


def test_strict_mode_takes_the_graph_of_a_range_where_the_split_waits(gloo_world):
    """Strict mode raises where a graph rewrites none of its collectives; the graph of the
    counts below the split line (traced at 80, the line at 100) is not such a graph, as the
    graph of the counts from 100 on splits its all-reduces (small all-reduces kept NCCL's, so
    that the splits are all there is)."""
    patches = {"strict": True, "small_all_reduce_bytes": 0}
    results = gloo_world(2).run(cases.plain_tp_at_lengths, [120, 80, 160, 64], 1, "overlap", 100, patches)
    decisions, counts = results[0]
    whole_here = [r for kind, rewritten, r in decisions if kind == "all_reduce_split" and not rewritten]
    assert whole_here and all("fewer than 100 tokens" in r or "splits from 100" in r for r in whole_here), decisions
    assert counts[0] == counts[2] > counts[1] == counts[3] == 0, counts


def test_plain_tp_uneven_token_counts_are_padded(gloo_world):
    """One sequence of lengths W does not divide (7, 9): the symbolic graph gives each rank
    ceil(T / W) rows, zero rows past the real tokens, and fuses as the static one does; every
    call runs as many fused ops and computes what eager does."""
    results = gloo_world(2).run(cases.plain_tp_at_lengths, [6, 7, 9, 6], 1)
    decisions, counts = results[0]
    done = collections.Counter(kind for kind, rewritten, _ in decisions if rewritten)
    assert done and all(n % 2 == 0 for n in done.values()), (done, decisions)  # static and symbolic alike
    assert counts == [counts[0]] * 4 and counts[0] > 0, counts
