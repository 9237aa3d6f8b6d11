"""tools/no_comm.py, the benchmarks' no-communication floor: every collective of the forward and
backward graphs becomes a local op of its shape, and the step computes what those ops say."""

import torch
import torch.distributed._functional_collectives as funcol

from tests.cpu.fake_world import fake_world
from tools.no_comm import NoCommunication


class _Recording(NoCommunication):
    def __init__(self) -> None:
        self.targets = []

    def __call__(self, graph) -> None:
        super().__call__(graph)
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

    assert len(recording.targets) == 2  # the forward and the backward graph
    for targets in recording.targets:
        assert not [t for t in targets if "c10d" in t], targets
    # gather -> x twice over; reduce-scatter -> the first half of the rows; and in the backward
    # the gradient gathered -> twice over, scattered -> the first half
    torch.testing.assert_close(out, (x.repeat(2, 1) @ w)[:3])
    torch.testing.assert_close(x.grad, grad @ w.T)
    torch.testing.assert_close(w.grad, 2 * x.T @ grad)


def test_the_benchmarked_block_keeps_no_collective():
    """The DTensor block tools/bench_model.py times: 4 collectives forward, 4 backward, all
    replaced."""
    from torch.distributed.device_mesh import init_device_mesh

    from tools.tp_models import TransformerBlock, parallelize_block

    recording = _Recording()
    with fake_world(4):
        block = TransformerBlock(dim=32, heads=8, hidden=64, kv_heads=4)
        block = parallelize_block(block, init_device_mesh("cpu", (4,)))
        compiled = torch.compile(block, options={"post_grad_custom_pre_pass": recording})
        x = torch.randn(1, 3, 32, requires_grad=True)
        out = compiled(x)
        out.backward(torch.randn_like(out))
    assert len(recording.targets) == 2
    for targets in recording.targets:
        assert not [t for t in targets if "c10d" in t], targets
    assert out.shape == x.shape and x.grad.shape == x.shape
