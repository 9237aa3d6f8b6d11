"""Bodies of the variant fallback tests; each runs on every rank of a gloo RankPool.

The float8 all-gather's CUDA dispatch (lowering/dispatch.py) runs on CPU tensors here, its
variants replaced by stand-ins that need no GPU: a Gluon-named one that raises a Triton
CompilationError (what a kernel this triton cannot compile raises at its first launch) on the
ranks told to, else computes the result; a working "copy_engine_cublas"; the real NCCL+cuBLAS
baseline (on gloo). The stand-ins compute without communicating (every rank builds every shard
from its seed), so a rank whose stand-in fails cannot leave a peer waiting. Timing is faked
(choose._time: the Gluon variant would be fastest), everything else is choose.py's own: the
first calls, the agreement over ranks, the forced and cached paths, the log.
"""

import ast
import contextlib
import functools
import logging
import time

import pytest
import torch
import torch.distributed as dist
from triton.compiler.errors import CompilationError

from overlap_pass import config

from overlap_pass.ops import scaled_ops
from overlap_pass.lowering import choose, dispatch, scaled

GLUON = "fused:gluon_pingpong128x128x128s6g4"
COPY_ENGINE = "copy_engine_cublas"
FAKE_US = {GLUON: 50.0, COPY_ENGINE: 80.0, choose.BASELINE: 100.0}  # the Gluon variant fastest
ROWS, K, N = 32, 64, 48
_SOURCE = "gl.warp_specialize([(consumer, args), (loader, args)], [1], [40])"
COMPILE_ERROR = "async_copy_global_to_shared has been removed; call async_load instead"


def compile_error() -> CompilationError:
    """As Triton raises it: the kernel's source excerpt, then what went wrong."""
    return CompilationError(_SOURCE, ast.parse(_SOURCE).body[0], COMPILE_ERROR)


def _shard(rank: int, seed: int, rows: int):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(rows, K, generator=gen) * 0.5).to(torch.float8_e4m3fn)


