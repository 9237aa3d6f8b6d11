"""Device-side protocol helpers: wait for a chunk's progress flag.

Flags are uint32 words that a producer (the copy engine's stream write, or a kernel) sets to the
call's epoch once a chunk has landed; epochs only grow, so flags are never reset. Every wait is
bounded: after ``spin_limit`` polls it records the chunk it gave up on, so the host can name the
rank and chunk instead of hanging the GPU.
"""

import triton
import triton.language as tl


@triton.jit
def wait_flag(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT: tl.constexpr):
    """wait(flags[chunk] >= epoch, scope=sys, sem=acquire), at most SPIN_LIMIT polls.

    An acquire read (atomic add of 0), so that every load after it sees the chunk's
    data; on giving up, timeouts[chunk] = 1 (relaxed) and the caller goes on."""
    polls = 0
    value = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
    while (value.to(tl.int64) < epoch) & (polls < SPIN_LIMIT):
        value = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
        polls += 1
    if value.to(tl.int64) < epoch:
        tl.atomic_xchg(timeouts_ptr + chunk, 1, sem="relaxed", scope="gpu")
