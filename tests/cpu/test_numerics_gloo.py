"""Compiled with backend="overlap" on real gloo ranks, equal to eager in float32."""

import pytest

from . import numerics_cases as cases

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _count(decisions: list[tuple], kind: str, rewritten: bool = True) -> int:
    return sum(1 for k, done, _ in decisions if k == kind and done == rewritten)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_tp_transformer_block(gloo_world, world_size, bias):
    decisions = gloo_world(world_size).run(cases.tp_block, bias)
    assert all(d == decisions[0] for d in decisions), "ranks decided differently"
    # forward: attention and MLP gather once and scatter once each; backward: both output-grad
    # gathers; the input grads of Q/K/V and gate/up are sums of matmuls (skipped, with reason)
    assert _count(decisions[0], AGM) == 4
    assert _count(decisions[0], MRS) == 2
    assert _count(decisions[0], MRS, rewritten=False) == 2


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_tp_mlp(gloo_world, world_size, bias):
    (decisions, *_) = gloo_world(world_size).run(cases.tp_mlp, bias)
    assert decisions == [(AGM, True, None)] * 2 + [(MRS, True, None)] * 2


@pytest.mark.parametrize(
    "shape, gather_dim",
    [((6, 8), 0), ((2, 3, 8), 0), ((2, 3, 8), 1), ((3, 2, 5, 8), 2)],
    ids=["2d", "3d-dim0", "3d-dim1", "4d-dim2"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_functional_collectives_mlp(gloo_world, shape, gather_dim, bias, reduce_op):
    (decisions, *_) = gloo_world(2).run(cases.functional_mlp, shape, gather_dim, bias, reduce_op)
    assert decisions == [(AGM, True, None), (MRS, True, None)]
