"""Calls of both kinds in turn on one group of NCCL ranks (world 2, and 4 where there are 4
GPUs), variants changing from call to call, one rank late at each step: every output matches
the reference.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest

from tests import alternating_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


def test_alternating_kinds_with_ranks_out_of_step(pool):
    checked = pool.run(cases.alternating_kinds, 120)
    assert checked[0] > 240 and all(c == checked[0] for c in checked), checked
