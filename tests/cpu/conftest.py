import pytest

from .gloo_world import GlooWorld

_worlds: dict[int, GlooWorld] = {}


@pytest.fixture(scope="session")
def gloo_world():
    """gloo_world(W): a pool of W gloo ranks, started once per session."""

    def get(world_size: int) -> GlooWorld:
        if world_size not in _worlds:
            _worlds[world_size] = GlooWorld(world_size)
        return _worlds[world_size]

    yield get
    for world in _worlds.values():
        world.close()
