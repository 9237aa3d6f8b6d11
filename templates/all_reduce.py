"""One-shot all-reduce of a small tensor through symmetric memory, in one kernel.

A small all-reduce (float8's amaxes, a norm weight's gradient) is all latency: NCCL's costs
tens of microseconds of host time a call and a kernel on its stream that the next kernel waits
for. Here each rank's workspace data region holds a block of flags and one slot per rank:

    [ flags: MAX_PROGRAMS x W int32, FLAG_BYTES ][ slot 0 | slot 1 | ... | slot W-1 ]

Program i of rank r owns elements i*BLOCK, (i + P)*BLOCK, ... of the tensor (P programs, the
same n and P on every rank, so program i of every rank owns the same elements). It:
1. stores its elements into slot r of every rank, itself included (NVLink stores);
2. after a CTA barrier, sets flags[i][r] of every rank to the call's epoch (release, system
   scope), so a peer that sees the flag sees the elements;
3. waits until flags[i][p] of its own region holds the epoch for every rank p (acquire,
   bounded: a wait that gives up writes the epoch into timeouts[p] and goes on);
4. reduces its elements over the W slots in rank order (fp32, fp64 for fp64 inputs), the same
   order on every rank, so every rank holds the same bits.

Program i waits only for the programs i of its peers, on other GPUs, never for a program of its
own rank. The barrier kernel before it (signals.BARRIER) advanced the epoch and saw every rank
finish its previous call, so no rank still reads a slot this call overwrites; flags hold epochs,
which only grow, so nothing is reset between calls and a CUDA-graph replay advances them too.

PUSH and REDUCE split the kernel for the interpreter tests, which run one rank at a time: every
rank's pushes first, then every rank's reductions. On GPUs both run in one launch.
"""

import triton
import triton.language as tl

from .launch import DirectKernel
from .signals import wait_flag

MAX_PROGRAMS = 16  # enough to move a few hundred KiB at NVLink speed; all resident at once
BLOCK = 1024
NUM_WARPS = 4
# reduce ops, as the kernel's OP constexpr
SUM, AVG, MAX, MIN = 0, 1, 2, 3
OPS = {"sum": SUM, "avg": AVG, "max": MAX, "min": MIN}


def flag_bytes(world_size: int) -> int:
    """Bytes of the flags block before the slots (a multiple of 256: slots stay aligned)."""
    return -(-MAX_PROGRAMS * world_size * 4 // 256) * 256


def programs(numel: int) -> int:
    return max(1, min(MAX_PROGRAMS, triton.cdiv(numel, BLOCK)))


@triton.jit
def _combine(acc, value, OP: tl.constexpr):
    # (OP as in OPS: 2 is max, 3 min; sum and avg add, avg divides after)
    if OP == 2:
        return tl.maximum(acc, value)
    elif OP == 3:
        return tl.minimum(acc, value)
    else:
        return acc + value


@triton.jit
def one_shot_all_reduce_kernel(
    src_ptr, out_ptr, data_ptrs_ptr, epoch_ptr, timeouts_ptr,
    n, rank, world_size,
    OP: tl.constexpr,
    FLAG_BYTES: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PUSH: tl.constexpr = True,
    REDUCE: tl.constexpr = True,
):  # fmt: skip
    """``data_ptrs_ptr``: int64 address of every rank's data region (flags block first), as
    this rank addresses it; ``timeouts_ptr``: a word per rank, for the waits that give up."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    offs = tl.arange(0, BLOCK)
    if PUSH:
        for p in range(world_size):
            base = tl.load(data_ptrs_ptr + p)
            slot = (base + FLAG_BYTES).to(tl.pointer_type(src_ptr.dtype.element_ty)) + rank * n
            for start in range(pid * BLOCK, n, num_programs * BLOCK):
                mask = start + offs < n
                tl.store(slot + start + offs, tl.load(src_ptr + start + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's stores before the release below
        for p in range(world_size):
            flags = tl.load(data_ptrs_ptr + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + pid * world_size + rank, epoch, sem="release", scope="sys")
    if REDUCE:
        own = tl.load(data_ptrs_ptr + rank)
        own_flags = own.to(tl.pointer_type(tl.int32)) + pid * world_size
        for p in range(world_size):
            wait_flag(own_flags, timeouts_ptr, p, epoch, SPIN_LIMIT)
        slots = (own + FLAG_BYTES).to(tl.pointer_type(src_ptr.dtype.element_ty))
        wide = tl.float64 if src_ptr.dtype.element_ty == tl.float64 else tl.float32
        for start in range(pid * BLOCK, n, num_programs * BLOCK):
            mask = start + offs < n
            acc = tl.load(slots + start + offs, mask=mask).to(wide)
            for p in range(1, world_size):
                acc = _combine(acc, tl.load(slots + p * n + start + offs, mask=mask).to(wide), OP)
            if OP == 1:
                acc = acc / world_size
            tl.store(out_ptr + start + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


ONE_SHOT = DirectKernel(one_shot_all_reduce_kernel)
