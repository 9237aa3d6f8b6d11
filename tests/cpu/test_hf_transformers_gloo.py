"""Hugging Face transformers' Llama with its own tp_plan (plain TP: every row-parallel linear
ends in an all-reduce), compiled with backend="overlap" on 2 gloo ranks, forward and backward
against eager (tests/hf_cases.py)."""

import collections

import pytest

pytest.importorskip("transformers", reason="pip install -e .[test]")

from tests import hf_cases as cases  # noqa: E402

AGM, MRS, SPLIT = "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_split"


@pytest.mark.parametrize("batch, seq", [(1, 16), (2, 12)])
def test_llama_tp_plan_training_matches_eager_with_its_all_reduces_split(gloo_world, tmp_path, batch, seq):
    """Forward: the embedding's and both layers' O and down all-reduces are split, in one region
    along the residual stream; O and down fuse with their reduce-scatters (the embedding lookup
    is no matmul), Q/K/V, gate/up of both layers and lm_head with their gathers; 11 plain gathers
    return what leaves the graph: the residual stream's tensors saved for the backward, and
    lm_head's logits (its colwise_gather_output). Backward: all 11 all-reduced input grads (lm_head,
    and Q, K, V, gate, up of each layer) split; the sums Q+K+V and gate+up each reduce-scatter
    once, fused; the residual stream's grad is gathered before down and O of each layer, fused
    with their input and weight grads; the embedding's grad is gathered plainly."""
    decisions = gloo_world(2).run(cases.llama_forward_backward, str(tmp_path), batch, seq)
    assert decisions[0] == decisions[1], "ranks decided differently"
    count = collections.Counter((d["graph"], d["kind"], d["rewritten"]) for d in decisions[0])
    assert count == {
        ("forward", SPLIT, True): 5, ("forward", MRS, True): 4, ("forward", MRS, False): 1,
        ("forward", AGM, True): 5, ("forward", AGM, False): 11,
        ("backward", SPLIT, True): 11, ("backward", MRS, True): 5,
        ("backward", AGM, True): 4, ("backward", AGM, False): 1,
    }, count  # fmt: skip
    (embedding,) = [d for d in decisions[0] if (d["graph"], d["kind"], d["rewritten"]) == ("forward", MRS, False)]
    assert embedding["reason"].startswith("reduce-scatter input is not a matmul result"), embedding
