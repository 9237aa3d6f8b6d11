"""new_counts.PlainFirstCalls with stand-in graphs: which one each call runs, by token count.
(The graphs themselves, compiled on gloo: test_dynamic_shapes_gloo.)"""

import pytest
import torch

from overlap_pass import config, new_counts
from overlap_pass.lowering import replay

WAIT = 3  # config.fused_from_call - 1


class Graphs:
    """A plain and an overlap stand-in; the overlap one's op calls run eagerly or replay as
    told (replay.stats), as a forward's would."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.eager = False

    def plain(self, x):
        self.ran.append("plain")
        return x

    def overlap(self, x):
        self.ran.append("overlap")
        replay.stats["eager" if self.eager else "replayed"] += 2
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


def test_a_count_whose_ops_keep_running_eagerly_goes_back_to_plain(graphs):
    found, wrapper = graphs
    found.eager = True
    before = new_counts.stats["counts back on plain"]
    settled = WAIT + new_counts.SETTLING_CALLS
    _call(wrapper, 8, settled + new_counts.EAGER_STREAK + 2)
    overlap_calls = new_counts.SETTLING_CALLS + new_counts.EAGER_STREAK
    assert found.ran == ["plain"] * WAIT + ["overlap"] * overlap_calls + ["plain"] * 2
    assert new_counts.stats["counts back on plain"] == before + 1


def test_a_replaying_count_stays_on_overlap(graphs):
    found, wrapper = graphs
    found.eager = True
    _call(wrapper, 8, WAIT + new_counts.SETTLING_CALLS + new_counts.EAGER_STREAK - 1)
    found.eager = False  # a replay breaks the streak
    _call(wrapper, 8, 1)
    found.eager = True
    _call(wrapper, 8, new_counts.EAGER_STREAK - 1)
    assert found.ran[WAIT:] == ["overlap"] * (found.ran.count("overlap"))


@pytest.mark.parametrize("patch", [{"fused_from_call": 1}, {"implementation": "nccl_cublas"}])
def test_no_waiting_runs_overlap_from_the_first_call(graphs, patch):
    found, wrapper = graphs
    with config.patch(**patch):
        _call(wrapper, 4, 2)
    assert found.ran == ["overlap"] * 2
