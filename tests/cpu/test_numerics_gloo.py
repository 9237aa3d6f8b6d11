"""Compiled with backend="overlap" on real gloo ranks, equal to eager in float32."""

import pytest

from . import numerics_cases as cases


def _rewritten(counts: dict, kind: str) -> int:
    return counts.get(f"{kind}_rewritten", 0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_tp_transformer_block(gloo_world, world_size, bias):
    counts = gloo_world(world_size).run(cases.tp_block, bias)
    assert counts[0] == counts[-1]
    # forward: attention and MLP each gather once and scatter once; backward mirrors that
    assert _rewritten(counts[0], "all_gather_matmul") >= 4
    assert _rewritten(counts[0], "matmul_reduce_scatter") >= 2


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_tp_mlp(gloo_world, world_size, bias):
    counts = gloo_world(world_size).run(cases.tp_mlp, bias)
    assert _rewritten(counts[0], "all_gather_matmul") == 2  # forward input, backward grad
    assert _rewritten(counts[0], "matmul_reduce_scatter") == 2


@pytest.mark.parametrize(
    "shape, gather_dim",
    [((6, 8), 0), ((2, 3, 8), 0), ((2, 3, 8), 1), ((3, 2, 5, 8), 2)],
    ids=["2d", "3d-dim0", "3d-dim1", "4d-dim2"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_functional_collectives_mlp(gloo_world, shape, gather_dim, bias, reduce_op):
    counts = gloo_world(2).run(cases.functional_mlp, shape, gather_dim, bias, reduce_op)
    assert counts[0] == {"all_gather_matmul_rewritten": 1, "matmul_reduce_scatter_rewritten": 1}
