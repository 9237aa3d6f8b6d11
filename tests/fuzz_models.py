"""Randomized tensor-parallel blocks for tests/fuzz.py: draw a case from a seed, build it on a
rank, run it compiled and eager, and return what differed and what the pass decided.

A case is a flat JSON-able dict (``draw(seed, worlds)``); ``run_case(case)`` runs on every rank
of a gloo RankPool of ``case["world"]`` ranks. Layouts (``case["layout"]``):

- dtensor_sp: benchmarks/tp_models.parallelize_block (DTensor styles, sequence parallel);
- dtensor_tp: parallelize_block_plain (replicated activations, all-reduces);
- functional_sp / functional_tp: the same block written Megatron style with functional
  collectives (all_gather_tensor_autograd / reduce_scatter_tensor_autograd, or all_reduce in
  Megatron's f/g autograd functions) on each rank's own plain parameters;
- mixed_sp / mixed_tp: one half (attention or feed-forward) DTensor, the other functional.
"""

import copy
import functools
import glob
import json
import os
import random
import shutil
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from benchmarks.tp_models import Bias, TransformerBlock, has_bias, parallelize_block, parallelize_block_plain

LAYOUTS = ("dtensor_sp", "dtensor_tp", "functional_sp", "functional_tp", "mixed_sp", "mixed_tp")
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
WORLDS = (2, 3, 4)

# fp32: tests/cpu/numerics_cases.py's tolerance (chunked matmuls and W-way sums in another order
# than eager's move results by a few fp32 ulps).
FP32_TOL = dict(atol=2e-5, rtol=2e-5)
# bf16 autocast: compiled and eager round at different places (Inductor keeps fused intermediates
# in fp32, the fused reduce-scatters sum bf16 partials in fp32 where gloo sums them in bf16), and
# a grad element that cancels to near zero keeps the rounding of its large terms, so no
# elementwise tolerance fits every case (a bias grad of 4 elements was 31% off, all rounding).
# Both are compared, as torch._dynamo.utils.same does with its fp64 reference, to the same model
# run eager without autocast: the compiled run's RMS error must stay within BF16_MULTIPLIER times
# eager autocast's own, plus BF16_FLOOR and one bf16 rounding step (2**-8) of the tensor's RMS
# (eager's own error can be luckily small: seed 1104's K weight grad, 1.2e-3 where its other
# steps and ranks gave 1.6e-3 to 3.1e-3). Where noise dominates, 10 times: tensors of 10 elements
# or fewer (as in torch's check), and tensors smaller than eager's own error (K's bias grad is
# zero but for rounding: softmax does not change when a row's scores all shift by q.b_k). A
# wrong chunk or a lost term is an error of the tensor's own size; every reduce-scatter off by
# 5% fails the check, by 1% it passes (fp32 cases fail both).
BF16_MULTIPLIER, BF16_NOISE_MULTIPLIER, BF16_FLOOR, BF16_STEP = 3.0, 10.0, 1e-3, 2.0**-8


def draw(seed: int, worlds=WORLDS) -> dict:
    """One case from ``random.Random(seed)``; the same seed and worlds give the same case."""
    rng = random.Random(seed)
    world = rng.choice(list(worlds))
    layout = rng.choice(LAYOUTS)
    style, parallel = layout.split("_")
    kv_heads = world * rng.choice((1, 1, 2))  # GQA with as few KV heads as TP allows: one a rank
    heads = kv_heads * rng.choice((1, 2, 3))
    functional = {"dtensor": (), "functional": ("attention", "feed_forward")}.get(style)
    if functional is None:
        functional = (rng.choice(("attention", "feed_forward")),)
    case = {
        "seed": seed,
        "world": world,
        "layout": layout,
        "functional": list(functional),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": rng.choice((2, 3, 4, 5, 8)),
        "hidden": world * rng.randint(2, 13),  # odd sizes, but whole columns on every rank
        # all, none, one, or each linear by a coin
        "bias": sorted(rng.choice((LINEARS, (), (rng.choice(LINEARS),), [n for n in LINEARS if rng.random() < 0.5]))),
        "batch": rng.choice((1, 2, 3)),
        "seq": world * rng.choice((1, 2, 3, 4)),
        "autocast": rng.random() < 0.35,
        # torch.utils.checkpoint of the whole block or of each half. Functional blocks only: in a
        # block with a DTensor half, checkpointed whole or in part, torch 2.13's AOTAutograd
        # saves the DeviceMesh for backward and raises ("expected all
        # tensors_saved_with_vc_check to be Tensors"), backend="inductor" too; 2.15 runs them.
        "checkpoint": rng.choice([None, "block", "halves"]) if style == "functional" else None,
        # Megatron's [seq, batch, dim] (functional halves only: DTensor's take [batch, seq, dim])
        "seq_first": bool(functional) and style == "functional" and rng.random() < 0.5,
        # a reduce-scatter along seq as spmd_types writes it: seq moved to the front and back
        "moved_scatter": False,
        "residual_before_scatter": bool(functional) and rng.random() < 0.3,
        "second_reader": bool(functional) and rng.random() < 0.3,
        # plain TP: split every all-reduce (regions/split_*.py), however small
        "force_split": parallel == "tp" and rng.random() < 0.8,
    }
    case["moved_scatter"] = bool(functional) and parallel == "sp" and not case["seq_first"] and rng.random() < 0.4
    return case


