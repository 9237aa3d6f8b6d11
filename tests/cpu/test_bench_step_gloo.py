"""benchmarks/bench_step.py's training steps on 4 gloo ranks, at toy sizes: torchtitan's Llama 3
under FSDP2 2 x TP 2 (every TP collective of its blocks rewritten) and Hugging Face's Llama with
its tp_plan (its all-reduces split and fused); overlap's losses over two steps (the second after
an AdamW step) equal eager's. What the GPU benchmark times is what these ranks compute."""

import pytest

from tests import bench_step_cases as cases
from tests.rank_pool import RankPool

pytest.importorskip("transformers", reason="pip install -e .[hf]")


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4, "gloo")
    yield pool
    pool.close()


def _assert_trains_like_eager(results) -> None:
    for rank, result in enumerate(results):
        eager, ours = result["losses"]["eager"], result["losses"]["overlap"]
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(ours, eager)), (rank, result)


def test_torchtitan_step_under_fsdp2_and_tp(pool):
    results = pool.run(cases.losses, "titan", 2)
    _assert_trains_like_eager(results)
    for result in results:
        counters = result["counters"]
        assert counters.get("all_gather_matmul_rewritten") and counters.get("matmul_reduce_scatter_rewritten"), counters
        assert not any(k.endswith("_skipped") for k in counters), counters


def test_hugging_face_step_with_its_tp_plan(pool):
    results = pool.run(cases.losses, "hf")
    _assert_trains_like_eager(results)
    for result in results:
        counters = result["counters"]
        assert counters.get("all_reduce_split_rewritten") and counters.get("matmul_reduce_scatter_rewritten"), counters
