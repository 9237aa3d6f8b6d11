"""lowering/replay.py on CPU, with the CUDA graph stubbed: which calls run eagerly, which are
captured, and which replay, as the addresses, the workspace and the config change."""

import pytest
import torch

from overlap_pass import config
from overlap_pass.lowering import replay


class _Graph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


class _Workspace:
    device = torch.device("cpu")

    def __init__(self, log):
        self.log, self.generation = log, 1

    def replay(self, graph):
        graph.replay()


@pytest.fixture
def calls(monkeypatch):
    """(call(tensors), log): log gets "eager", "capture", "replay" per step; the capture runs
    nothing, as a real one queues nothing."""
    log = []
    monkeypatch.setattr(replay, "_SIGNATURES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def capture(run, args, outputs, device):
        log.append("capture")
        return _Graph(log)

    monkeypatch.setattr(replay, "_capture", capture)
    monkeypatch.setattr(replay.choose, "replays_graphs", lambda device: False)
    workspace = _Workspace(log)

    def run(*args, outputs):
        log.append("eager")
        outputs.fill_(args[0])

    def call(tensors, value=1.0, signature=("sig",)):
        out = tensors[-1]
        replay.call(signature, run, (value,), out, tensors, workspace)
        return out

    return call, log, workspace


def test_second_sighting_is_captured_then_replayed(calls, monkeypatch):
    call, log, _ = calls
    monkeypatch.setattr(replay, "stats", replay.collections.Counter())
    a, out = torch.randn(4), torch.empty(4)
    for _ in range(4):
        call((a, None, out))
    assert log == ["eager", "capture", "replay", "replay", "replay"]
    assert replay.stats == {"eager": 1, "captured": 1, "replayed": 2}


def test_other_addresses_or_workspace_run_eagerly_first(calls):
    call, log, workspace = calls
    a, out, other_out = torch.randn(4), torch.empty(4), torch.empty(4)
    call((a, out))
    call((a, other_out))  # an output elsewhere: a first sighting
    assert log == ["eager", "eager"]
    call((a, out))
    assert log[-2:] == ["capture", "replay"]
    workspace.generation += 1  # the workspace grew: its old graphs hold the old addresses
    log.clear()
    call((a, out))
    call((a, out))
    assert log == ["eager", "capture", "replay"]


def test_signatures_and_spin_limits_keep_graphs_apart(calls):
    call, log, _ = calls
    a, out = torch.randn(4), torch.empty(4)
    call((a, out))
    call((a, out), signature=("other",))
    with config.patch(spin_limit=config.spin_limit + 1):
        call((a, out))
    assert log == ["eager", "eager", "eager"]


def test_a_failed_capture_runs_eagerly_for_good(calls, monkeypatch):
    call, log, _ = calls
    monkeypatch.setattr(replay, "_capture", lambda *a: log.append("capture failed"))
    a, out = torch.randn(4), torch.empty(4)
    for _ in range(4):
        assert torch.equal(call((a, out), value=2.0), torch.full((4,), 2.0))
    assert log == ["eager", "capture failed", "eager", "eager", "eager"]


def test_off_in_config_and_inside_a_capture(calls, monkeypatch):
    call, log, _ = calls
    a, out = torch.randn(4), torch.empty(4)
    with config.patch(op_graphs=False):
        for _ in range(3):
            call((a, out))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for _ in range(3):
        call((a, out))
    assert log == ["eager"] * 6


def test_graphs_per_signature_are_bounded(calls, monkeypatch):
    call, log, _ = calls
    monkeypatch.setattr(replay, "MAX_GRAPHS", 2)
    outs = [torch.empty(4) for _ in range(3)]
    a = torch.randn(4)
    for out in outs:
        call((a, out))
        call((a, out))
    assert log == ["eager", "capture", "replay", "eager", "capture", "replay", "eager", "eager"]


def test_no_capture_while_graph_trees_warm_up(calls, monkeypatch):
    call, log, _ = calls
    a, out = torch.randn(4), torch.empty(4)
    monkeypatch.setattr(replay.choose, "replays_graphs", lambda device: True)
    for _ in range(3):
        call((a, out))
    monkeypatch.setattr(replay.choose, "replays_graphs", lambda device: False)
    call((a, out))
    assert log == ["eager"] * 3 + ["capture", "replay"]


@pytest.mark.parametrize("kind", ["all_gather_matmul", "matmul_reduce_scatter", "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"])
def test_each_variant_of_a_call_has_graphs_of_its_own(kind):
    # the first call's choice runs every variant on the same tensors: one variant's graph
    # replayed for another would time (and run) the wrong one; the float8 ops' calls replay too
    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import dispatch, scaled
    from overlap_pass.lowering import matmul_reduce_scatter as mrs

    variants = {agm.KIND: agm.variants(3), mrs.KIND: mrs.variants(2)}.get(kind) or scaled.variants(kind)
    calls = dispatch.variant_calls(kind, ("fast key",), variants)
    graphed = {name: call for name, call in calls.items() if isinstance(call, dispatch._GraphedCall)}
    assert set(graphed) == set(calls) - {"nccl_cublas"}
    assert len({call.signature for call in graphed.values()}) == len(graphed)
    assert all((call.kind, call.run) == (kind, variants[name]) for name, call in graphed.items())


def test_forgotten_signatures_start_over(calls):
    call, log, _ = calls
    a, out = torch.randn(4), torch.empty(4)
    call((a, out))
    call((a, out))
    replay.forget([("sig",), ("never seen",)])
    call((a, out))
    assert log == ["eager", "capture", "replay", "eager"]


def test_outputs_are_allocated_apart_from_the_call():
    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import matmul_reduce_scatter as mrs

    shard, w = torch.randn(1, 6, 8), torch.randn(8, 5)
    gathered, outs = agm.allocate(shard, [w, w[:, :3]], [None, None], 1, 4, "g", True, [torch.randn(24, 7)], [True])
    assert gathered.shape == (1, 24, 8)
    assert [o.shape for o in outs] == [(1, 24, 5), (1, 24, 3), (8, 7)]
    assert agm.allocate(shard, [w], [None], 1, 4, "g")[0] is None
    # the reduce-scatter's output is written in place, contiguous, at any batch: a batch of 2
    # scattered along seq too (each chunk two runs of rows)
    a = torch.randn(1, 16, 8)
    assert mrs.allocate([a], [w], None, "sum", 1, 4, "g").shape == (1, 4, 5)
    batched = mrs.allocate([torch.randn(2, 16, 8)], [w], None, "sum", 1, 4, "g")
    assert batched.shape == (2, 4, 5) and batched.is_contiguous()
    assert mrs.allocate([torch.randn(16, 8)], [w], None, "sum", 0, 4, "g").shape == (4, 5)


def test_outputs_made_anew_as_laid_out(monkeypatch):
    """From a call signature's second call on, its outputs are made as the first call's were
    (the same structure, sizes, strides and dtypes) through Inductor's allocator, on the
    outputs' device only."""
    made = []

    def empty_strided(size, stride, dtype):
        made.append((size, stride, dtype))
        return torch.empty_strided(size, stride, dtype=dtype)

    monkeypatch.setattr(replay.torch_compat, "empty_strided_cuda", lambda: empty_strided)
    monkeypatch.setattr(replay.torch_compat, "current_device_index", lambda: lambda: 1)
    template = (None, [torch.empty(3, 4).t(), torch.empty(2, dtype=torch.bfloat16)])
    again = replay.output_maker(template, torch.device("cuda", 1))()
    assert isinstance(again, tuple) and again[0] is None and isinstance(again[1], list)
    laid_out = [((4, 3), (1, 4), torch.float32), ((2,), (1,), torch.bfloat16)]
    assert [(t.shape, t.stride(), t.dtype) for t in again[1]] == laid_out
    assert made == laid_out
    # another current device: the caller allocates; so it does for tensors off CUDA
    assert replay.output_maker(template, torch.device("cuda", 0))() is None
    assert replay.output_maker(template, torch.device("cpu"))() is None
    assert len(made) == 2


def test_calls_that_never_repeat_their_addresses_are_logged_once(calls, monkeypatch, caplog):
    call, log, _ = calls
    monkeypatch.setattr(replay, "EAGER_CALLS_NOTED", 3)
    a = torch.randn(4)
    outs = [torch.empty(4) for _ in range(5)]  # kept alive: every call at a new address
    with caplog.at_level("INFO", logger="overlap_pass"):
        for out in outs:
            call((a, out))
    assert log == ["eager"] * 5
    assert caplog.text.count("found their tensors at new addresses each time") == 1


def test_a_call_signature_fixes_its_outputs_layout(monkeypatch):
    """A resolved call makes its outputs as its signature's first call did (_GraphedCall), so
    the fast key holds everything the outputs depend on: an all-gather that returns its
    gathered tensor (a training forward, saving it) and one that does not (inference, the same
    shapes) are two signatures."""
    from overlap_pass.lowering import dispatch

    keys = []
    monkeypatch.setattr(dispatch, "_first_call", lambda kind, fast_key, *rest: keys.append(fast_key))
    shard, w = torch.randn(4, 8), torch.randn(8, 5)
    for return_gathered in (True, False):
        dispatch.all_gather_matmul(shard, [w], [None], 0, 2, "g", return_gathered)
    assert len(set(keys)) == 2
