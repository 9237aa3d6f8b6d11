import os

# Triton kernels run in the interpreter on CPU (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.rank_pool import RankPool

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
