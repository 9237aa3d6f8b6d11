"""Device-side protocol helpers: wait for a chunk's progress flag.

Flags are int32 words that a producer (a copy of the epoch after the chunk's data, or a kernel)
sets to the call's epoch once a chunk has landed; epochs only grow, so flags are never reset.
Comparisons are wrap-safe ((value - epoch) < 0 in int32), so a counter that passes 2**31 calls
keeps working. Every wait is bounded: after ``spin_limit`` polls it writes the call's epoch into
the timeout word of the chunk (or rank) it gave up on, so the host can name them instead of
hanging the GPU.
"""

import triton
import triton.language as tl

from .launch import DirectKernel


@triton.jit
def _behind(value, epoch):
    """value < epoch for epochs that wrap around int32 (as long as they are < 2**31 apart)."""
    return (value - epoch) < 0


@triton.jit
def wait_flag(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT: tl.constexpr):
    """wait(flags[chunk] >= epoch, scope=sys, sem=acquire), at most SPIN_LIMIT polls.

    An acquire read (atomic add of 0), so that every load after it sees the chunk's
    data; on giving up, timeouts[chunk] = epoch (relaxed) and the caller goes on. A chunk given
    up on in this call is not waited for again by later tiles, so a lost peer costs one spin per
    call, not one per tile; the next call waits afresh."""
    given_up = tl.load(timeouts_ptr + chunk, volatile=True) == epoch
    polls = given_up.to(tl.int32) * SPIN_LIMIT
    value = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
    while _behind(value, epoch) & (polls < SPIN_LIMIT):
        value = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
        polls += 1
    if _behind(value, epoch):
        tl.atomic_xchg(timeouts_ptr + chunk, epoch, sem="relaxed", scope="gpu")


@triton.jit
def barrier_kernel(
    pad_ptrs_ptr, epoch_ptr, timeouts_ptr, rank, world_size,
    SPIN_LIMIT: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One program: advance this rank's epoch, tell every rank (itself included) that this rank
    reached it, and wait until every rank has told this one the same.

    ``pad_ptrs_ptr``: int64 addresses of each rank's pad, W int32 words in symmetric memory;
    rank p writes slot ``rank`` of every pad. Values are epochs, which only grow, so pads are
    never reset and a CUDA-graph replay advances them too. On giving up after SPIN_LIMIT polls,
    timeouts[p] = epoch for each rank p that never arrived."""
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    ranks = tl.arange(0, BLOCK_W)
    live = ranks < world_size
    pads = tl.load(pad_ptrs_ptr + ranks, mask=live, other=0).to(tl.pointer_type(tl.int32))
    # release: every write this rank made before the barrier is visible to a peer that sees it
    tl.atomic_xchg(pads + rank, epoch, mask=live, sem="release", scope="sys")
    own = tl.load(pad_ptrs_ptr + rank).to(tl.pointer_type(tl.int32))
    seen = tl.atomic_add(own + ranks, 0, mask=live, sem="acquire", scope="sys")
    missing = tl.sum((_behind(seen, epoch) & live).to(tl.int32), axis=0)
    polls = 0
    while (missing > 0) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(own + ranks, 0, mask=live, sem="acquire", scope="sys")
        missing = tl.sum((_behind(seen, epoch) & live).to(tl.int32), axis=0)
        polls += 1
    tl.store(timeouts_ptr + ranks, epoch, mask=live & _behind(seen, epoch))


@triton.jit
def wait_kernel(flags_ptr, epoch_ptr, timeouts_ptr, chunk, SPIN_LIMIT: tl.constexpr):
    """One program that holds its stream until flags[chunk] reaches the call's epoch, so that
    stream work queued after it (a cuBLAS matmul of that chunk) reads the chunk's data."""
    wait_flag(flags_ptr, timeouts_ptr, chunk, tl.load(epoch_ptr), SPIN_LIMIT)


@triton.jit
def wait_for_peers_kernel(flags_ptr, epoch_ptr, timeouts_ptr, rank, world_size, SPIN_LIMIT: tl.constexpr):
    """One program that holds its stream until flags[p] reaches the call's epoch for every rank
    p but ``rank`` (whose slot its own stream wrote), so that stream work queued after it reads
    every peer's data: a kernel boundary makes what the wait acquired visible."""
    epoch = tl.load(epoch_ptr)
    for peer in range(0, world_size):
        if peer != rank:
            wait_flag(flags_ptr, timeouts_ptr, peer, epoch, SPIN_LIMIT)


BARRIER = DirectKernel(barrier_kernel)
WAIT = DirectKernel(wait_kernel)
WAIT_FOR_PEERS = DirectKernel(wait_for_peers_kernel)


@triton.jit
def wait_flag_in_pipeline(flags_ptr, timeouts_ptr, chunk, epoch, row, needed, SPIN_LIMIT: tl.constexpr):
    """wait_flag for a loop that Triton software-pipelines (a TMA consumer's flattened tile loop),
    on GPUs only, called on every iteration: waits only if ``needed``. What keeps the loop
    pipelined (checked in the TTGIR): the poll loop is one inline-PTX op (a loop in the body,
    wait_flag's, stops pipelining), and no load or wait sits under a branch of the body.
    Returns ``row`` through the same op, so a load that takes its row from here depends on the
    wait and the pipeliner cannot issue it earlier; then fence.proxy.async.global, for the TMA
    loads (the async proxy) to see what the acquire made visible. Bounded and reported as
    wait_flag: a chunk given up on in this call is not waited for again."""
    given_up = tl.load(timeouts_ptr + chunk, volatile=True) == epoch
    limit = tl.where(needed & (given_up == 0), SPIN_LIMIT, 0)
    value, row = tl.inline_asm_elementwise(
        """{
        .reg .pred %p;
        .reg .b32 %polls, %gap;
        mov.b32 $1, $5;
        mov.b32 $0, $3;
        mov.u32 %polls, 0;
        setp.eq.s32 %p, $4, 0;
        @%p bra DONE_${:uid};
        WAIT_${:uid}:
        ld.acquire.sys.global.b32 $0, [$2];
        sub.s32 %gap, $0, $3;
        setp.ge.s32 %p, %gap, 0;
        @%p bra FENCE_${:uid};
        setp.ge.s32 %p, %polls, $4;
        @%p bra FENCE_${:uid};
        add.s32 %polls, %polls, 1;
        bra WAIT_${:uid};
        FENCE_${:uid}:
        fence.proxy.async.global;
        DONE_${:uid}:
        }""",
        "=r,=r,l,r,r,r",
        [flags_ptr + chunk, epoch, limit, row],
        dtype=(tl.int32, tl.int32),
        is_pure=False,
        pack=1,
    )
    if _behind(value, epoch):
        tl.atomic_xchg(timeouts_ptr + chunk, epoch, sem="relaxed", scope="gpu")
    return row
