import pytest

from overlap_pass import decide


@pytest.mark.parametrize(
    "local_world_size, ranks, spans",
    [("", [0, 1, 2, 3], False), ("4", [0, 1, 2, 3], False), ("4", [2, 3, 4, 5], True), ("8", [0, 8], True)],
)
def test_groups_that_span_hosts(monkeypatch, local_world_size, ranks, spans):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert decide._spans_hosts(ranks) == spans
