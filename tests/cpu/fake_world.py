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


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0, kernels: bool = False):
    """A fake process group of ``world_size`` for this rank. Inductor compiles only as far as
    its post-grad passes (overlap's among them) and runs the graph as they leave it, unless
    ``kernels``: the graphs and decisions are the same, and generating and building the C++
    kernels of every graph was most of these tests' time on CI's two cores (the fake group
    computes nothing worth checking; the gloo tests run the kernels)."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with contextlib.nullcontext() if kernels else _graphs_only():
            yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


@contextlib.contextmanager
def _graphs_only():
    """Every compile_fx (backend="overlap" and "inductor" call it) takes _post_grad_graph as
    its inner compile."""
    import torch._inductor.compile_fx as compile_fx_module

    compile_fx = compile_fx_module.compile_fx

    def graphs_only(*args, **kwargs):
        kwargs.setdefault("inner_compile", _post_grad_graph)
        return compile_fx(*args, **kwargs)

    compile_fx_module.compile_fx = graphs_only
    try:
        yield
    finally:
        compile_fx_module.compile_fx = compile_fx


def _post_grad_graph(gm, example_inputs, **kwargs):
    """Inductor's inner compile as far as its post-grad passes, the way it reaches them (views
    as reshapes, fake tensors propagated), then the graph itself as the compiled function."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm.forward)


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