# ---------------------------------------------------------------------------------------------
# Functional-collective halves (Megatron style): plain local parameters, explicit collectives


def _group() -> str:
    return dist.group.WORLD.group_name


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _waited(funcol.all_reduce(grad, "sum", _group()))


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity gradient."""

    @staticmethod
    def forward(ctx, x):
        return _waited(funcol.all_reduce(x, "sum", _group()))

    @staticmethod
    def backward(ctx, grad):
        return grad


class Comm:
    """How a functional half enters (gather / f) and leaves (reduce-scatter / g) its region."""

    def __init__(self, case: dict) -> None:
        self.sp = case["layout"].endswith("_sp")
        self.seq_first = case["seq_first"]
        self.moved = case["moved_scatter"]
        self.world = case["world"]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            return _CopyToTP.apply(x)
        # along dim 0 then chunks moved to dim 1: Dynamo of torch 2.11 breaks the graph inside
        # all_gather_tensor(gather_dim > 0), as in tests/cpu/numerics_cases.megatron_mlp
        gathered = funcol.all_gather_tensor_autograd(x.contiguous(), 0, _group())
        if self.seq_first:
            return gathered
        return torch.cat(torch.chunk(gathered, self.world, dim=0), dim=1)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            return _ReduceFromTP.apply(partial)
        if self.seq_first:
            return funcol.reduce_scatter_tensor_autograd(partial.contiguous(), "sum", 0, _group())
        if self.moved:
            front = partial.movedim(1, 0).contiguous()
            return funcol.reduce_scatter_tensor_autograd(front, "sum", 0, _group()).movedim(0, 1)
        return funcol.reduce_scatter_tensor_autograd(partial, "sum", 1, _group())


class _FunctionalHalf(nn.Module):
    """The odd patterns shared by both halves: a second, non-matmul reader of the gathered input
    and a residual added to the partial sums before they are reduced."""

    def __init__(self, case: dict) -> None:
        super().__init__()
        self.comm = Comm(case)
        self.second_reader = case["second_reader"]
        self.residual_before_scatter = case["residual_before_scatter"]

    def read_again(self, h: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``h`` scaled by a mean over the gathered input's features (its non-matmul reader)."""
        return h * torch.sigmoid(full.mean(-1, keepdim=True)) if self.second_reader else h

    def leave(self, partial: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return self.comm.leave(partial + full if self.residual_before_scatter else partial)


class FunctionalAttention(_FunctionalHalf):
    """This rank's heads of tp_models.Attention; takes the normed activation (shard or replica)."""

    def __init__(self, case: dict, bias: Bias) -> None:
        super().__init__(case)
        world, hd = case["world"], case["head_dim"]
        dim, local, local_kv = case["heads"] * hd, case["heads"] // world, case["kv_heads"] // world
        self.head_dim, self.group = hd, case["heads"] // case["kv_heads"]
        self.q = nn.Linear(dim, local * hd, bias=has_bias(bias, "q"))
        self.k = nn.Linear(dim, local_kv * hd, bias=has_bias(bias, "k"))
        self.v = nn.Linear(dim, local_kv * hd, bias=has_bias(bias, "v"))
        self.o = nn.Linear(local * hd, dim, bias=has_bias(bias, "o"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.comm.enter(x)
        seq_first = self.comm.seq_first
        # to [batch, heads, seq, head_dim]
        order = (1, 2, 0, 3) if seq_first else (0, 2, 1, 3)
        q, k, v = (proj(full).unflatten(-1, (-1, self.head_dim)).permute(order) for proj in (self.q, self.k, self.v))
        if self.group > 1:
            k, v = (t.repeat_interleave(self.group, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.permute(2, 0, 1, 3) if seq_first else out.transpose(1, 2)
        out = self.read_again(out.flatten(-2), full)
        return self.leave(self.o(out), full)


class FunctionalFeedForward(_FunctionalHalf):
    """This rank's columns of tp_models.FeedForward (SwiGLU)."""

    def __init__(self, case: dict, bias: Bias) -> None:
        super().__init__(case)
        dim, local = case["heads"] * case["head_dim"], case["hidden"] // case["world"]
        self.gate = nn.Linear(dim, local, bias=has_bias(bias, "gate"))
        self.up = nn.Linear(dim, local, bias=has_bias(bias, "up"))
        self.down = nn.Linear(local, dim, bias=has_bias(bias, "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.comm.enter(x)
        hidden = self.read_again(F.silu(self.gate(full)) * self.up(full), full)
        return self.leave(self.down(hidden), full)


class Checkpointed(nn.Module):
    """A module under activation checkpointing (torch.utils.checkpoint, non-reentrant): its
    backward runs its forward again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@functools.cache
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def build(case: dict) -> nn.Module:
    """The case's block on this rank: DTensor halves from the same weights on every rank,
    functional halves from each rank's own."""
    torch.manual_seed(case["seed"])
    dim = case["heads"] * case["head_dim"]
    bias = set(case["bias"])
    block = TransformerBlock(dim, case["heads"], case["hidden"], bias, case["kv_heads"])
    if len(case["functional"]) < 2:  # a DTensor half: parallelize all, then swap in the other
        parallelize = parallelize_block if case["layout"].endswith("_sp") else parallelize_block_plain
        block = parallelize(block, _mesh())
    torch.manual_seed(case["seed"] + 1 + dist.get_rank())
    halves = case["checkpoint"] == "halves"
    if "attention" in case["functional"]:
        block.attention = FunctionalAttention(case, bias)
        block.attention = Checkpointed(block.attention) if halves else block.attention
    if "feed_forward" in case["functional"]:
        block.feed_forward = FunctionalFeedForward(case, bias)
        block.feed_forward = Checkpointed(block.feed_forward) if halves else block.feed_forward
    return Checkpointed(block) if case["checkpoint"] == "block" else block


def input_shape(case: dict) -> tuple:
    """This rank's input: its shard of the sequence (SP) or the whole of it (plain TP)."""
    seq = case["seq"] // case["world"] if case["layout"].endswith("_sp") else case["seq"]
    dim = case["heads"] * case["head_dim"]
    return (seq, case["batch"], dim) if case["seq_first"] else (case["batch"], seq, dim)


# ---------------------------------------------------------------------------------------------
# One case on one rank


# Scalar C++ kernels (no SIMD): they compile faster on CPU (no at::vec templates), and the FX
# graphs the pass reads and rewrites are those of a default compile (codegen comes after it).
# OVERLAP_FUZZ_FULL_CODEGEN=1 compiles as by default.
QUICK_CODEGEN = {"cpp.simdlen": 1}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _compare(got, want, truth, name: str, step: int, mismatches: list) -> None:
    """Records, rather than raises, a difference: every rank must still reach the collectives
    of the next step. ``truth``: the fp32 reference of a bf16 autocast run, else None."""
    got, want = _local(got).detach(), _local(want).detach()
    if truth is None:
        try:
            torch.testing.assert_close(got, want, **FP32_TOL)
        except AssertionError as error:
            mismatches.append(f"step {step}, {name}: {error}")
        return
    truth = _local(truth).detach().float()
    error, own = (_rmse(t, truth) for t in (got, want))
    size = truth.pow(2).mean().sqrt().item()
    noise = truth.numel() <= 10 or size < own
    allowed = (BF16_NOISE_MULTIPLIER if noise else BF16_MULTIPLIER) * own + BF16_FLOOR + BF16_STEP * size
    if not error <= allowed:
        mismatches.append(
            f"step {step}, {name}: RMS error against fp32 eager {error:.3g}, eager autocast's "
            f"{own:.3g}, RMS {size:.3g} (up to {allowed:.3g})"
        )


def _rmse(t: torch.Tensor, truth: torch.Tensor) -> float:
    return (t.float() - truth).pow(2).mean().sqrt().item()


def _step(model, x: torch.Tensor, grad: torch.Tensor | None, autocast: bool) -> dict:
    """One forward and backward of ``model``; its output and grads by name, grads cleared."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.backward(grad.to(out.dtype))
    found = {"output": out.detach(), "input grad": x.grad}
    module = getattr(model, "_orig_mod", model)
    for name, p in module.named_parameters():
        found[f"{name} grad"] = p.grad
        p.grad = None
    return found


def _compare_steps(case: dict, model: nn.Module, backend: str, mismatches: list) -> None:
    """Compiled vs eager copies of the model: output, input grad, parameter grads, two steps
    (the second reuses the compiled graphs); under autocast, each against an fp32 eager copy
    too."""
    autocast = case["autocast"]
    eager, compiled, reference = model, copy.deepcopy(model), copy.deepcopy(model) if autocast else None
    compiled_fn = torch.compile(compiled, backend=backend)
    replicated = case["layout"].endswith("_tp")
    generator = torch.Generator().manual_seed(case["seed"] * 7919 + (0 if replicated else 1 + dist.get_rank()))
    for step in range(2):
        x = torch.randn(input_shape(case), generator=generator)
        grad = torch.randn(x.shape, generator=generator)  # the block keeps its input's shape
        want = _step(eager, x, grad, autocast)
        got = _step(compiled_fn, x, grad, autocast)
        truth = _step(reference, x, grad, False) if autocast else {}
        for name in want:
            if (want[name] is None) != (got[name] is None):
                mismatches.append(f"step {step}, {name}: only {'eager' if got[name] is None else 'compiled'} has it")
            elif want[name] is not None:
                _compare(got[name], want[name], truth.get(name), name, step, mismatches)


def _decisions(folder: str) -> list[dict]:
    """Every candidate record of the graphs this rank compiled: graph, kind, rewritten, reason,
    and how many weight gradients ran in its tail (config.tail_matmuls)."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        graph = next((k for k in ("forward", "backward", "inference") if k in record["graph"]), record["graph"])
        found += [
            {
                "graph": graph, "kind": c["kind"], "rewritten": c["rewritten"], "reason": c.get("reason"),
                "tail_matmuls": len(c.get("tail_matmuls", [])),
            }  # fmt: skip
            for c in record["candidates"]
        ]
    return found


def run_case(case: dict, backend: str = "overlap") -> dict:
    """Runs one case on this rank: {"mismatches": [...], "decisions": [...], "error": traceback
    or None}. A crash is returned, not raised, so that the pool can go on. ``backend``:
    "inductor" runs the same case without the pass (does a failure come from torch itself?)."""
    from overlap_pass import config
    from overlap_pass.regions import split_cost

    # funcol's *_tensor_autograd: deprecated on torch 2.13, the only ones on 2.11
    warnings.filterwarnings("ignore", "`torch.distributed._functional_collectives", FutureWarning)
    torch._dynamo.reset()
    folder = tempfile.mkdtemp(prefix="overlap-fuzz-")
    mismatches, error = [], None
    quick = torch._inductor.config.patch(QUICK_CODEGEN if os.environ.get("OVERLAP_FUZZ_FULL_CODEGEN") != "1" else {})
    try:
        with config.patch(debug_dir=folder), quick, split_cost.sizes_ignored(case["force_split"]):
            _compare_steps(case, build(case), backend, mismatches)
    except Exception:
        error = traceback.format_exc()
    decisions = _decisions(folder)
    shutil.rmtree(folder, ignore_errors=True)
    torch._dynamo.reset()
    return {"mismatches": mismatches, "decisions": decisions, "error": error}
