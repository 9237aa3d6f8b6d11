"""torchtitan 0.3.0's Llama 3 on 2 gloo ranks, as its users run it: its own TP plan with sequence
parallel, each TransformerBlock compiled by its apply_compile with backend="overlap", batch 1
and 4, under its default spmd_backend (spmd_types) and the DTensor one. Every all-gather and
reduce-scatter of the forward and backward graphs is rewritten; loss and gradients equal eager
(tests/torchtitan_cases.py)."""

import pytest

pytest.importorskip("torchtitan", reason="pip install -e .[torchtitan]")

from tests import torchtitan_cases as cases  # noqa: E402
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
    results = pool.run(cases.llama3_forward_backward, spmd_backend, batch, backend)
    cases.assert_every_block_collective_rewritten(results)
    assert results[0]["loss"] == results[1]["loss"]
