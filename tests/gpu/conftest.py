import faulthandler
import os

import pytest
import torch

from tests.rank_pool import RankPool

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# tests/cpu runs Triton in its interpreter (TRITON_INTERPRET=1, read when a kernel is defined),
# so the GPU tests need a pytest process of their own: python3 -m pytest tests/gpu


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip = pytest.mark.skip(reason="TRITON_INTERPRET=1 here: run tests/gpu in its own process")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)

# Bounded waits in tests: a lost peer fails a test in a few seconds instead of holding the
# GPU for the default ten minutes, while a peer still compiling a kernel (seconds, on an empty
# Triton cache) is waited for (set before the rank processes start; they read it at import).
os.environ.setdefault("OVERLAP_PASS_SPIN_LIMIT", "10000000")
# The variants from a call signature's first call (the default runs NCCL + cuBLAS at a
# signature's first calls, config.fused_from_call): what these tests check is the variants.
os.environ.setdefault("OVERLAP_PASS_FUSED_FROM_CALL", "1")


@pytest.fixture(scope="module", params=sorted({2, min(GPUS, 4)}) if GPUS >= 2 else [2], ids=lambda w: f"W{w}")
def pool(request):
    """NCCL ranks, one per GPU: world 2, and 4 where there are 4 GPUs (per test module)."""
    pool = RankPool(request.param, "nccl")
    yield pool
    pool.close()


@pytest.fixture
def watchdog(request):
    """Dumps every thread's stack and ends the run if the test runs past its module's WATCHDOG_S
    (compilation included): a hang is named instead of holding the GPU."""
    faulthandler.dump_traceback_later(request.module.WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
