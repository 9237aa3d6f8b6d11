"""benchmarks/titan_llama3.py's Llama 3 mirror against torchtitan 0.3.0's own blocks on 2 gloo ranks,
batch 1 and 4: with the same weights and the same sharded hidden state, the output, the input's
gradient and every weight's gradient agree at fp32 tolerance, under torchtitan's default TP plan
(partial_dtensor) and its dist_gemm modules (spmd_types, symm_mem ops on CPU reference kernels).
And the mirror compiled with backend="overlap" has every all-gather and reduce-scatter of its
forward and backward graphs rewritten, with eager's gradients (tests/titan_mirror_cases.py)."""

import pytest

pytest.importorskip("torchtitan", reason="pip install -e .[torchtitan]")

from tests import titan_mirror_cases as cases  # noqa: E402
from tests import torchtitan_cases  # noqa: E402
from tests.rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    """Ranks of their own: torchtitan's setup changes process-wide settings, and the dist_gemm
    case registers CPU kernels for the symm_mem ops."""
    pool = RankPool(2, "gloo")
    yield pool
    pool.close()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gemm_backend", ["default", "dist_gemm"])
def test_mirror_computes_what_torchtitan_computes(pool, gemm_backend, batch):
    results = pool.run(cases.mirror_matches_torchtitan, gemm_backend, batch)
    assert all(r["n_grads"] == 2 * 7 for r in results)  # 2 blocks x (2 norms, wqkv, wo, w1, w2, w3)


@pytest.mark.parametrize("batch", [1, 4])
def test_overlap_rewrites_every_collective_of_the_mirror(pool, batch):
    torchtitan_cases.assert_every_block_collective_rewritten(pool.run(cases.overlap_rewrites_mirror, batch))
