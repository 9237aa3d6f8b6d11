"""An emulated NCCL collective on rank 0's GPU: a kernel of ``nccl_sms`` programs, as NCCL's
kernel holds that many SMs (one CTA per channel), that writes what the collective leaves in the
emulated world (timeline.py: gathered = the input W times, reduce-scattered = the sum of the
input's W chunks, all-reduced = W times the input or the input) and then holds its SMs until
NCCL's time for the size has passed since it started."""

import torch
import triton
import triton.language as tl

from overlap_pass.templates.launch import DirectKernel

from .pacing import _now, _wait_until

GATHER, REDUCE_SCATTER, ALL_REDUCE, NOTHING = 0, 1, 2, 3
SUM, AVG, MAX, MIN = 0, 1, 2, 3
BLOCK = 1024


@triton.jit
def _reduce(acc, value, OP: tl.constexpr):
    if OP == 2:
        return tl.maximum(acc, value)
    elif OP == 3:
        return tl.minimum(acc, value)
    else:
        return acc + value


@triton.jit
def _collective(src_ptr, dst_ptr, n, world_size, duration_ns, MODE: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr):
    """``n``: the elements of the input (gather, all-reduce) or of the output (reduce-scatter)."""
    start = _now()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    if MODE != 3:
        for base in range(pid * BLOCK, n, programs * BLOCK):
            idx = (base + offs).to(tl.int64)
            mask = idx < n
            if MODE == 0:
                value = tl.load(src_ptr + idx, mask=mask)
                for rank in range(world_size):
                    tl.store(dst_ptr + rank * n + idx, value, mask=mask)
            elif MODE == 1:
                acc = tl.load(src_ptr + idx, mask=mask).to(tl.float32)
                for rank in range(1, world_size):
                    acc = _reduce(acc, tl.load(src_ptr + rank * n + idx, mask=mask).to(tl.float32), OP)
                if OP == 1:
                    acc = acc / world_size
                tl.store(dst_ptr + idx, acc.to(dst_ptr.dtype.element_ty), mask=mask)
            else:
                value = tl.load(src_ptr + idx, mask=mask)
                if OP == 0:
                    value = (value.to(tl.float32) * world_size).to(dst_ptr.dtype.element_ty)
                tl.store(dst_ptr + idx, value, mask=mask)
    _wait_until(start + duration_ns)


# one kernel per collective, named so that a profile tells them apart (benchmarks/exposed_time.py)
@triton.jit
def emulated_nccl_all_gather(src_ptr, dst_ptr, n, world_size, duration_ns, OP: tl.constexpr, BLOCK: tl.constexpr):
    _collective(src_ptr, dst_ptr, n, world_size, duration_ns, 0, OP, BLOCK)


@triton.jit
def emulated_nccl_reduce_scatter(src_ptr, dst_ptr, n, world_size, duration_ns, OP: tl.constexpr, BLOCK: tl.constexpr):
    _collective(src_ptr, dst_ptr, n, world_size, duration_ns, 1, OP, BLOCK)


@triton.jit
def emulated_nccl_all_reduce(src_ptr, dst_ptr, n, world_size, duration_ns, OP: tl.constexpr, BLOCK: tl.constexpr):
    _collective(src_ptr, dst_ptr, n, world_size, duration_ns, 2, OP, BLOCK)


@triton.jit
def emulated_nccl_other(src_ptr, dst_ptr, n, world_size, duration_ns, OP: tl.constexpr, BLOCK: tl.constexpr):
    _collective(src_ptr, dst_ptr, n, world_size, duration_ns, 3, OP, BLOCK)


KERNELS = {
    GATHER: DirectKernel(emulated_nccl_all_gather), REDUCE_SCATTER: DirectKernel(emulated_nccl_reduce_scatter),
    ALL_REDUCE: DirectKernel(emulated_nccl_all_reduce), NOTHING: DirectKernel(emulated_nccl_other),
}  # fmt: skip


def _words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements, flat; 1-byte floats as uint8 (a gather moves bytes)."""
    flat = t.view(-1)
    return flat.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else flat


def launch(mode: int, src: torch.Tensor, dst: torch.Tensor, world: int, duration_us: float, sms: int, op: int = SUM) -> None:
    """On the current stream: the collective's values into ``dst`` (contiguous) and its time."""
    source, target = _words(src), _words(dst)
    n = target.numel() if mode == REDUCE_SCATTER else source.numel()
    KERNELS[mode][(max(1, sms),)](source, target, n, world, int(duration_us * 1000), OP=op, BLOCK=BLOCK, num_warps=4)
