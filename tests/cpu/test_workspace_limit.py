"""config.workspace_limit_mib: a call whose symmetric workspace would exceed it is refused
before the workspace allocates anything or its ranks meet (a refusal dispatch answers with
NCCL + cuBLAS); under it, the workspace grows as before."""

import collections

import pytest
import torch

from overlap_pass import config
from overlap_pass.lowering import choose, symm


def _workspace() -> symm.Workspace:
    """A workspace with no allocation yet, as reserve sees it (no GPU here)."""
    ws = object.__new__(symm.Workspace)
    ws.kind, ws.group_name, ws.device = "all_gather_matmul", "g", torch.device("cpu")
    ws._alloc, ws._retired, ws._tables = None, [], {}
    ws._views = collections.OrderedDict()
    return ws


def test_a_workspace_over_the_limit_is_refused(monkeypatch):
    allocated = []
    monkeypatch.setattr(symm, "outside_graph_pool", lambda device, allocate, size: allocated.append(size))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws = _workspace()
    with config.patch(workspace_limit_mib=64):
        with pytest.raises(NotImplementedError, match=r"would take 128 MiB, over config.workspace_limit_mib \(64\)"):
            ws.reserve(70 << 20)  # rounds up to 128 MiB
        assert allocated == []
        ws.reserve(40 << 20)
    assert allocated == [64 << 20]
    with config.patch(workspace_limit_mib=0):  # no cap
        ws.reserve(70 << 20)
    assert allocated == [64 << 20, 128 << 20]
    assert issubclass(NotImplementedError, choose.refusals())  # dispatch runs NCCL + cuBLAS then
