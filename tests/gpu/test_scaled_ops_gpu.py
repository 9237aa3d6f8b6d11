"""The float8 ops (lowering/scaled.py) on NCCL ranks (world 2, and 4 where there are 4 GPUs):
calls through the op that replay per-call CUDA graphs, rank 0 running its calls eagerly, each
output against the dequantized product (tests/scaled_cases.py). Skipped without two GPUs that
have float8 tensor cores.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest
import torch

from tests import scaled_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(
    GPUS < 2 or torch.cuda.get_device_capability() < (8, 9), reason="needs two GPUs with float8 tensor cores"
)


@pytest.mark.parametrize("body", [cases.all_gather_replayed, cases.reduce_scatter_replayed], ids=["all_gather", "reduce_scatter"])
def test_calls_replay_per_call_graphs(pool, body):
    # a graph per input set, variant and case on every rank but 0, which runs eagerly
    captured = pool.run(body, 8)
    assert captured[0] == 0 and all(c >= 2 * len(cases.CASES) for c in captured[1:]), captured
