"""Calls of both kinds in turn on NCCL ranks (world 2, and 4 where there are 4 GPUs): each call
after the first of its kind skips its barrier's wait (lowering/symm.EntryProofs), every rank
alike, and the outputs match the reference with ranks out of step.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest

from tests import alternating_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


def test_alternating_kinds_skip_their_barriers_and_stay_right(pool):
    steps = 120
    skipped = pool.run(cases.alternating_kinds, steps)
    assert skipped == [2 * steps - 2] * pool.world_size, skipped
