"""benchmarks/no_comm.py, the benchmarks' no-communication floor: every collective of the forward and
backward graphs becomes a local op of its shape, and the step computes what those ops say."""

import torch
import torch.distributed._functional_collectives as funcol

from tests.cpu.fake_world import fake_world
from benchmarks.no_comm import NoCommunication, drop_communication


class _Recording(NoCommunication):
    """Per graph: how many collectives were replaced, and the targets left."""

    def __init__(self) -> None:
        self.replaced, self.targets = [], []

    def __call__(self, graph) -> None:
        self.replaced.append(drop_communication(graph))
        self.targets.append({str(node.target) for node in graph.nodes})


def test_every_collective_becomes_local():
    torch.manual_seed(0)
    recording = _Recording()
    with fake_world(2) as group:

        def linear_pair(x, w):
            gathered = funcol.all_gather_tensor_autograd(x, 0, group)
            return funcol.reduce_scatter_tensor_autograd(gathered @ w, "sum", 0, group)

        x = torch.randn(3, 8, requires_grad=True)
        w = torch.randn(8, 5, requires_grad=True)
        compiled = torch.compile(linear_pair, options={"post_grad_custom_pre_pass": recording}, fullgraph=True)
        out = compiled(x, w)
        grad = torch.randn_like(out)
        out.backward(grad)

    assert recording.replaced == [2, 2]  # the forward and the backward graph
    for targets in recording.targets:
        assert not [t for t in targets if "c10d" in t], targets
    # gather -> x twice over; reduce-scatter -> the first half of the rows; and in the backward
    # the gradient gathered -> twice over, scattered -> the first half
    torch.testing.assert_close(out, (x.repeat(2, 1) @ w)[:3])
    torch.testing.assert_close(x.grad, grad @ w.T)
    torch.testing.assert_close(w.grad, 2 * x.T @ grad)


def test_the_benchmarked_block_keeps_no_collective():
    """The DTensor block benchmarks/bench_model.py times: 4 collectives forward, 4 backward, all
    replaced."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.tp_models import TransformerBlock, parallelize_block

    recording = _Recording()
    with fake_world(4):
        block = TransformerBlock(dim=32, heads=8, hidden=64, kv_heads=4)
        block = parallelize_block(block, init_device_mesh("cpu", (4,)))
        compiled = torch.compile(block, options={"post_grad_custom_pre_pass": recording})
        x = torch.randn(1, 3, 32, requires_grad=True)
        out = compiled(x)
        out.backward(torch.randn_like(out))
    assert recording.replaced == [4, 4]
    for targets in recording.targets:
        assert not [t for t in targets if "c10d" in t], targets
    assert out.shape == x.shape and x.grad.shape == x.shape


def test_a_collective_it_does_not_replace_keeps_its_wait(caplog):
    """An all-to-all stays, with its wait; the all-reduce after it becomes a copy."""
    recording = _Recording()
    with fake_world(2) as group:

        def exchange(x):
            return funcol.all_reduce(funcol.all_to_all_single(x, None, None, group) * 2, "sum", group)

        x = torch.randn(4, 3)
        torch.compile(exchange, options={"post_grad_custom_pre_pass": recording}, fullgraph=True)(x)
    (targets,) = recording.targets
    assert recording.replaced == [1]
    assert "_c10d_functional.all_to_all_single.default" in targets
    assert "_c10d_functional.wait_tensor.default" in targets
    assert "_c10d_functional.all_reduce.default" not in targets
    assert "all_to_all_single" in caplog.text
