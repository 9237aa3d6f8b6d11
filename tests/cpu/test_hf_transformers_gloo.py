"""Hugging Face transformers' Llama and OLMo 2 with their own tp_plans (plain TP: every
row-parallel linear ends in an all-reduce), compiled with backend="overlap" on 2 gloo ranks,
forward and backward against eager (tests/hf_cases.py). Both ranks must build the same graphs:
a collective in another order on one rank aborts gloo and hangs NCCL."""

import collections

import pytest

pytest.importorskip("transformers", reason="pip install -e .[hf] (Python 3.11+)")

from tests import hf_cases as cases  # noqa: E402
from tests.dumps import assert_same_collectives  # noqa: E402

AGM, MRS, SPLIT, RIDER = "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_split", "all_gather_passenger"


@pytest.mark.parametrize("batch, seq", [(1, 16), (2, 12)])
def test_llama_tp_plan_training_matches_eager_with_its_all_reduces_split(gloo_world, tmp_path, batch, seq):
    """Forward: the embedding's and both layers' O and down all-reduces are split, in one region
    along the residual stream; O and down fuse with their reduce-scatters (the embedding lookup
    is no matmul), Q/K/V, gate/up of both layers and lm_head with their gathers; 11 plain gathers
    return what leaves the graph: the residual stream's tensors saved for the backward, which all
    ride in fused gathers as passengers, and lm_head's logits (its colwise_gather_output), which
    cannot (computed from lm_head's gather). Backward: all 11 all-reduced input grads (lm_head,
    and Q, K, V, gate, up of each layer) split; the sums Q+K+V and gate+up each reduce-scatter
    once, fused; the residual stream's grad is gathered before down and O of each layer, fused
    with their input and weight grads; the embedding's grad is gathered plainly."""
    results = gloo_world(2).run(cases.forward_backward, str(tmp_path), batch, seq)
    assert_same_on_every_rank(results)
    decisions = results[0]["decisions"]
    count = collections.Counter((d["graph"], d["kind"], d["rewritten"]) for d in decisions)
    assert count == {
        ("forward", SPLIT, True): 5, ("forward", MRS, True): 4, ("forward", MRS, False): 1,
        ("forward", AGM, True): 5, ("forward", AGM, False): 11,
        ("forward", RIDER, True): 10, ("forward", RIDER, False): 1,
        ("backward", SPLIT, True): 11, ("backward", MRS, True): 5,
        ("backward", AGM, True): 4, ("backward", AGM, False): 1, ("backward", RIDER, False): 1,
    }, count  # fmt: skip
    (embedding,) = [d for d in decisions if (d["graph"], d["kind"], d["rewritten"]) == ("forward", MRS, False)]
    assert embedding["reason"].startswith("reduce-scatter input is not a matmul result"), embedding


def assert_same_on_every_rank(results: list[dict]) -> None:
    """The ranks decided alike and built the same collectives in the same order."""
    assert results[0]["decisions"] == results[1]["decisions"], "ranks decided differently"
    assert_same_collectives([r["graphs"] for r in results])


def test_olmo2_tp_plan_gathers_qkv_outputs_alike_on_every_rank(gloo_world, tmp_path):
    """OLMo 2's plan gathers the Q, K and V projections' outputs for its QK norms
    (colwise_gather_output), after the split all-reduce's gather that feeds them: all three
    matmuls ride in one all_gather_matmul, their plain output gathers follow, in the same order
    on both ranks (they once followed a set's order, which differs between processes: gloo
    aborted on mismatched sizes). Forward: as Llama's splits and fusions, 17 plain gathers
    (Q, K, V of each layer too, which cannot ride: matmul outputs of their would-be host; the
    saved residual-stream tensors do); backward: each of the 11 all-reduced input grads split and
    reduce-scattered from its matmul. Loss, logits and grads equal eager."""
    results = gloo_world(2).run(cases.forward_backward, str(tmp_path), 2, 12, "olmo2")
    assert_same_on_every_rank(results)
    count = collections.Counter((d["graph"], d["kind"], d["rewritten"]) for d in results[0]["decisions"])
    assert count == {
        ("forward", SPLIT, True): 5, ("forward", MRS, True): 4, ("forward", MRS, False): 1,
        ("forward", AGM, True): 5, ("forward", AGM, False): 17,
        ("forward", RIDER, True): 10, ("forward", RIDER, False): 7,
        ("backward", SPLIT, True): 11, ("backward", MRS, True): 11,
        ("backward", AGM, True): 4, ("backward", AGM, False): 3, ("backward", RIDER, False): 3,
    }, count  # fmt: skip


@pytest.mark.parametrize("batch, lengths", [(2, [9, 12, 17, 9]), (1, [9, 12, 17, 9])], ids=["even-tokens", "odd-tokens"])
def test_llama_prefill_at_changing_lengths(gloo_world, tmp_path, batch, lengths):
    """Prompts of several lengths through one compiled model; the symbolic graph splits and
    fuses as the static one does, and every prefill runs as many fused ops; logits as eager's.
    Batch 2: every token count is even. Batch 1 at odd lengths: W does not divide the tokens,
    so the shards are padded with zero rows (the record says so)."""
    results = gloo_world(2).run(cases.prefill_at_lengths, str(tmp_path), batch, lengths)
    assert_same_on_every_rank(results)
    decisions, calls = results[0]["decisions"], results[0]["calls"]
    graphs = sorted({d["graph"] for d in decisions})
    assert len(graphs) == 2, graphs  # static at the first length, symbolic from the second on
    symbolic = [d for d in decisions if d["graph"] == graphs[1] and d["kind"] == SPLIT]
    assert symbolic and all(d["rewritten"] for d in symbolic), symbolic
    assert calls == [calls[0]] * len(lengths) and calls[0] > 0, calls
    padded = [d for d in symbolic if d["padded"]]
    assert len(padded) == (0 if batch == 2 else len(symbolic)), symbolic
