"""torchtitan 0.3.0's Llama 3 on 2 gloo ranks, as its users run it: its own TP plan with sequence
parallel, each TransformerBlock compiled by its apply_compile with backend="overlap", batch 1
and 4, under its default spmd_backend (spmd_types) and the DTensor one. Every all-gather and
reduce-scatter of the forward and backward graphs is rewritten; loss and gradients equal eager
(tests/torchtitan_cases.py)."""

import pytest

pytest.importorskip("torchtitan", reason="pip install -e .[torchtitan]")

from tests import torchtitan_cases as cases  # noqa: E402
from tests.rank_pool import RankPool  # noqa: E402

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


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
    for rank, result in enumerate(results):
        graphs = result["decisions"]
        forward = [g for g in graphs if "forward" in g]
        backward = [g for g in graphs if "backward" in g]
        assert forward and len(forward) == len(backward), f"rank {rank}: graphs {sorted(graphs)}"
        for name, candidates in graphs.items():
            # per block and pass: the gathers before wqkv and w1/w3, the scatters after wo and w2
            kinds = sorted(kind for kind, _, _ in candidates)
            assert kinds == [AGM, AGM, MRS, MRS], f"rank {rank} {name}: {candidates}"
            skipped = [c for c in candidates if not c[1]]
            assert not skipped, f"rank {rank} {name}: {skipped}"
    assert results[0]["loss"] == results[1]["loss"]
