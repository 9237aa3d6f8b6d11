"""Compile on the fake process group and read back what the pass decided.

The fake group runs no communication, so these tests check graphs and decisions, never numbers
(the gloo tests do that).
"""

import contextlib
import glob
import json
import os

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from overlap_pass import config
from tests.graphs_only import graphs_only


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0, kernels: bool = False):
    """A fake process group of ``world_size`` for this rank; its compiles stop after the
    post-grad passes (tests/graphs_only.py: the fake group computes nothing worth Inductor's
    kernels) unless ``kernels``."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with contextlib.nullcontext() if kernels else graphs_only():
            yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


class Dump:
    """The dumps of one compile: graph texts and decision records by graph kind."""

    def __init__(self, folder: str) -> None:
        self.graphs = {}
        for path in sorted(glob.glob(os.path.join(folder, "rank*", "*", "decisions.json"))):
            graph_dir = os.path.dirname(path)
            with open(path) as f:
                record = json.load(f)
            kind = next(k for k in ("forward", "backward", "inference") if k in record["graph"])
            with open(os.path.join(graph_dir, "after.txt")) as f:
                after = f.read()
            with open(os.path.join(graph_dir, "before.txt")) as f:
                before = f.read()
            self.graphs[kind] = {"record": record, "after": after, "before": before}

    def candidates(self, kind: str) -> list[dict]:
        return self.graphs[kind]["record"]["candidates"] if kind in self.graphs else []

    def all_candidates(self) -> list[dict]:
        return [c for kind in self.graphs for c in self.candidates(kind)]

    def after(self, kind: str) -> str:
        return self.graphs[kind]["after"]


def compile_and_dump(fn, args, tmp_path, backward: bool = False, **patches) -> tuple:
    """Runs ``fn`` compiled with backend="overlap" (and its backward when asked); returns the
    output and the Dump."""
    folder = str(tmp_path / f"dump{len(os.listdir(tmp_path))}")
    torch._dynamo.reset()
    with config.patch(debug_dir=folder, **patches):
        out = torch.compile(fn, backend="overlap", fullgraph=True)(*args)
        if backward:
            outs = out if isinstance(out, tuple) else (out,)
            sum(o.sum() for o in outs).backward()
    return out, Dump(folder)


def rewritten(candidates: list[dict], kind: str) -> list[dict]:
    return [c for c in candidates if c["kind"] == kind and c["rewritten"]]