def _problem(seed: int, rows: int):
    """This rank's float8 shard with a tensorwise scale, a [K, N] weight (an [N, K] linear's,
    transposed) with its scale: the same weight on every rank."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn).t()
    return _shard(dist.get_rank(), seed, rows), torch.tensor(0.5), weight, torch.tensor(0.25)


def _args(seed: int, rows: int) -> tuple:
    shard, scale, weight, weight_scale = _problem(seed, rows)
    world = dist.get_world_size()
    return (shard, scale, [weight], [weight_scale], [None], 0, world, dist.group.WORLD.group_name, torch.bfloat16)


_SEED = [0]  # the seed of the call being made: a stand-in rebuilds the peers' shards from it


def _local_result(*args, **kwargs):
    """The op's result without communication: every shard rebuilt from the call's seed."""
    shard, scale, mat2s, mat2_scales, biases = args[:5]
    gathered = torch.cat([_shard(r, _SEED[0], shard.shape[0]) for r in range(dist.get_world_size())])
    out = scaled_ops.scaled_mm_rows(gathered, scale, mat2s[0], mat2_scales[0], biases[0], torch.bfloat16, False)
    return None, [out], []


def _gluon_stand_in(failing_ranks, *args, **kwargs):
    if dist.get_rank() in failing_ranks:
        raise compile_error()
    return _local_result(*args, **kwargs)


def _variants(failing_ranks) -> dict:
    return {
        GLUON: functools.partial(_gluon_stand_in, failing_ranks),
        COPY_ENGINE: _local_result,
        choose.BASELINE: scaled.all_gather_nccl_scaled_mm,
    }


def _fake_time(runs: dict, names: list, group, device) -> dict:
    return {n: FAKE_US[n] if n in runs else float("inf") for n in names}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)  # what is told; DEBUG traces first calls
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _dispatch_on_cpu(failing_ranks, cache_path: str, **patches):
    """dispatch's CUDA path on CPU tensors with the stand-in variants, this process's choices
    forgotten (and restored after), the overlap log collected."""
    remembered = (
        choose.CHOICES, choose._DECIDED, choose._PREDICTED, choose._UNMEASURED, choose._TOLD, choose._TRIALS,
        dispatch._RESOLVED, dispatch._WARMED, dispatch._TRIED,
    )  # fmt: skip
    saved = [type(table)(table) for table in remembered]
    for table in remembered:
        table.clear()
    records = _Records()
    logger = logging.getLogger("overlap_pass")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    patches.setdefault("fused_from_call", 1)  # the choice from a signature's first call
    patches.setdefault("measure_over_calls", False)  # measured at once: over_calls tests the other
    try:
        with pytest.MonkeyPatch.context() as mp, config.patch(choice_cache=cache_path, **patches):
            mp.setattr(dispatch, "_symmetric_memory_usable", lambda group: True)
            mp.setattr(dispatch, "variant_calls", lambda kind, fast_key, variants: dict(variants))
            mp.setattr(scaled, "variants", lambda kind, num_inputs=1: _variants(failing_ranks))
            mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
            mp.setattr(choose, "_time", _fake_time)
            yield mp, records.messages
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        for table, before in zip(remembered, saved):
            table.clear()
            table.update(before)


def _call(seed: int, rows: int):
    _SEED[0] = seed
    result = dispatch.all_gather_scaled_matmul(*_args(seed, rows))
    expected = scaled_ops.all_gather_scaled_matmul_reference(*_args(seed, rows))
    return (result[1][0].float() - expected[1][0].float()).abs().max().item()


def _chosen() -> list[str]:
    return sorted({name for (_, key), name in choose._DECIDED.items() if " | forced " not in key})


def fallback(scenario: str, cache_path: str, seed: int = 0) -> dict:
    """Two calls of one shape (new values each), two of another, in ``scenario``:
    - "measured": the Gluon stand-in fails to compile on every rank at the first call;
    - "one_rank": it fails on rank 1 only;
    - "forced": config.implementation="fused" names it (the first fused variant);
    - "cached": the cache file names it as the choice of the first shape;
    - "captured": compiles, but cannot be captured in a CUDA graph (the choice timed as
      replays, as under reduce-overhead).
    Returns what each rank chose, its log and the largest error against the reference."""
    failing = {"one_rank": {1}, "captured": set()}.get(scenario, {0, 1})
    # a forced variant runs from a signature's first call, whatever config.fused_from_call says
    patches = {"implementation": "fused", "fused_from_call": 3} if scenario == "forced" else {}
    patches["measure_bucket_after"] = 1  # each shape's bucket measured at its first call
    with _dispatch_on_cpu(failing, cache_path, **patches) as (mp, messages):
        if scenario == "cached" and dist.get_rank() == 0:
            shard, scale, weight, weight_scale = _problem(seed, ROWS)
            shapes = dispatch.all_gather_scaled_matmul_shapes(
                shard, scale, [weight], [weight_scale], [None], 0, torch.bfloat16, False
            )
            key = choose.shape_key(scaled.AG_KIND, dist.get_world_size(), shapes, shard.dtype)
            choose._store(key, {"choice": GLUON, "times_us": dict(FAKE_US)})
        if scenario == "captured":
            mp.setattr(choose, "replays_graphs", lambda device: True)

            def captured(variant, args):
                if getattr(variant, "func", None) is _gluon_stand_in:
                    raise RuntimeError("operation not permitted when stream is capturing")
                return functools.partial(choose._calls, variant, args)

            mp.setattr(choose, "_captured", captured)
        dist.barrier()
        # the second shape two token buckets away from the first: measured too (choose.py)
        errors = [_call(s, rows) for s, rows in ((seed, ROWS), (seed + 1, ROWS)) + ((seed + 2, 4 * ROWS),) * 2]
        chosen, cached = _chosen(), choose.load_cache()
    return {"chosen": chosen, "log": messages, "error": max(errors), "cache": cached}


def changing_rows(
    cache_path: str, rows: list[int], refused: int, kept: int, measure_after: int = 1, fused_from: int = 1,
    graphs_wait: bool = False,
) -> dict:  # fmt: skip
    """Calls at each of ``rows`` (a new seed each), the Gluon stand-in refusing the calls of
    ``refused`` rows (NotImplementedError, as a variant refuses operands it cannot take), at
    most ``kept`` call signatures kept, a far bucket measured at its ``measure_after``-th
    distinct count, a signature's chosen variant run from its ``fused_from``-th call (from its
    first where ``graphs_wait``: a graph that runs plain Inductor's at a count's first calls
    exists, new_counts.py). Returns
    the choice per token bucket (measured, or predicted from a neighbour), the rows of each
    measurement, the variant each call ran, and the largest error."""
    ran, measured = [], []
    patches = {"shapes_kept": kept, "measure_bucket_after": measure_after, "fused_from_call": fused_from}
    with _dispatch_on_cpu(set(), cache_path, **patches) as (mp, messages):
        mp.setattr(scaled, "variants", _recording_variants(ran, refused, set()))
        mp.setattr(dispatch, "first_calls_on_nccl", not graphs_wait)
        real_measure = choose._measure
        mp.setattr(choose, "_measure", lambda *a, **k: measured.append(a[1][0].shape[0]) or real_measure(*a, **k))
        dist.barrier()
        errors, last_ran = [], []
        for seed, count in enumerate(rows):
            del ran[:]
            errors.append(_call(seed, count))
            last_ran.append(ran[-1])

        def bucket(key: str) -> int:
            return int(key.split("tokens=")[1].split(" ")[0])

        chosen = {bucket(k): v for (_, k), v in choose._DECIDED.items()}
        predicted = {bucket(k): v for (_, k), v in choose._PREDICTED.items()}
        kept_now = len(dispatch._RESOLVED)
    return {
        "chosen": chosen, "predicted": predicted, "measured": measured, "ran": last_ran, "error": max(errors),
        "kept": kept_now, "log": messages,
    }  # fmt: skip


def _recording_variants(ran: list, refused: int, failing_ranks):
    """scaled.variants with the stand-ins, each call's variant name appended to ``ran``; the
    Gluon stand-in refuses calls of ``refused`` rows (NotImplementedError, as a variant refuses
    operands it cannot take) and fails to compile on ``failing_ranks``."""

    def recorded(name, variant):
        def run(*args, **kwargs):
            ran.append(name)
            return variant(*args, **kwargs)

        return run

    def refusing(*args, **kwargs):
        if args[0].shape[0] == refused:
            raise NotImplementedError(f"{refused} rows (stand-in)")
        return _gluon_stand_in(failing_ranks, *args, **kwargs)

    def variants(kind, num_inputs=1):
        return {n: recorded(n, v) for n, v in {**_variants(set()), GLUON: refusing}.items()}

    return variants


def over_calls(cache_path: str, rows: list[int], refused: int, failing_ranks) -> dict:
    """Calls at each of ``rows`` (one token bucket; a new seed each) with the choice measured
    over the calls (config.measure_over_calls), the Gluon stand-in refusing ``refused`` rows
    and failing to compile on ``failing_ranks``. Timing is faked (the samples' medians are
    FAKE_US), the trial's steps are choose.py's own. Returns the variants each call ran, the
    timed samples per variant, the choice and its source, and the largest error."""
    ran, samples = [], {}

    def fake_trial_times(timed: dict) -> dict:
        samples.update({n: len(s) for n, s in timed.items()})
        return {n: FAKE_US[n] for n in timed}

    with _dispatch_on_cpu(failing_ranks, cache_path, measure_over_calls=True) as (mp, messages):
        mp.setattr(scaled, "variants", _recording_variants(ran, refused, failing_ranks))
        mp.setattr(choose, "_measure", lambda *a, **k: pytest.fail("measured at once"))
        mp.setattr(choose, "_trial_times", fake_trial_times)
        mp.setattr(torch.cuda, "Event", _WallClockEvent)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)
        dist.barrier()
        errors, per_call = [], []
        for seed, count in enumerate(rows):
            del ran[:]
            errors.append(_call(seed, count))
            per_call.append(list(ran))
        (chosen,) = choose._DECIDED.values()
        source = dict(choose.CHOICES)
        left = {"trials_left": len(choose._TRIALS), "signatures_of_trials_left": len(dispatch._TRIED)}
    return {
        "ran": per_call, "samples": samples, "chosen": chosen, "choices": source, "error": max(errors),
        "log": messages, **left,
    }  # fmt: skip


class _WallClockEvent:
    """torch.cuda.Event's timing on CPU: the host's clock at record()."""

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3


def a_variant_raising_while_timed() -> dict:
    """choose._time over CPU stand-ins: "flaky" raises at its third sample on rank 1 only (a
    ChunkTimeout told late). Returns the times and how many samples of "flaky" each rank ran."""
    from overlap_pass.lowering.symm import ChunkTimeout

    rank, samples = dist.get_rank(), []

    def flaky():
        samples.append(1)
        if rank == 1 and len(samples) == 3:
            raise ChunkTimeout("matmul_reduce_scatter: rank 1 gave up waiting (stand-in)")

    runs = {choose.BASELINE: lambda: None, "flaky": flaky, "steady": lambda: None}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "Event", _WallClockEvent)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)
        times = choose._time(runs, [*runs, "absent"], dist.group.WORLD, torch.device("cpu"))
    return {"times": times, "flaky_samples": len(samples)}
