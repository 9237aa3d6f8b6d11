"""The overlap ops on NCCL ranks, one per GPU (skipped without two GPUs).

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest
import torch

from tests import op_cases
from tests.rank_pool import RankPool

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


@pytest.fixture(scope="module", params=sorted({2, min(GPUS, 4)}) if GPUS >= 2 else [2])
def nccl_pool(request):
    pool = RankPool(request.param, "nccl")
    yield pool
    pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_against_nccl(nccl_pool, dtype):
    results = nccl_pool.run(op_cases.back_to_back_calls, 20, 0, "cuda", dtype)
    assert results == [20] * nccl_pool.world_size


def test_reduce_scatter_is_deterministic(nccl_pool):
    assert all(nccl_pool.run(op_cases.deterministic_reduce_scatter, 0, "cuda"))


def test_a_choice_measured_over_calls(nccl_pool):
    """config.measure_over_calls: each key's choice is made over its calls (its trial's steps
    on NCCL ranks, symmetric memory and the per-call graphs), every call's result right."""
    for result in nccl_pool.run(op_cases.measured_over_calls, 90):
        assert result["trials_left"] == 0, result
        assert len(result["choices"]) == 2, result
        for choice in result["choices"].values():
            assert choice["source"] == "measured" and choice["choice"] in choice["times_us"], choice
