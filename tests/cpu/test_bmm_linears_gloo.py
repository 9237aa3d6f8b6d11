"""Tensor-parallel linears written as bmm (NeMo Automodel's compiled form) and as einsum,
compiled with backend="overlap" on real gloo ranks (tests/bmm_linear_cases.py): every
collective rewritten, outputs and gradients equal to eager at fp32 tolerance."""

import pytest

from tests import bmm_linear_cases as cases

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _form(form: str) -> str:
    if form == "nemo" and not cases.nemo_installed():
        pytest.skip("NeMo Automodel is not installed (pip install --no-deps nemo-automodel)")
    return form


@pytest.mark.parametrize(
    "form, world_size, batch, bias",
    [("bmm", 2, 1, False), ("einsum", 4, 3, True), ("nemo", 2, 2, True)],
)
def test_sequence_parallel_block(gloo_world, form, world_size, batch, bias):
    """DTensor sequence parallel ([B, S, D] sharded on seq, gathered before Q/K/V and gate/up,
    reduce-scattered after O and down), forward and backward, two steps: each graph's two
    gathers and two reduce-scatters fused."""
    decisions = gloo_world(world_size).run(cases.training_block, _form(form), batch, bias)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    assert decisions[0] == [(AGM, True, None)] * 4 + [(MRS, True, None)] * 4


@pytest.mark.parametrize(
    "form, world_size, batch, checkpointed",
    [("einsum", 2, 1, False), ("bmm", 2, 2, True)],
)
def test_hand_written_sp_mlp(gloo_world, form, world_size, batch, checkpointed):
    """Functional collectives: output, input and weight grads as eager's; the recomputed
    gather (checkpointing) fused with the recomputed up."""
    decisions = gloo_world(world_size).run(cases.training_sp_mlp, form, batch, checkpointed)
    gathers = 3 if checkpointed else 2
    assert decisions[0] == [(AGM, True, None)] * gathers + [(MRS, True, None)] * 2


@pytest.mark.parametrize("form, world_size", [("bmm", 2)])
def test_gathered_rows_contracted_per_batch_and_summed(gloo_world, form, world_size):
    """bmm(g^T, y).sum(0), bmm(z, g).sum(0) and a linear of g: one op, as eager."""
    decisions = gloo_world(world_size).run(cases.contractions_match, form)
    assert decisions[0] == [(AGM, True, None)]
