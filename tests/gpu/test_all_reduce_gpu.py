"""overlap::all_reduce on NCCL ranks (world 2, and 4 where there are 4 GPUs): the one-shot
kernel against NCCL's all-reduce on every size, dtype and reduce op; back-to-back calls through
the op, which replay per-call graphs; a late peer named instead of hanging the GPU.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest

from tests import all_reduce_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


@pytest.mark.quick
def test_every_shape_matches_nccl(pool):
    checked = pool.run(cases.every_shape_matches)
    assert checked[0] == len(cases.NUMELS) * len(cases.DTYPES) * len(cases.OPS)


@pytest.mark.quick
def test_back_to_back_calls_replay(pool):
    # every call captured or replayed; eager: each reduce op's trial of the forced variant before
    # its first call (choose.runs_everywhere)
    for paths in pool.run(cases.back_to_back, 400):
        assert paths["replayed"] >= 390 and paths["captured"] + paths["replayed"] == 400, paths


def test_a_late_peer_is_named(pool):
    messages = pool.run(cases.late_peer_is_named)
    others = [r for r in range(pool.world_size) if r != 1]
    assert f"rank 1 gave up waiting at the barrier for ranks {others}" in messages[1], messages[1]
