"""The emulated peers' kernels: one program each, on the emulation's own stream, timed by the
GPU's global timer (ns) so that a peer's signal lands at the time timeline.py gives it whatever
the launch gaps between them.

Each kernel is compiled once, unspecialized (one binary whatever its arguments), and loaded by
``preload`` when the world starts: CUDA loads a kernel's module at its first launch, and a load
may wait for the GPU to go idle, so a first launch of a peer's kernel that rank 0's spinning
kernel waits for would hold the host until that kernel gave up.

A workspace's clock is three int64 words: ENTER (rank 0 reached the call's barrier), READY (the
data of the push being emulated was ready) and LANDED (when the last mirrored push landed;
the barrier's release before the first). Every wait is bounded: a flag that never comes (rank 0
gave up on the call) writes the call's epoch into ``timeouts[peer]`` and the kernel goes on; a
deadline is never more than the call's own times away.
"""

import triton
import triton.language as tl

from overlap_pass.templates.launch import DirectKernel

ENTER, READY, LANDED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
CLOCK_WORDS = 3
# a stamp closer than this to the last landing is taken as that landing: the emulation's stream
# reached the push right after the previous one (the launch gap is not the peer's)
SLACK_NS = tl.constexpr(4_000)
POLL_LIMIT = tl.constexpr(2**31 - 1)


def unspecialized(ints: tuple, pointers: tuple = ()):
    """triton.jit compiling one binary whatever the values of ``ints`` and the alignment of
    ``pointers`` (so that one load at the world's start covers every launch)."""
    return triton.jit(do_not_specialize=ints, do_not_specialize_on_alignment=pointers)


def ns(us: float) -> int:
    """µs as the kernels' int ns."""
    return int(us * 1000)


@triton.jit
def _now():
    """The global timer, ns (the program id: an operand the asm needs, unused)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _wait_until(deadline):
    t = _now()
    polls = 0
    while (t < deadline) & (polls < POLL_LIMIT):
        t = _now()
        polls += 1


@triton.jit
def _signal(flag_ptr, count, stride, value):
    for i in range(count):
        tl.atomic_xchg(flag_ptr + i * stride, value, sem="release", scope="sys")


@unspecialized(("world_size", "delay_ns"), ("clock_ptr", "peer_epoch_ptr", "pad_ptr"))
def peers_enter_kernel(clock_ptr, peer_epoch_ptr, pad_ptr, world_size, delay_ns):
    """The peers reach the barrier ``delay_ns`` after rank 0 does: their epoch advances and each
    peer p sets word p of rank 0's pad (release). The barrier's release, then, is the first
    landing."""
    start = _now()
    tl.store(clock_ptr + ENTER, start)
    _wait_until(start + delay_ns)
    epoch = tl.load(peer_epoch_ptr) + 1
    tl.store(peer_epoch_ptr, epoch)
    for peer in range(1, world_size):
        tl.atomic_xchg(pad_ptr + peer, epoch, sem="release", scope="sys")
    tl.store(clock_ptr + LANDED, start + delay_ns)


@triton.jit
def _behind(value, epoch):
    return (value - epoch) < 0


@unspecialized(
    ("flag_count", "flag_stride", "peer", "spin_limit"), ("clock_ptr", "flag_ptr", "epoch_ptr", "timeouts_ptr")
)
def ready_kernel(clock_ptr, flag_ptr, flag_count, flag_stride, epoch_ptr, timeouts_ptr, peer, spin_limit):
    """READY = now, once rank 0's words ``flag_ptr[i * flag_stride]`` (i < ``flag_count``, none
    for a push rank 0's host queued) reach the call's epoch (``spin_limit`` polls each at most;
    one that gives up writes the epoch into ``timeouts[peer]``): the data of rank 0's push that the
    mirrored push copies is there. A stamp within SLACK_NS of the last landing is that landing."""
    epoch = tl.load(epoch_ptr)
    for i in range(flag_count):
        value = tl.atomic_add(flag_ptr + i * flag_stride, 0, sem="acquire", scope="sys")
        polls = 0
        while _behind(value, epoch) & (polls < spin_limit):
            value = tl.atomic_add(flag_ptr + i * flag_stride, 0, sem="acquire", scope="sys")
            polls += 1
        if _behind(value, epoch):
            tl.atomic_xchg(timeouts_ptr + peer, epoch, sem="relaxed", scope="gpu")
    now = _now()
    landed = tl.load(clock_ptr + LANDED)
    tl.store(clock_ptr + READY, tl.where(now - landed < SLACK_NS, landed, now))


@unspecialized(("flag_count", "flag_stride", "a_ns", "b_ns"), ("clock_ptr", "flag_ptr", "peer_epoch_ptr"))
def arrive_kernel(clock_ptr, flag_ptr, flag_count, flag_stride, peer_epoch_ptr, a_ns, b_ns):
    """A mirrored push lands: at max(READY + a, LANDED + b) (timeline.arrivals) its words
    ``flag_ptr[i * flag_stride]`` of rank 0 take the peers' epoch (release: the data copied
    before this kernel, on this stream, is seen with them)."""
    landed = tl.maximum(tl.load(clock_ptr + READY) + a_ns, tl.load(clock_ptr + LANDED) + b_ns)
    _wait_until(landed)
    _signal(flag_ptr, flag_count, flag_stride, tl.load(peer_epoch_ptr))
    tl.store(clock_ptr + LANDED, landed)


@unspecialized(("slot",), ("stamps_ptr",))
def stamp_kernel(stamps_ptr, slot):
    """stamps[slot] = now: the start of a paced copy (async TP's pulls, asynctp.py)."""
    tl.store(stamps_ptr + slot, _now())


@unspecialized(("slot", "duration_ns"), ("stamps_ptr",))
def wait_since_kernel(stamps_ptr, slot, duration_ns):
    """Holds the stream until ``duration_ns`` after stamps[slot]."""
    _wait_until(tl.load(stamps_ptr + slot) + duration_ns)


@unspecialized(("duration_ns",))
def delay_kernel(duration_ns):
    """Holds the stream for ``duration_ns`` (a barrier whose peers arrive that much later)."""
    _wait_until(_now() + duration_ns)


PEERS_ENTER = DirectKernel(peers_enter_kernel)
READY_KERNEL = DirectKernel(ready_kernel)
ARRIVE = DirectKernel(arrive_kernel)
STAMP = DirectKernel(stamp_kernel)
WAIT_SINCE = DirectKernel(wait_since_kernel)
DELAY = DirectKernel(delay_kernel)


def preload(device) -> None:
    """Compiles and loads every kernel above by a launch that changes nothing but scratch words,
    then waits for them (module docstring)."""
    import torch

    words = torch.zeros(8, dtype=torch.int64, device=device)
    flags = torch.zeros(8, dtype=torch.int32, device=device)
    PEERS_ENTER[(1,)](words, flags, flags, 1, 0, num_warps=1)
    READY_KERNEL[(1,)](words, flags, 0, 1, flags, flags, 0, 1, num_warps=1)
    ARRIVE[(1,)](words, flags, 0, 1, flags, 0, 0, num_warps=1)
    STAMP[(1,)](words, 0, num_warps=1)
    WAIT_SINCE[(1,)](words, 0, 0, num_warps=1)
    DELAY[(1,)](0, num_warps=1)
    torch.cuda.synchronize(device)
