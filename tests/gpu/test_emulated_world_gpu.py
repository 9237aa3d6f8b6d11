"""The emulated world on one GPU (tests/emulated_check.py, a process per world size): overlap's
variants and ops, NCCL + cuBLAS and async TP compute the emulated world's values, rank 0's
outputs match the simulated-ranks world's, and a communication-bound call takes the link's
time. The quick tier runs W=4. Skipped without a GPU."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.quick), 2, 8])
def test_emulated_world(world):
    run = subprocess.run(
        [sys.executable, "-m", "tests.emulated_check", str(world)], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "every check passed" in run.stdout
