"""Bodies of the gloo numerics tests; each runs on every rank of a GlooWorld.

Each compiles with backend="overlap", runs forward and backward on fresh random inputs, compares
with eager at float32 tolerance, and returns the pass's counters so the test can check that the
rewrite really happened.
"""

import copy
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import overlap_pass  # noqa: F401  (registers the ops and the backend)
from tools.tp_models import MLP, TransformerBlock, parallelize_block, parallelize_mlp

TOL = dict(atol=2e-5, rtol=2e-5)


@functools.cache
def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _compare_module(model, make_input, seed: int) -> dict:
    """Compiled vs eager copies of one parallelized model: outputs, input and parameter grads."""
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = model, copy.deepcopy(model)
    compiled_fn = torch.compile(compiled, backend="overlap")
    torch.manual_seed(seed + 1000 * dist.get_rank())
    x = make_input()
    for step in range(2):  # the second step reuses the compiled graphs
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_c = eager(xe), compiled_fn(xc)
        torch.testing.assert_close(out_c, out_e, **TOL)
        grad = torch.randn_like(out_e)
        out_e.backward(grad)
        out_c.backward(grad)
        torch.testing.assert_close(xc.grad, xe.grad, **TOL)
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(_local(pc.grad), _local(pe.grad), **TOL, msg=name)
            pe.grad = pc.grad = None
        x = torch.randn_like(x)
    return dict(counters["overlap_pass"])


def tp_block(bias: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)  # the same full weights on every rank
    block = parallelize_block(TransformerBlock(dim=32, heads=4, hidden=64, bias=bias), _mesh())
    seq = 4 * dist.get_world_size()
    return _compare_module(block, lambda: torch.randn(2, seq // dist.get_world_size(), 32), seed)


def tp_mlp(bias: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    mlp = parallelize_mlp(MLP(dim=24, hidden=40 * dist.get_world_size(), bias=bias), _mesh())
    return _compare_module(mlp, lambda: torch.randn(3, 5, 24), seed)


# ---------------------------------------------------------------------------------------------
# Hand-written collectives (Megatron style), through functional collectives


def _group_name() -> str:
    return dist.group.WORLD.group_name


def megatron_mlp(x, w_up, b_up, w_down, gather_dim, reduce_op):
    """all_gather -> linear -> gelu -> linear -> reduce_scatter on plain tensors."""
    gathered = funcol.all_gather_tensor(x, gather_dim, _group_name())
    hidden = torch.nn.functional.gelu(torch.nn.functional.linear(gathered, w_up, b_up))
    out = torch.nn.functional.linear(hidden, w_down)
    return funcol.reduce_scatter_tensor(out, reduce_op, gather_dim, _group_name())


def functional_mlp(shape: tuple, gather_dim: int, bias: bool, reduce_op: str, seed: int = 0):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(seed + dist.get_rank())
    k, hidden = shape[-1], 12
    x = torch.randn(shape)
    w_up, w_down = torch.randn(hidden, k), torch.randn(k, hidden)
    b_up = torch.randn(hidden) if bias else None
    compiled = torch.compile(megatron_mlp, backend="overlap")
    for _ in range(2):
        args = (x, w_up, b_up, w_down, gather_dim, reduce_op)
        torch.testing.assert_close(compiled(*args), megatron_mlp(*args), **TOL)
        x = torch.randn(shape)
    return dict(counters["overlap_pass"])
