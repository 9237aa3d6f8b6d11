"""The weight gradients of a reduce-scatter op's linears run in its tail
(regions/tail_matmuls.py), on real gloo ranks. On a traced graph: the contraction of the op's
input (a view of it) with a tensor computed before it is taken, by the input's index (its readers
now read the op's output); one whose other operand is computed from the op's result, and a
matmul of other tensors, are not; the graph computes what it did before. Through torch.compile,
the sequence-parallel block's backward runs the weight gradients of Q, K, V and of gate and up in
the tails of their input gradients' reduce-scatters and matches eager; config.tail_matmuls off
leaves them as they were."""

import glob
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_pass import config
from overlap_pass.regions import tail_matmuls
from benchmarks.tp_models import TransformerBlock, parallelize_block

from .numerics_cases import _local

MM = torch.ops.aten.mm.default


def region(x, w, other, a, b, group):
    world = dist.get_world_size()
    dy = x * 2
    out = torch.ops.overlap.matmul_reduce_scatter([dy.view(2, -1, 12)], [w], None, "sum", 1, world, group)
    grad_w = torch.mm(dy.t(), other)  # the op input's weight gradient: taken
    after = torch.mm(dy.t(), out.reshape(-1, 12).repeat(world, 1))  # reads the op's result: stays
    unrelated = torch.mm(a, b)  # contracts no input of the op: stays
    return out, grad_w.relu(), after, unrelated


def traced() -> dict:
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    shapes = [(8 * world, 12), (12, 12), (8 * world, 5), (6, 7), (7, 5)]
    inputs = [torch.randn(shape) for shape in shapes]
    gm = make_fx(lambda *args: region(*args, group), tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    found = tail_matmuls.take_all(gm.graph)
    gm.graph.lint()
    gm.recompile()
    got = gm(*inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    tails = gm.graph.find_nodes(op="call_function", target=tail_matmuls.TAIL_OP)
    return {
        "taken": [[m["shape"] for m in r["tail_matmuls"]] for r in found.values()],
        "tail_of": [list(t.args[8]) for t in tails],
        "plain ops": len(gm.graph.find_nodes(op="call_function", target=tail_matmuls.OP)),
        "matmuls left": sorted(tuple(n.meta["val"].shape) for n in gm.graph.find_nodes(op="call_function", target=MM)),
    }


def test_only_the_weight_gradients_of_the_ops_inputs_are_taken(gloo_world):
    for result in gloo_world(2).run(traced):
        assert result["taken"] == [[[12, 5]]] and result["tail_of"] == [[0]], result
        assert result["plain ops"] == 0, result
        assert result["matmuls left"] == [(6, 5), (12, 12)], result  # unrelated, after


def compiled_block(enabled: bool, folder: str) -> dict:
    """The SP block (DTensor), forward and backward, under backend="overlap" and eagerly."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = parallelize_block(TransformerBlock(dim=64, heads=4, hidden=96, kv_heads=2), mesh)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(2, 6, 64)
    grads = []
    counters["overlap_pass"].clear()
    torch._dynamo.reset()
    patches = config.patch(tail_matmuls=enabled, debug_dir=os.path.join(folder, str(enabled)))
    for model in (torch.compile(block, backend="overlap"), block):
        inp = x.clone().requires_grad_()
        with patches:
            out = model(inp)
            out.backward(torch.ones_like(out))
        grads.append([out.detach(), inp.grad] + [_local(p.grad).clone() for p in block.parameters()])
        for p in block.parameters():
            p.grad = None
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    backward = glob.glob(os.path.join(folder, str(enabled), f"rank{dist.get_rank()}", "*backward*", "decisions.json"))
    with open(backward[0]) as f:
        records = json.load(f)["candidates"]
    tails = [sorted(m["shape"][0] for m in r.get("tail_matmuls", [])) for r in records if r["kind"] == "matmul_reduce_scatter"]
    return {"taken": counters["overlap_pass"]["tail_matmuls_taken"], "tails": sorted(tails)}


@pytest.mark.parametrize("enabled", [True, False])
def test_the_block_backward_takes_its_weight_gradients(gloo_world, tmp_path, enabled):
    for result in gloo_world(2).run(compiled_block, enabled, str(tmp_path)):
        if enabled:
            # Q, K and V's weight gradients in their input gradient's reduce-scatter (rows: each
            # rank's columns), gate's and up's in theirs
            assert result == {"taken": 5, "tails": [[16, 16, 32], [48, 48]]}, result
        else:
            assert result == {"taken": 0, "tails": [[], []]}, result
