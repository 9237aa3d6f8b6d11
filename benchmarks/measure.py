"""Helpers the tools share: the slowest rank's value, a relative error, interleaved timing, and
overlap's op calls counted."""

import collections
import contextlib
import random
import statistics
import time

import torch
import torch.distributed as dist


def slowest(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks of the default group (``value`` itself without
    one: a one-GPU tool)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def time_interleaved(runners: dict, device, rounds: int, calls: int, warmup: int, settle: int = 0) -> tuple[dict, dict]:
    """Times every runner (key -> function of no arguments) in shuffled, interleaved rounds of
    ``calls`` back-to-back calls, ranks in step (a barrier before each, in a process group).
    Returns ({key: µs per call}, {key: host µs to queue one call}), each the median over rounds
    of the slowest rank: interleaving keeps the machine's drift out of the comparison, and a
    host time near the call's time means the GPU waits for the host. The host time is the
    round's first call's, which starts on an idle GPU: later calls of a round whose GPU time
    exceeds its host time wait for room in the launch queue, and would count the GPU's time as
    the host's. ``settle`` untimed calls open each round: what a runner's steady state is when
    it runs alone (a training process runs one model), where another runner's round just left
    the caching allocator's blocks elsewhere."""
    samples = {key: [] for key in runners}
    order = list(runners)
    shuffle = random.Random(0)  # the same order on every rank
    for round_ in range(warmup + rounds):
        shuffle.shuffle(order)
        for key in order:
            for _ in range(settle):
                runners[key]()
            torch.cuda.synchronize(device)
            if dist.is_initialized():
                dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            issued = time.perf_counter()
            runners[key]()
            issued = time.perf_counter() - issued
            for _ in range(calls - 1):
                runners[key]()
            end.record()
            if round_ >= warmup:
                samples[key].append((start, end, issued))
    torch.cuda.synchronize(device)
    us = {key: slowest(statistics.median(s.elapsed_time(e) * 1e3 / calls for s, e, _ in runs), device) for key, runs in samples.items()}
    host_us = {key: slowest(statistics.median(h * 1e6 for _, _, h in runs), device) for key, runs in samples.items()}
    return us, host_us


OVERLAP_OPS = (
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_reduce_scatter_tail", "all_gather_scaled_matmul",
    "scaled_matmul_reduce_scatter", "all_reduce",
)  # fmt: skip


def add_settle_argument(parser) -> None:
    """--settle, the tools' ``settle`` of time_interleaved."""
    parser.add_argument(
        "--settle", type=int, default=2,
        help="untimed calls opening each round: after another compiler's round the activations land at new "
        "addresses, where overlap's per-call CUDA graphs are captured again (one eager call, one capture)",
    )  # fmt: skip


def op_calls_since(before: dict) -> dict:
    """This rank's overlap op calls by path (lowering/replay.py: eager, captured, replayed) since
    ``before``, a copy of replay.stats taken earlier."""
    from overlap_pass.lowering import replay

    return {k: v - before.get(k, 0) for k, v in replay.stats.items()}


@contextlib.contextmanager
def overlap_op_calls(also: tuple = ()):
    """While open, counts each overlap op call made on CUDA tensors (dispatch's entry points,
    which matmul_ops.py's CUDA kernels look up again while it is open) and the dispatch functions named
    in ``also``; the Counter yielded holds them by name, and under "host s" the host time spent
    in the ops."""
    from overlap_pass.ops import registry
    from overlap_pass.lowering import dispatch

    counts, real = collections.Counter(), {name: getattr(dispatch, name) for name in (*OVERLAP_OPS, *also)}

    def counting(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            if name not in OVERLAP_OPS:
                return real[name](*args, **kwargs)
            begin = time.perf_counter()
            try:
                return real[name](*args, **kwargs)
            finally:
                counts["host s"] += time.perf_counter() - begin

        return counted

    try:
        for name in real:
            setattr(dispatch, name, counting(name))
        registry.look_up_entry_points_again()  # (the ops' CUDA kernels keep what they looked up)
        yield counts
    finally:
        for name, function in real.items():
            setattr(dispatch, name, function)
        registry.look_up_entry_points_again()


if __name__ == "__main__":  # a module the tools import, not a tool: --help says what it is
    print(__doc__)
