"""The pass's stage table (overlap_pass/pipeline/stages.py): an edit that leaves a graph that
does not lint is undone, and nothing it returned is kept (no record, no count)."""

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph

from overlap_pass.pipeline import stages
from overlap_pass.regions import small_all_reduces


def _graph() -> Graph:
    graph = Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    return graph


def test_an_edit_undone_keeps_nothing(monkeypatch):
    def rewrite_that_breaks_the_graph(graph):
        # a node that reads one defined after it: the graph no longer lints
        relu = graph.output_node().args[0]
        with graph.inserting_before(relu):
            neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
        return [{"kind": "small_all_reduce", "collective": {"name": "all_reduce"}, "rewritten": True, "op": neg.name}]

    monkeypatch.setattr(small_all_reduces, "rewrite_all", rewrite_that_breaks_the_graph)
    stage = next(s for s in stages.STAGES if s.what == "rewriting small all-reduces")
    graph, state = _graph(), stages.State(tensor_parallel=set())
    counters.clear()
    stages._run_stage(graph, stage, state)
    graph.lint()
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.ops.aten.relu.default]
    assert state.small == [] and counters["overlap_pass"]["small_all_reduces_rewritten"] == 0


def test_an_edit_that_lints_is_kept(monkeypatch):
    def rewrite_one(graph):
        return [{"kind": "small_all_reduce", "collective": {"name": "all_reduce"}, "rewritten": True, "op": "x"}]

    monkeypatch.setattr(small_all_reduces, "rewrite_all", rewrite_one)
    stage = next(s for s in stages.STAGES if s.what == "rewriting small all-reduces")
    state = stages.State(tensor_parallel=set())
    counters.clear()
    stages._run_stage(_graph(), stage, state)
    assert len(state.small) == 1 and counters["overlap_pass"]["small_all_reduces_rewritten"] == 1
