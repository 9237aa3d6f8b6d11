"""new_counts.PlainFirstCalls with stand-in graphs: which one each call runs, by token count.
(The graphs themselves, compiled on gloo: test_dynamic_shapes_gloo.)"""

import pytest
import torch

from overlap_pass import config

from overlap_pass.shapes import new_counts
from overlap_pass.lowering import dispatch, replay

WAIT = 3  # config.fused_from_call - 1


class Graphs:
    """A plain and an overlap stand-in; the overlap one's op calls take the path told
    (replay.stats: eager, captured or replayed), as a forward's would."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.path = "replayed"

    def plain(self, x):
        self.ran.append("plain")
        return x

    def overlap(self, x):
        self.ran.append("overlap")
        replay.stats[self.path] += 2
        return x


@pytest.fixture
def graphs():
    found = Graphs()
    with config.patch(fused_from_call=WAIT + 1, implementation="auto"):
        yield found, new_counts.PlainFirstCalls(found.overlap, found.plain, [(0, 0)])


def _call(wrapper, tokens: int, times: int = 1) -> None:
    for _ in range(times):
        wrapper(torch.empty(tokens, 2))


def test_a_count_runs_plain_first_then_overlap(graphs):
    found, wrapper = graphs
    _call(wrapper, 4, WAIT)
    _call(wrapper, 6, 2)
    _call(wrapper, 4, 2)  # 4's calls are over: overlap's, while 6 still waits
    _call(wrapper, 6, 2)
    assert found.ran == ["plain"] * (WAIT + 2) + ["overlap"] * 2 + ["plain", "overlap"]
    assert wrapper.plain_calls == WAIT + 3


@pytest.mark.parametrize("path", ["eager", "captured"])
def test_a_count_whose_ops_keep_missing_their_graphs_goes_back_to_plain(graphs, path):
    found, wrapper = graphs
    found.path = path
    before = new_counts.stats["counts back on plain"]
    settled = WAIT + new_counts.SETTLING_CALLS
    _call(wrapper, 8, settled + new_counts.UNREPLAYED_STREAK + 2)
    overlap_calls = new_counts.SETTLING_CALLS + new_counts.UNREPLAYED_STREAK
    assert found.ran == ["plain"] * WAIT + ["overlap"] * overlap_calls + ["plain"] * 2
    assert new_counts.stats["counts back on plain"] == before + 1


def test_a_replaying_count_stays_on_overlap(graphs):
    found, wrapper = graphs
    found.path = "eager"
    _call(wrapper, 8, WAIT + new_counts.SETTLING_CALLS + new_counts.UNREPLAYED_STREAK - 1)
    found.path = "replayed"  # a call that replays breaks the streak
    _call(wrapper, 8, 1)
    found.path = "captured"
    _call(wrapper, 8, new_counts.UNREPLAYED_STREAK - 1)
    assert found.ran[WAIT:] == ["overlap"] * (found.ran.count("overlap"))


def test_a_count_that_replays_rarely_goes_back_to_plain(graphs):
    """Misses broken by a replay every third call: no streak, but too few replays."""
    found, wrapper = graphs
    settled = WAIT + new_counts.SETTLING_CALLS
    _call(wrapper, 8, settled)
    for i in range(new_counts.JUDGED_CALLS):
        found.path = "replayed" if i % 3 == 2 else "eager"
        _call(wrapper, 8)
    _call(wrapper, 8)
    assert found.ran[settled:] == ["overlap"] * new_counts.JUDGED_CALLS + ["plain"]


@pytest.mark.parametrize("patch", [{"fused_from_call": 1}, {"implementation": "nccl_cublas"}])
def test_no_waiting_runs_overlap_from_the_first_call(graphs, patch):
    found, wrapper = graphs
    with config.patch(**patch):
        _call(wrapper, 4, 2)
    assert found.ran == ["overlap"] * 2


def test_a_plain_graph_that_fails_to_compile_leaves_overlaps(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "first_calls_on_nccl", True)  # (restored after)

    def failing():
        raise RuntimeError("no lowering")

    overlap = object()
    with caplog.at_level("WARNING", logger="overlap_pass"):
        assert new_counts.with_plain_first_calls(overlap, failing, []) is overlap
    assert "failed to compile" in caplog.text and dispatch.first_calls_on_nccl
    with config.patch(strict=True), pytest.raises(RuntimeError, match="no lowering"):
        new_counts.with_plain_first_calls(overlap, failing, [])
    wrapper = new_counts.with_plain_first_calls(overlap, lambda: "plain", [(None, (0, 0))])
    assert isinstance(wrapper, new_counts.PlainFirstCalls) and not dispatch.first_calls_on_nccl
