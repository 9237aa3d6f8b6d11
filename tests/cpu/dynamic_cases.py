"""Bodies of the shape-changing gloo tests; each runs on every rank of a RankPool.

One compiled function or module is called at several token counts and then at the first again,
as a trainer meets a last partial batch or an evaluation at another length: torch.compile
recompiles with symbolic sizes at the second shape (automatic dynamic), or compiles symbolic
from the start (``mark_dynamic``). Every call is checked against eager (forward and backward) and
counts the overlap op calls that ran: a graph that lost its rewrite runs none.
"""

import contextlib
import copy
import functools
import unittest.mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters

from overlap_pass import config

from overlap_pass.shapes import new_counts

from overlap_pass.lowering import dispatch
from overlap_pass.ops import matmul_ops
from overlap_pass.regions import split_cost

from tests.fuzz_models import _CopyToTP, _ReduceFromTP
from benchmarks.tp_models import MLP, TransformerBlock, parallelize_block, parallelize_mlp

from .numerics_cases import TOL, _group_name, _local, _mesh, run_decided

def count_overlap_ops(step) -> int:
    """Runs ``step()``; how many overlap op calls ran in it (their reference decomposition
    resolves its group once a call; fake calls while compiling do not)."""
    calls = []
    real = matmul_ops.resolve_group

    def counted(*args):
        calls.append(args)
        return real(*args)

    with unittest.mock.patch.object(matmul_ops, "resolve_group", counted):
        step()
    return len(calls)


def _decided(fn):
    """Runs fn with dumps on: (the decisions of every graph it compiled, what fn returned)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return run_decided(fn, *args, **kwargs)

    return wrapper


def _train_at(inputs, eager, compiled_fn, close) -> list[int]:
    """For each input (a rank's tensor): a training step eagerly and compiled, compared by
    ``close(got, want, what)`` (output, input grad, each parameter's grad); returns the op
    calls of each compiled step."""
    counts = []
    for x in inputs:
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e = eager(xe)
        grad = torch.randn_like(out_e)
        out_e.backward(grad)

        def step():
            out_c = compiled_fn(xc)
            out_c.backward(grad)
            step.out = out_c

        counts.append(count_overlap_ops(step))
        rows = f"at {x.shape[1]} tokens a rank"
        close(_local(step.out), _local(out_e), f"output {rows}")
        close(_local(xc.grad), _local(xe.grad), f"input grad {rows}")
        for (name, pe), pc in zip(eager.named_parameters(), compiled_fn.parameters()):
            close(_local(pc.grad), _local(pe.grad), f"{name} {rows}")
            pe.grad = pc.grad = None
    return counts


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=what)


def sp_mlp(x, w_up, w_down, gather_dim: int):
    """Megatron's SP MLP on plain tensors: gather the token shards, up, gelu, down, scatter."""
    world = dist.get_world_size()
    gathered = funcol.all_gather_tensor_autograd(x.contiguous(), 0, _group_name())
    if gather_dim:
        gathered = torch.cat(torch.chunk(gathered, world, dim=0), dim=gather_dim)
    hidden = torch.nn.functional.gelu(gathered @ w_up.t())
    return funcol.reduce_scatter_tensor_autograd(hidden @ w_down.t(), "sum", gather_dim, _group_name())


@_decided
def functional_at_lengths(lengths: list[int], gather_dim: int, mark: bool, plain_first: int = 0) -> list[dict]:
    """sp_mlp trained at each of ``lengths`` tokens a rank (along ``gather_dim`` of a
    [tokens, 16] or [2, tokens, 16] shard); ``mark``: the token dim marked dynamic before the
    first call. ``plain_first``: config.fused_from_call, with a symbolic graph's new counts on
    plain Inductor's graph as on CUDA (new_counts.py). Returns the op counts of each call and
    how many graphs Dynamo compiled (a guard on a token count would add one at a new count)."""
    if plain_first:
        with contextlib.ExitStack() as stack:
            stack.enter_context(config.patch(fused_from_call=plain_first))
            # as on CUDA inputs; the process-wide switch restored for the pool's next task
            on_cuda = lambda inputs, patches: config.plain_graph_at_new_counts  # noqa: E731
            stack.enter_context(unittest.mock.patch.object(new_counts, "applies", on_cuda))
            stack.enter_context(unittest.mock.patch.object(dispatch, "first_calls_on_nccl", True))
            return functional_at_lengths.__wrapped__(lengths, gather_dim, mark)
    torch.manual_seed(dist.get_rank())
    w_up, w_down = torch.randn(24, 16), torch.randn(16, 24)
    compiled = torch.compile(sp_mlp, backend="overlap")
    counts = []
    graphs_before = counters["stats"]["unique_graphs"]
    for length in lengths:
        shape = (length, 16) if gather_dim == 0 else (2, length, 16)
        x = torch.randn(shape)
        runs = []
        for fn in (sp_mlp, compiled):
            xi, up, down = x.clone().requires_grad_(), w_up.clone().requires_grad_(), w_down.clone().requires_grad_()
            if mark and fn is compiled:
                torch._dynamo.mark_dynamic(xi, gather_dim)

            def step():
                out = fn(xi, up, down, gather_dim)
                out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(length)))
                runs.append([out, xi.grad, up.grad, down.grad])

            if fn is compiled:
                counts.append(count_overlap_ops(step))
            else:
                step()
        for got, want in zip(runs[1], runs[0]):
            torch.testing.assert_close(got, want, **TOL)
    return counts, counters["stats"]["unique_graphs"] - graphs_before


