"""Bad and odd input on real gloo ranks: each case compiles and computes eager's answer, and
every collective is rewritten or skipped with a reason."""

import pytest

from . import numerics_cases as cases

pytestmark = pytest.mark.kernels  # at W=2 Inductor's full compile (tests/rank_pool.py)

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_sequence(gloo_world, world_size):
    (decisions, *_) = gloo_world(world_size).run(cases.uneven_sequence)
    if isinstance(decisions, dict):
        pytest.skip(decisions["skip"])
    assert decisions, "DTensor's uneven gather and scatter should be candidates"
    for kind, rewritten, reason in decisions:
        assert rewritten or reason, (kind, reason)


def test_non_contiguous_inputs(gloo_world):
    (decisions, *_) = gloo_world(2).run(cases.non_contiguous_inputs)
    assert decisions == [(AGM, True, None)] * 2 + [(MRS, True, None)] * 2


def test_no_collectives(gloo_world):
    assert gloo_world(2).run(cases.no_collectives) == [[], []]


def test_single_rank_group(gloo_world):
    (decisions, *_) = gloo_world(2).run(cases.single_rank_group)
    assert [k for k, _, _ in decisions] == [AGM, MRS]
    for _, rewritten, reason in decisions:
        assert not rewritten and "group of size 1" in reason


def test_tp_inside_dp(gloo_world):
    (decisions, *_) = gloo_world(4).run(cases.tp_inside_dp)
    assert decisions == [(AGM, True, None)] * 2 + [(MRS, True, None)] * 2
