import os

# Triton kernels run in the interpreter on CPU (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests import rank_pool
from tests.rank_pool import RankPool


def pytest_configure(config):
    kernels = "kernels: gloo ranks at W=2 compile fully (Inductor's kernels, its lowering of overlap's ops)"
    config.addinivalue_line("markers", kernels)
    config.addinivalue_line("markers", "graphs_only: not so, where the module is marked kernels (tests/graphs_only.py)")


@pytest.fixture(autouse=True)
def _full_compile_where_marked(request):
    """rank_pool.FULL_COMPILE_AT_W2 for this test: its closest mark of the two above."""
    marks = [m.name for m in request.node.iter_markers() if m.name in ("kernels", "graphs_only")]
    rank_pool.FULL_COMPILE_AT_W2 = bool(marks) and marks[0] == "kernels"
    yield
    rank_pool.FULL_COMPILE_AT_W2 = True

_worlds: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def gloo_world():
    """gloo_world(W): a pool of W gloo ranks, started once per session."""

    def get(world_size: int) -> RankPool:
        if world_size not in _worlds:
            _worlds[world_size] = RankPool(world_size, "gloo")
        return _worlds[world_size]

    yield get
    for world in _worlds.values():
        world.close()