@_decided
def dtensor_at_lengths(lengths: list[int], block: bool) -> list[dict]:
    """The DTensor SP MLP (or the whole block) trained at each of ``lengths`` tokens a rank
    (the rank's sequence shard of a batch of 2, as the plan takes it). Returns the op counts
    of each call."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    if block:
        model = parallelize_block(TransformerBlock(dim=32, heads=max(4, world), hidden=64), _mesh())
    else:
        model = parallelize_mlp(MLP(dim=16, hidden=8 * world), _mesh())
    dim = 32 if block else 16
    compiled_fn = torch.compile(copy.deepcopy(model), backend="overlap")

    def shard(length: int) -> torch.Tensor:
        torch.manual_seed(length)
        return torch.randn(2, length * world, dim).chunk(world, dim=1)[dist.get_rank()]

    return _train_at([shard(length) for length in lengths], model, compiled_fn, _close)


def block_tails_at_lengths(lengths: list[int]) -> dict:
    """dtensor_at_lengths' block with the weight gradients in the reduce-scatters' tails
    (config.tail_matmuls): the op calls of each call, and how many weight gradients the
    compiled backwards took (the static graph's and the symbolic one's)."""
    counters["overlap_pass"].clear()
    with config.patch(tail_matmuls=True):
        _, calls = dtensor_at_lengths(lengths, True)
    return {"calls": calls, "taken": counters["overlap_pass"]["tail_matmuls_taken"]}


@_decided
def float8_at_lengths(lengths: list[int], recipe: str) -> list[int]:
    """The SP block in bf16 with torchao's Float8 linears (``recipe``), trained at each of
    ``lengths`` tokens a rank, against eager (as numerics_cases.float8_tp_block compares).
    Returns the op counts of each call."""
    from .numerics_cases import FLOAT8_CPU_INDUCTOR, _float8_block, _float8_close

    torch.manual_seed(0)
    world = dist.get_world_size()
    block = _float8_block(recipe, parallelize_block)
    # at these sizes the cost model keeps the float8 gathers: forced, as in float8_tp_block
    forced = split_cost.sizes_ignored()
    with forced, torch._inductor.config.patch(FLOAT8_CPU_INDUCTOR):
        compiled_fn = torch.compile(copy.deepcopy(block), backend="overlap")

        def x(length: int) -> torch.Tensor:
            torch.manual_seed(length + 1000 * dist.get_rank())
            return torch.randn(2, length, 64, dtype=torch.bfloat16)

        close = lambda got, want, what: _float8_close(got, want, world, what)  # noqa: E731
        return _train_at([x(length) for length in lengths], block, compiled_fn, close)


@_decided
def plain_tp_at_lengths(
    lengths: list[int], batch, backend: str = "overlap", split_from: int | None = None, patches: dict | None = None
) -> list[int]:
    """The plain-TP block (activations whole on every rank, an all-reduce after each row-parallel
    linear) for inference (a prefill) at each of ``lengths`` tokens a sequence, ``batch``
    sequences (or batch[i] at the i-th call); the all-reduce split forced at these sizes, as in
    numerics_cases.plain_tp_block, or (``split_from``) paying from that many tokens on
    (config.split_min_bytes); under config ``patches``. Returns the op counts of each call."""
    from benchmarks.tp_models import parallelize_block_plain

    torch.manual_seed(0)
    world = dist.get_world_size()
    block = parallelize_block_plain(TransformerBlock(dim=32, heads=max(4, world), hidden=64), _mesh())
    compiled = torch.compile(copy.deepcopy(block), backend=backend)
    counts = []
    split_min_bytes = 0 if split_from is None else split_from * 32 * 4 * (world - 1) // world
    patched = config.patch(split_min_bytes=split_min_bytes, **(patches or {}))
    with split_cost.sizes_ignored(), patched, torch.no_grad():
        for call, length in enumerate(lengths):
            torch.manual_seed(length)  # the same input on every rank
            x = torch.randn(batch[call] if isinstance(batch, list) else batch, length, 32)
            counts.append(count_overlap_ops(lambda: setattr(compiled, "out", compiled(x))))
            torch.testing.assert_close(compiled.out, block(x), **TOL)
    return counts


class _MegatronPlainMLP(torch.nn.Module):
    """A rank's half of a plain-TP MLP written by hand (Megatron's f and g around it): its
    forward ends in an all-reduce of the down projection's partial sums, its backward in one of
    the input gradient's. DTensor's plain-TP block does not train at symbolic sizes on torch 2.13
    (a RecursionError in AOTAutograd, plain Inductor and aot_eager alike)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(self.down(torch.nn.functional.silu(self.up(_CopyToTP.apply(x)))))


@_decided
def plain_tp_training_at_lengths(lengths: list[int], split_from: int) -> list[int]:
    """_MegatronPlainMLP trained at each of ``lengths`` tokens (the forward's and the
    backward's all-reduce split paying from ``split_from`` tokens on, config.split_min_bytes;
    the all-reduces left unsplit stay NCCL's, so that only splits add op calls), every step
    against eager. Returns the op calls of each step."""
    world = dist.get_world_size()
    torch.manual_seed(dist.get_rank())  # a rank's own halves of the weights
    eager = _MegatronPlainMLP(32, 64 // world)
    compiled = torch.compile(copy.deepcopy(eager), backend="overlap")
    inputs = []
    for length in lengths:
        torch.manual_seed(length)  # the same input on every rank
        inputs.append(torch.randn(1, length, 32))
    split_min_bytes = split_from * 32 * 4 * (world - 1) // world
    with split_cost.sizes_ignored(), config.patch(split_min_bytes=split_min_bytes, small_all_reduce_bytes=0):
        return _train_at(inputs, eager, compiled, _close)
