"""Bodies of the gloo numerics tests; each runs on every rank of a RankPool.

Each compiles with backend="overlap", runs forward and backward on fresh random inputs, compares
with eager at float32 tolerance, and returns the pass's decisions as (kind, rewritten, reason)
so the test can check that the rewrite really happened, or why not.
"""

import copy
import functools
import glob
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from overlap_pass import config
from overlap_pass.regions import split_cost
from benchmarks.tp_models import MLP, TransformerBlock, parallelize_block, parallelize_block_plain, parallelize_mlp

TOL = dict(atol=2e-5, rtol=2e-5)


@functools.cache
def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _decisions(folder: str) -> list[tuple]:
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "*", "decisions.json"))):
        with open(path) as f:
            found += [(c["kind"], c["rewritten"], c["reason"]) for c in json.load(f)["candidates"]]
    return sorted(found, key=str)


def run_decided(fn, *args, **kwargs) -> tuple[list[tuple], object]:
    """Runs fn with dumps on: (the decisions of every graph it compiled, what fn returned)."""
    torch._dynamo.reset()
    folder = tempfile.mkdtemp(prefix="overlap-test-")
    with config.patch(debug_dir=folder):
        result = fn(*args, **kwargs)
    return _decisions(folder), result


def _decided(fn):
    """Runs fn with dumps on and returns the decisions of every graph it compiled (or why the
    case was skipped, if fn returns a reason)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        decisions, skip = run_decided(fn, *args, **kwargs)
        return {"skip": skip} if skip else decisions

    return wrapper


def _compare_module(
    model, make_input, seed: int, tol: dict = TOL, autocast: bool = False, replicated: bool = False
) -> None:  # fmt: skip
    """Compiled vs eager copies of one parallelized model: outputs, input and parameter grads
    (forward under CPU autocast to bf16 if asked). Inputs and output grads differ between ranks
    (sequence shards) unless ``replicated``."""
    eager, compiled = model, copy.deepcopy(model)
    compiled_fn = torch.compile(compiled, backend="overlap")
    torch.manual_seed(seed + (0 if replicated else 1000 * dist.get_rank()))
    x = make_input()
    for step in range(2):  # the second step reuses the compiled graphs
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out_e, out_c = eager(xe), compiled_fn(xc)
        torch.testing.assert_close(out_c, out_e, **tol)
        grad = torch.randn_like(out_e)
        out_e.backward(grad)
        out_c.backward(grad)
        torch.testing.assert_close(xc.grad, xe.grad, **tol)
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(_local(pc.grad), _local(pe.grad), **tol, msg=name)
            pe.grad = pc.grad = None
        x = torch.randn_like(x)


@_decided
def tp_block(bias: bool, seed: int = 0, autocast: bool = False) -> dict:
    """The TP/SP block, fp32; with ``autocast``, run under autocast to bf16 (the pass then moves
    the gathers' casts onto the shards, casts.py) and compared to bf16 tolerance, as Inductor's
    own fusions round differently from eager."""
    torch.manual_seed(seed)  # the same full weights on every rank
    heads = max(4, dist.get_world_size())  # every rank holds whole heads
    block = parallelize_block(TransformerBlock(dim=32, heads=heads, hidden=64, bias=bias), _mesh())
    seq = 4 * dist.get_world_size()
    tol = dict(atol=3e-2, rtol=3e-2) if autocast else TOL
    _compare_module(block, lambda: torch.randn(2, seq // dist.get_world_size(), 32), seed, tol, autocast)


@_decided
def plain_tp_block(bias: bool, batch: int, seed: int = 0, autocast: bool = False, extra_tokens: int = 0) -> dict:
    """The block without sequence parallel: each all-reduce split around the row-wise ops
    (regions/split_*.py), here at a size where the cost model would keep them, so the split is
    forced (collectives' latency counted as nothing). ``autocast``: fp32 block under autocast to
    bf16, compared to bf16 tolerance. ``extra_tokens``: a sequence this much longer than 3 W
    (W does not divide the tokens: the shards are padded)."""
    torch.manual_seed(seed)
    heads = max(4, dist.get_world_size())
    block = parallelize_block_plain(TransformerBlock(dim=32, heads=heads, hidden=64, bias=bias), _mesh())
    # tokens divisible by W at batch 1, yet chunks cross sequences
    seq = 3 * dist.get_world_size() + extra_tokens
    tol = dict(atol=3e-2, rtol=3e-2) if autocast else TOL
    with split_cost.sizes_ignored():
        _compare_module(block, lambda: torch.randn(batch, seq, 32), seed, tol, autocast, replicated=True)


@_decided
def plain_tp_functional(name: str, seed: int = 0, extra_tokens: int = 0) -> dict:
    """A hand-written plain-TP graph (tests/plain_tp_cases.py), compiled for inference, against
    eager: the residual and the norm weight are the same on every rank, the row-parallel input
    and the linears' weights are each rank's own. 4 W tokens, and ``extra_tokens``."""
    from tests import plain_tp_cases

    fn = getattr(plain_tp_cases, name)
    torch.manual_seed(seed)
    residual, norm_weight = torch.randn(4 * dist.get_world_size() + extra_tokens, 32), torch.randn(32)
    torch.manual_seed(seed + 1 + dist.get_rank())
    x, w_row, w_col = torch.randn(residual.shape[0], 24), torch.randn(24, 32), torch.randn(32, 40)
    args = (x, residual, w_row, w_col, norm_weight)
    with split_cost.sizes_ignored():
        compiled = torch.compile(fn, backend="overlap", fullgraph=True)(*args, _group_name())
    torch.testing.assert_close(compiled, fn(*args, _group_name()), **TOL)


@_decided
def tp_mlp(bias: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    mlp = parallelize_mlp(MLP(dim=24, hidden=40 * dist.get_world_size(), bias=bias), _mesh())
    _compare_module(mlp, lambda: torch.randn(3, 5, 24), seed)


# ---------------------------------------------------------------------------------------------
# Hand-written collectives (Megatron style), through functional collectives


def _group_name() -> str:
    return dist.group.WORLD.group_name


def megatron_mlp(x, w_up, b_up, w_down, gather_dim, reduce_op, moved=False):
    """all_gather -> linear -> gelu -> linear -> reduce_scatter on plain tensors.

    The gather along a later dim is written out as split + cat: torch 2.11's Dynamo breaks the
    graph inside all_gather_tensor(gather_dim > 0), and its funcol needs contiguous inputs.
    ``moved``: the reduce-scatter along a later dim as spmd_types writes it (the dim moved to
    the front, scattered along dim 0, moved back)."""
    world = dist.get_world_size()
    gathered = funcol.all_gather_tensor(x.contiguous(), 0, _group_name())
    if gather_dim:
        gathered = torch.cat(torch.chunk(gathered, world, dim=0), dim=gather_dim)
    hidden = torch.nn.functional.gelu(torch.nn.functional.linear(gathered, w_up, b_up))
    out = torch.nn.functional.linear(hidden, w_down)
    if moved:
        front = out.movedim(gather_dim, 0).contiguous()
        return funcol.reduce_scatter_tensor(front, reduce_op, 0, _group_name()).movedim(0, gather_dim)
    return funcol.reduce_scatter_tensor(out, reduce_op, gather_dim, _group_name())


@_decided
def functional_mlp(shape: tuple, gather_dim: int, bias: bool, reduce_op: str, seed: int = 0, moved: bool = False):
    torch.manual_seed(seed + dist.get_rank())
    k, hidden = shape[-1], 12
    x = torch.randn(shape)
    w_up, w_down = torch.randn(hidden, k), torch.randn(k, hidden)
    b_up = torch.randn(hidden) if bias else None
    compiled = torch.compile(megatron_mlp, backend="overlap")
    for _ in range(2):
        args = (x, w_up, b_up, w_down, gather_dim, reduce_op, moved)
        torch.testing.assert_close(compiled(*args), megatron_mlp(*args), **TOL)
        x = torch.randn(shape)


def megatron_mlp_training(x, w_up, b_up, w_down, gather_dim, checkpointed):
    """megatron_mlp with differentiable collectives (reduce-scatter: "sum"); checkpointed, the
    backward gathers the input again for the weight grad of up."""
    world = dist.get_world_size()

    def body(x, w_up, b_up, w_down):
        gathered = funcol.all_gather_tensor_autograd(x.contiguous(), 0, _group_name())
        if gather_dim:
            gathered = torch.cat(torch.chunk(gathered, world, dim=0), dim=gather_dim)
        hidden = torch.nn.functional.gelu(torch.nn.functional.linear(gathered, w_up, b_up))
        out = torch.nn.functional.linear(hidden, w_down)
        return funcol.reduce_scatter_tensor_autograd(out, "sum", gather_dim, _group_name())

    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(body, x, w_up, b_up, w_down, use_reentrant=False)
    return body(x, w_up, b_up, w_down)


@_decided
def functional_mlp_training(shape: tuple, gather_dim: int, bias: bool, checkpointed: bool, seed: int = 0):
    """Forward and backward against eager: output, the input's grad, every weight's grad."""
    torch.manual_seed(seed + dist.get_rank())
    k, hidden = shape[-1], 12
    params = [torch.randn(hidden, k), torch.randn(hidden) if bias else None, torch.randn(k, hidden)]
    compiled = torch.compile(megatron_mlp_training, backend="overlap")
    for _ in range(2):
        runs = []
        for fn in (megatron_mlp_training, compiled):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()
            ps = [p.clone().requires_grad_() if p is not None else None for p in params]
            out = fn(x, ps[0], ps[1], ps[2], gather_dim, checkpointed)
            out.backward(torch.ones_like(out) + torch.arange(out.numel()).view(out.shape) % 3)
            runs.append([out, x.grad] + [p.grad for p in ps if p is not None])
        for got, want in zip(runs[1], runs[0]):
            torch.testing.assert_close(got, want, **TOL)
        seed += 1


# ---------------------------------------------------------------------------------------------
# Bad and odd input: each compiles and computes the right answer, rewritten or skipped


@_decided
def uneven_sequence(seed: int = 0):
    """A sequence length the world size does not divide: DTensor pads around the gather."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    torch.manual_seed(seed)
    mlp = parallelize_mlp(MLP(dim=16, hidden=8 * world), _mesh())
    make = lambda: distribute_tensor(torch.randn(2, 3 * world + 1, 16), _mesh(), [Shard(1)])  # noqa: E731
    try:
        mlp(make())
    except RuntimeError as error:  # nothing to compare against
        return f"eager DTensor fails on uneven shards with torch {torch.__version__}: {error}"
    _compare_module(mlp, make, seed)


@_decided
def non_contiguous_inputs(seed: int = 0):
    """Transposed activations and weights, in both directions."""
    torch.manual_seed(seed + dist.get_rank())
    compiled = torch.compile(megatron_mlp, backend="overlap")
    for _ in range(2):
        x = torch.randn(8, 2, 6).transpose(0, 2)  # [6, 2, 8], not contiguous
        w_up = torch.randn(8, 10).t()
        w_down = torch.randn(10, 8).t()
        for dim in (0, 1):
            args = (x, w_up, None, w_down, dim, "sum")
            torch.testing.assert_close(compiled(*args), megatron_mlp(*args), **TOL)


@_decided
def no_collectives(seed: int = 0):
    torch.manual_seed(seed)
    _compare_module(MLP(dim=8, hidden=16), lambda: torch.randn(3, 8), seed)


@_decided
def single_rank_group(seed: int = 0):
    """Collectives on a group of one rank (every rank its own group)."""
    group, _ = dist.new_subgroups(group_size=1)
    name = group.group_name

    def fn(x, w1, w2):
        hidden = funcol.all_gather_tensor(x, 0, name) @ w1
        return funcol.reduce_scatter_tensor(hidden @ w2, "sum", 0, name)

    torch.manual_seed(seed + dist.get_rank())
    args = (torch.randn(4, 8), torch.randn(8, 6), torch.randn(6, 8))
    torch.testing.assert_close(torch.compile(fn, backend="overlap")(*args), fn(*args), **TOL)


@_decided
def tp_inside_dp(seed: int = 0):
    """A 2-D mesh: tensor parallel on the inner dim, data parallel across; the collectives run
    on the TP sub-groups."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    mlp = parallelize_mlp(MLP(dim=16, hidden=8 * world), mesh["tp"])
    _compare_module(mlp, lambda: torch.randn(2, 3, 16), seed)


# Inductor's CPU kernels for the float8 block: precision casts emulated (as torchtitan compiles),
# and 256-bit vectors. On CPUs with AVX512-FP16, torch 2.13's 512-bit kernels gave NaN input
# gradients (plain backend="inductor" too, eager not; seen 2026-11-27).
FLOAT8_CPU_INDUCTOR = {"emulate_precision_casts": True, "cpp.simdlen": 256}


def _float8_block(recipe: str, parallelize):
    """The bf16 test block with torchao's Float8 linears (``recipe``), parallelized."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    block = TransformerBlock(dim=64, heads=dist.get_world_size(), hidden=128).to(torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))
    return parallelize(block, _mesh())


def _float8_steps(eager, x: torch.Tensor, steps: int, world: int) -> None:
    """``steps`` training steps of ``eager`` and of a compiled copy, compared by _float8_close
    (``world`` 0: by relative error), a new input each step."""
    compiled = copy.deepcopy(eager)
    compiled_fn = torch.compile(compiled, backend="overlap")
    for _ in range(steps):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_c = eager(xe), compiled_fn(xc)
        _float8_close(out_c, out_e, world, "output")
        grad = torch.randn_like(out_e)
        out_e.backward(grad)
        out_c.backward(grad)
        _float8_close(xc.grad, xe.grad, world, "input grad")
        for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
            _float8_close(_local(pc.grad), _local(pe.grad), world, name)
            pe.grad = pc.grad = None
        x = torch.randn_like(x)


@_decided
def float8_plain_tp_block(recipe: str, tokens: int, seed: int = 0) -> dict:
    """The block without sequence parallel, with torchao's Float8 linears, ``tokens`` a
    sequence (W need not divide them: the split's shards are then padded), forward and backward
    against eager by relative error, at any W: the split's reduce-scatters sum in fp32 where
    gloo's all-reduce sums bf16, and the next quantization moves some values an fp8 step."""
    torch.manual_seed(seed)
    block = _float8_block(recipe, parallelize_block_plain)
    torch.manual_seed(seed)  # the same input on every rank
    x = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
    forced = split_cost.sizes_ignored()
    with forced, torch._inductor.config.patch(FLOAT8_CPU_INDUCTOR):
        _float8_steps(block, x, 1, 0)


@_decided
def float8_tp_block(recipe: str, batch: int, seed: int = 0, fold: bool = True) -> dict:
    """The SP block in bf16 with torchao's Float8 linears (``recipe``: tensorwise or rowwise),
    against eager. Compiled with emulate_precision_casts (as torchtitan does), Inductor rounds
    bf16 as eager does, so the quantization sees the same values: a bf16 ulp apart, a value
    near an fp8 rounding boundary would land a whole fp8 step away. At W=2 the results are then
    eager's to bf16 tolerance (bitwise, as run); at W > 2 the reduce-scatters sum 3+ bf16
    partials in fp32 where gloo sums them in bf16, the next quantization moves some values by an
    fp8 step, and each tensor is compared by its relative error as a whole."""
    torch.manual_seed(seed)
    world = dist.get_world_size()
    block = _float8_block(recipe, parallelize_block)
    torch.manual_seed(seed + 1000 * dist.get_rank())
    x = torch.randn(batch, 32 // world, 64, dtype=torch.bfloat16)
    forced = split_cost.sizes_ignored()
    with forced, config.patch(fold_rowwise_float8=fold), torch._inductor.config.patch(FLOAT8_CPU_INDUCTOR):
        _float8_steps(block, x, 2, world)


def _float8_close(got: torch.Tensor, want: torch.Tensor, world: int, name: str) -> None:
    """Bitwise-close at W=2, else (or ``world`` 0) by relative error."""
    if world == 2:
        torch.testing.assert_close(got, want, msg=name)
        return
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error < 0.1, f"{name}: relative error {error:.3g}"


def _saved_bytes(run) -> int:
    """Bytes of the tensors autograd saves while ``run()`` runs the forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def tp_block_regathered(bias: bool, seed: int = 0) -> dict:
    """The TP/SP block with config.regather_in_backward: its decisions, equal to eager (as
    tp_block), and the bytes its compiled forward saves for the backward without the flag and
    with it, and those of one gathered activation."""
    with config.patch(regather_in_backward=True):
        decisions, _ = run_decided(tp_block.__wrapped__, bias, seed)
    saved = {}
    for regather in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        block = parallelize_block(TransformerBlock(dim=32, heads=4, hidden=64, bias=bias), _mesh())
        x = torch.randn(2, 4, 32, requires_grad=True)  # 4 tokens a rank
        with config.patch(regather_in_backward=regather):
            compiled = torch.compile(block, backend="overlap")
            saved[regather] = _saved_bytes(lambda: compiled(x))
    gathered = 2 * 4 * dist.get_world_size() * 32 * 4  # [2, 4 W, 32] fp32
    return {"decisions": decisions, "saved": saved, "gathered": gathered}
