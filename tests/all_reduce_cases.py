"""Per-rank bodies of tests/gpu/test_all_reduce_gpu.py: overlap::all_reduce's one-shot kernel
against NCCL's all-reduce of the same tensors, on fresh random inputs and a NaN-poisoned
workspace."""

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.lowering import all_reduce as ar
from overlap_pass.lowering import replay
from tests.gpu_common import group_name, message_of_a_late_peer, poison_workspace

NUMELS = (1, 7, 1000, ar.kernel.BLOCK * 17 + 3, 65536)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
OPS = ("sum", "avg", "max", "min")


def _input(numel, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + dist.get_rank())
    return (torch.randn(numel, device="cuda", generator=gen) * 4).to(dtype)


def _expected(x, op):
    """NCCL's all-reduce of the fp64 values: exact for max and min, the true sum otherwise."""
    wide = x.double()
    dist.all_reduce(wide, op=ar.NCCL_OPS[op])
    return wide


def _bad(out, want, op) -> bool:
    if op in ("max", "min"):
        return not torch.equal(out.double(), want)
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-5
    return not torch.allclose(out.double(), want, atol=tol, rtol=tol)


def every_shape_matches() -> int:
    """one_shot on every numel, dtype and reduce op; the same bits on every rank."""
    checked, bad = 0, []
    for i, (numel, dtype, op) in enumerate((n, d, o) for n in NUMELS for d in DTYPES for o in OPS):
        x = _input(numel, dtype, i)
        poison_workspace()
        out = ar.one_shot(x, op, dist.get_world_size(), group_name())
        want = _expected(x, op)
        if _bad(out, want, op):
            bad.append((numel, dtype, op))
        everyone = [torch.empty_like(out) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, out)
        if not all(torch.equal(e.view(torch.uint8), out.view(torch.uint8)) for e in everyone):
            bad.append((numel, dtype, op, "ranks differ"))
        checked += 1
    assert not bad, f"rank {dist.get_rank()}: {bad}"
    return checked


def back_to_back(calls: int) -> dict:
    """``calls`` calls of the op in a row on the same buffers (so that they replay per-call
    graphs), each on new values, checked against NCCL at the end (one sync). one_shot forced:
    the choice could pick NCCL at this size."""
    with config.patch(implementation="one_shot"):
        return _back_to_back(calls)


def _back_to_back(calls: int) -> dict:
    world = dist.get_world_size()
    before = dict(replay.stats)
    x = torch.empty(3000, device="cuda")
    outs, wants = [], []
    for call in range(calls):
        x.copy_(_input(3000, torch.float32, 10_000 + call))
        op = OPS[call % len(OPS)]
        outs.append(torch.ops.overlap.all_reduce(x, op, world, group_name()).clone())
        wants.append((op, _expected(x, op)))
    bad = [i for i, (out, (op, want)) in enumerate(zip(outs, wants)) if _bad(out, want, op)]
    assert not bad, f"rank {dist.get_rank()}: calls {bad[:5]} wrong of {calls}"
    return {k: replay.stats[k] - before.get(k, 0) for k in ("eager", "captured", "replayed")}


def late_peer_is_named() -> str:
    world = dist.get_world_size()
    x = _input(100, torch.float32, 0)
    return message_of_a_late_peer(
        ar.KIND, ar.kernel.flag_bytes(world) + world * 400, lambda name: ar.one_shot(x, "sum", world, name)
    )
