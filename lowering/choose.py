"""Which variant an op runs for a shape: measured on its calls, identical on every rank,
cached in memory and on disk.

The first call of a shape runs every variant on the call's own inputs, interleaved (rounds of
SAMPLE_CALLS calls each, in a shuffled order, so drift hits all variants alike; each sample
starts with the GPU idle, so a variant's host time counts where it exceeds its GPU time). With
config.measure_over_calls the same samples ride on the shape's calls instead, one per call
(Trial): no call stalls on timing them all. Either way a variant whose outputs differ from
NCCL + cuBLAS's beyond rounding, or that raises, on any rank, is out on every rank. Times are
reduced to the slowest rank's, rank 0 picks the fastest and broadcasts its name, so every rank
runs the same variant: the baseline is always a candidate, so the pick is never slower than it,
as measured.
The choice is written to ``config.choice_cache`` (rank 0), read back by later runs (rank 0 reads
and broadcasts), and shown in decisions.json by the pass when the cache already knows the shape.
A choice that is not measured now (one config.implementation forces, or one read from the cache)
runs this call once first: where it raises on any rank (a kernel this triton cannot compile) it
is out on every rank and the shape is measured among the rest, the baseline always among them.
Why a variant is out is logged once per variant and reason, not at every shape.
An entry counts only where its times name exactly the variants of this run: an overlap that has
added or dropped a variant since measures the shape again, as does one whose VARIANTS_REVISION
(in every key) differs: a variant that now takes calls it refused, or runs a new kernel.

Shapes that change (dynamic shapes): a key files the rows (the shard's, or the scattered
inputs') under their power-of-two bucket (token_bucket). A bucket is measured once (a trial's
steps fall on calls at any of its token counts, one bucket of an op at a time); a later call at
another count of the same bucket, or of a bucket next to a measured one, runs that choice with
no measurement and no collective (where the variant refuses the count:
NotImplementedError, or a kernel that does not compile for it, the same on every rank, NCCL +
cuBLAS runs that count, lowering/dispatch.py). A bucket far from every measured one (and not in
the cache file) runs the nearest measured bucket's choice at its first distinct token counts, and
is measured at its config.measure_bucket_after-th: a count met once never stalls its step on a
measurement, a bucket that recurs gets a choice of its own (once per bucket, and once per
machine with the cache file).

Samples run the calls as the model will: through dispatch's wrappers, so calls that replay
per-call CUDA graphs (replay.py) are timed replaying them. A first call made while CUDA graph
trees warm a model up (mode="reduce-overhead") times each variant's calls replayed from a CUDA
graph of the whole sample instead, since that is how they will run: host time does not count
there, and such choices are cached under a key of their own (" | cudagraphs").
"""

import collections
import functools
import json
import logging
import os
import random
import re
import statistics
import time

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.templates.launch import compiling_ahead

from overlap_pass import torch_compat
from . import symm

log = logging.getLogger("overlap_pass")

BASELINE = "nccl_cublas"
# bumped where the same variant names run anew (to 18 when the Gluon producer took exact
# accumulation and sums and the cuBLAS variants the rowwise exact kernel), so cached choices measure again
VARIANTS_REVISION = 18
GRAPHS_KEY = " | cudagraphs"  # appended to the key of a choice timed as CUDA graph replays
ROUNDS = 10
WARMUP = 2
# back-to-back calls per sample, each sample started on an idle GPU, so that a variant's host
# time counts where it exceeds its GPU time (with fewer calls, or with the GPU still busy with
# the previous sample, the GPU's queue hides the host time, and a variant with several times
# NCCL's host time per call can time faster than NCCL, be picked and slow the model down)
SAMPLE_CALLS = 8

# (key string) -> {"choice": name, "times_us": {...}}: the choices of this process
CHOICES: dict[str, dict] = {}
# (group name, key) -> name: what each group decided, collectively (a rank in two groups with the
# same shapes must not skip a measurement its peers in the other group run)
_DECIDED: dict[tuple[str, str], str] = {}
# (group name, key) -> name: a token bucket's choice taken from a measured bucket next to it
_PREDICTED: dict[tuple[str, str], str] = {}
# (group name, key) -> distinct token counts of a bucket far from the measured ones that ran the
# nearest one's choice so far (config.measure_bucket_after)
_UNMEASURED: dict[tuple[str, str], int] = {}
# "trial steps": the calls that ran a step of a trial (Trial.call) since the process started (tools)
stats: collections.Counter = collections.Counter()
# (variant, reason) pairs logged: a variant out for one reason at every shape (a kernel this
# triton cannot compile) is told once, not at each shape's first call
_TOLD: set[tuple[str, str]] = set()


@functools.cache
def _platform() -> list[str]:
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return [device, f"torch {torch.__version__}", f"triton {triton.__version__}"]


def token_bucket(size: int) -> int:
    """The bucket of a call's token count (its rows), which a choice is filed under: the next
    power of two. Token counts that change from call to call (dynamic shapes) then share a
    measurement with their bucket rather than each measuring anew."""
    return symm.next_power_of_two(size)


_TOKENS = re.compile(r"tokens=(\d+)")


def neighbour_keys(key: str) -> list[str]:
    """The keys of the buckets either side of ``key``'s (half and twice its token count)."""
    found = _TOKENS.search(key)
    if found is None:
        return []
    tokens = int(found.group(1))
    return [_TOKENS.sub(f"tokens={t}", key, count=1) for t in (tokens // 2, tokens * 2) if t >= 1]


def _bucketless(key: str) -> str:
    """``key`` with its token bucket left out: what the keys of one op's buckets share."""
    return _TOKENS.sub("tokens=*", key, count=1)


def _sibling_on_trial(group_name: str, key: str) -> bool:
    """Whether another token bucket of ``key``'s op is being measured over calls (a Trial)."""
    pattern = _bucketless(key)
    return any(group == group_name and other != key and _bucketless(other) == pattern for group, other in _TRIALS)


def _nearest_measured(group_name: str, key: str) -> tuple[int, str, str] | None:
    """(doublings apart, choice, key) of the decided token bucket nearest ``key``'s (the
    smaller at a tie) among the keys that differ from it in the bucket alone, if any: the same
    on every rank, as decisions are collective."""
    found = _TOKENS.search(key)
    if found is None:
        return None
    tokens, pattern = int(found.group(1)), _bucketless(key)
    candidates = []
    for (group, other), name in _DECIDED.items():
        match = _TOKENS.search(other)
        if group == group_name and match and _bucketless(other) == pattern:
            other_tokens = int(match.group(1))
            candidates.append((abs(other_tokens.bit_length() - tokens.bit_length()), other_tokens, name, other))
    if not candidates:
        return None
    apart, _, name, other = min(candidates)
    return apart, name, other


def shape_key(kind: str, world_size: int, shapes: dict, dtype: torch.dtype) -> str:
    """The cache key of a call: the op kind, device, versions, world size, shapes and dtype."""
    parts = [kind, *_platform(), f"variants r{VARIANTS_REVISION}", f"W{world_size}"]
    parts += [f"{name}={value}" for name, value in sorted(shapes.items())]
    parts.append(str(dtype).replace("torch.", ""))
    return " | ".join(parts)


def _cache_path() -> str:
    return os.path.expanduser(config.choice_cache)


def load_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(v, dict) and isinstance(v.get("choice"), str)}


def cached_choice(key: str, names: list[str]) -> str | None:
    """The choice for ``key`` made in this process, or found in the cache file among the
    variants ``names`` (as a first call would take it), if any."""
    if key in CHOICES:
        return CHOICES[key]["choice"]
    return _chosen_among(load_cache().get(key), names)


def _cached_among(keys: list[str], names: list[str]) -> str | None:
    """The cache file's choice for the first of ``keys`` it holds among ``names``."""
    table = load_cache()
    for key in keys:
        found = _chosen_among(table.get(key), names)
        if found is not None:
            return found
    return None


def _chosen_among(entry: dict | None, names: list[str]) -> str | None:
    """A cached entry's choice if its times name exactly the variants ``names`` (every variant
    measured gets a time, inf where it was out), else None."""
    measured = entry.get("times_us") if entry else None
    if not isinstance(measured, dict) or set(measured) != set(names):
        return None
    return entry["choice"]


def _store(key: str, entry: dict) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        table = load_cache()
        table[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("overlap: could not write the choice cache %s: %s", path, e)


def replays_graphs(device) -> bool:
    """Whether this call is the warm-up of a model that CUDA graph trees will replay
    (torch.compile's reduce-overhead mode): its ops will then cost no host time, so their
    variants are timed as replayed graphs and chosen apart from eager calls'."""
    try:
        return torch_compat.graph_trees_warming_up(device.index)
    except Exception:  # internals of torch that may move: time eager calls, as without graphs
        return False


def _broadcast_name(name: str | None, names: list[str], group, device) -> str | None:
    """Rank 0's pick (a name from ``names``, or None) on every rank."""
    index = torch.tensor([names.index(name) if name in names else -1], device=device)
    dist.broadcast(index, group=group, group_src=0)
    value = int(index.item())
    return names[value] if value >= 0 else None


# elements per piece a comparison reads at a time: a first call runs while a model's
# activations are live, and whole fp32 copies of its outputs (the gate and up projections' at
# 8B sizes), with the baseline's outputs kept through the timing, would raise the peak memory
# of a model's first step by hundreds of MiB
CLOSE_PIECE = 1 << 22


def _close(out, ref) -> bool:
    """Whether ``out`` is finite and within 2% of ``ref`` (relative norm of the difference),
    read in pieces of CLOSE_PIECE elements: no full-size temporaries."""
    out, ref = out.reshape(-1), ref.reshape(-1)
    diff = torch.zeros((), dtype=torch.float64, device=out.device)
    norm = torch.zeros((), dtype=torch.float64, device=out.device)
    finite = torch.ones((), dtype=torch.bool, device=out.device)
    for start in range(0, out.numel(), CLOSE_PIECE):
        got, want = out[start : start + CLOSE_PIECE].float(), ref[start : start + CLOSE_PIECE].float()
        finite &= torch.isfinite(got).all()
        diff += (got - want).square().sum(dtype=torch.float64)
        norm += want.square().sum(dtype=torch.float64)
    if not finite.item():
        return False
    return (diff.sqrt() / norm.sqrt().clamp_min(1e-12)).item() < 2e-2


def _outputs(result) -> list[torch.Tensor]:
    """The tensors a variant computed: an all-gather's outputs (and a float8 one's passengers),
    or the one output."""
    return [t for part in result[1:] for t in part] if isinstance(result, tuple) else [result]


def _calls(variant, args: tuple):
    """A sample: SAMPLE_CALLS calls, each one's outputs dropped before the next, as a model's
    steps drop theirs (so the allocator hands the same addresses out again, and calls that
    replay per-call graphs do so here too); the last call's result."""
    result = None
    for _ in range(SAMPLE_CALLS):
        result = None
        result = variant(*args)
    return result


def _captured(variant, args: tuple):
    """SAMPLE_CALLS calls of ``variant`` captured into one CUDA graph: replaying it is a sample."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _calls(variant, args)
    return graph.replay


def failure(error: BaseException) -> str:
    """An exception as one line: its type and its message's last line (a Triton compile error
    ends in what went wrong, after an excerpt of the kernel's source), or for a CUDA error the
    line naming it (torch's debugging hints follow it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if line.startswith("CUDA error")]
    return f"{type(error).__name__}: {(named or lines or [''])[-1]}"


def tell_once(level: int, message: str, name: str, reason: str) -> None:
    """``message % (name, reason)`` in the log, once per variant and reason."""
    if (name, reason) not in _TOLD:
        _TOLD.add((name, reason))
        log.log(level, message, name, reason)


def tell_refused(name: str, error: BaseException) -> None:
    """Logs once that variant ``name`` refused a call's token count (NCCL + cuBLAS runs it)."""
    reason = f"this token count ({failure(error)}); NCCL + cuBLAS runs it"
    tell_once(logging.INFO, "overlap: variant %s does not take %s", name, reason)


def _in_step(group, device) -> None:
    """Returns on every rank of the group once all have reached it (the host waits, also on
    NCCL, whose collectives only queue): a variant's first call then starts on every rank at
    once, so a rank compiling its kernels does not leave a peer spinning on its flags the
    time of a compile (seconds: past a test's spin limit)."""
    mark = torch.zeros(1, device=device)
    dist.all_reduce(mark, group=group)
    mark.item()


def _first_call(name: str, variant, args: tuple, reference=None) -> bool:
    """Whether ``variant`` runs this call, with no wait giving up (and matches the
    ``reference`` outputs, if given); why not is logged once."""
    log.debug("overlap: first call of variant %s", name)
    try:
        outs = _outputs(variant(*args))
        if outs and outs[0].is_cuda:
            # a wait that gave up, told now: the variant is out on every rank at once, rather
            # than one rank raising at a later call while its peers go on to the next collective
            symm.check_all_timeouts(taking_calls_only=True)
    except NotImplementedError as e:  # refused before it started (these operands): expected
        tell_once(logging.INFO, "overlap: variant %s does not take this call: %s", name, failure(e))
        return False
    except Exception as e:  # a kernel that does not compile or fit: not a candidate
        tell_once(logging.WARNING, "overlap: variant %s failed: %s", name, failure(e))
        return False
    if reference is not None and not all(_close(o, r) for o, r in zip(outs, reference)):
        tell_once(logging.WARNING, "overlap: variant %s is out: %s", name, f"its outputs differ from {BASELINE}'s")
        return False
    return True


def _on_every_rank(ok: dict[str, bool], group, device) -> dict[str, bool]:
    """Each name's flag and-ed over the group's ranks, so that every rank keeps the same
    variants; one that ran here and failed on a peer is logged as such."""
    names = list(ok)
    agreed = torch.tensor([float(ok[n]) for n in names], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    everywhere = {n: bool(v) for n, v in zip(names, agreed.tolist())}
    for name in names:
        if ok[name] and not everywhere[name]:
            tell_once(logging.WARNING, "overlap: variant %s is out: %s", name, "it failed on another rank")
    return everywhere


def _first_calls(variants: dict, names, args: tuple, group, device, reference=None) -> dict[str, bool]:
    """Each name's first call, the ranks in step before each; a name is True where it ran on
    every rank of the group (collective)."""
    ok = {}
    for name in names:
        _in_step(group, device)
        ok[name] = _first_call(name, variants[name], args, reference)
    return _on_every_rank(ok, group, device)


def runs_everywhere(name: str, variants: dict, args: tuple, group, device) -> bool:
    """Whether ``name``'s first call on ``args`` runs on every rank of the group (collective):
    a choice that is not measured (forced, or from the cache file) is tried once before calls
    depend on it."""
    return _first_calls(variants, [name], args, group, device)[name]


def _measure(variants: dict, args: tuple, group, device, graphs: bool = False) -> dict[str, float]:
    """Per variant: the slowest rank's median time of one call, in µs (inf when out); with
    ``graphs``, of one call replayed in a CUDA graph (no host time)."""
    names = list(variants)
    reference = _outputs(variants[BASELINE](*args))
    # a variant is out for every rank if it is out for one, so that all time the same ones;
    # the first fused call's other configs compile on threads meanwhile (templates/launch.py)
    with compiling_ahead(config.compile_ahead):
        usable = _first_calls(variants, names, args, group, device, reference)
    del reference  # (timing compares nothing: its memory is the samples')
    runs = {n: functools.partial(_calls, variants[n], args) for n in names if usable[n]}
    captured = _capture_all(variants, runs, args, group, device) if graphs else {}
    if BASELINE in captured:  # (the same on every rank) else eager times, the baseline among them
        runs = captured
    elif graphs:
        log.warning("overlap: %s cannot be captured in a CUDA graph here; timing eager calls", BASELINE)
    return _time(runs, names, group, device)


def _time(runs: dict, names: list[str], group, device) -> dict[str, float]:
    """Per name: the slowest rank's median time of one call of its sample ``runs[name]`` (inf
    for a name not in ``runs``, or whose sample raised on any rank), in µs, over interleaved
    rounds. A sample that raises (a ChunkTimeout told late) drops its variant: every rank
    learns it before the next sample, which all ranks start together, so all make the same
    collectives and no rank runs that variant's protocol alone for long."""
    samples = {name: [] for name in runs}
    failed = set()
    order = list(names)
    shuffle = random.Random(0)  # the same order on every rank
    for round_ in range(WARMUP + ROUNDS):
        shuffle.shuffle(order)  # no variant always runs right after the same one
        for name in order:
            if name not in runs:
                continue
            torch.cuda.synchronize(device)  # idle, on every rank: host time is not hidden
            agreed = _on_every_rank({n: n not in failed for n in names}, group, device)  # (a barrier too)
            failed = {n for n, ok in agreed.items() if not ok}
            if name in failed:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                runs[name]()
            except Exception as e:
                tell_once(logging.WARNING, "overlap: variant %s is out: %s", name, f"it raised while timed: {failure(e)}")
                failed.add(name)
                continue
            end.record()
            if round_ >= WARMUP:
                samples[name].append((start, end))
    torch.cuda.synchronize(device)
    local = torch.tensor(
        [
            statistics.median(s.elapsed_time(e) * 1e3 / SAMPLE_CALLS for s, e in samples[n])
            if n in runs and n not in failed
            else float("inf")
            for n in names
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, local.tolist()))


def _capture_all(variants: dict, runs: dict, args: tuple, group, device) -> dict:
    """Each usable variant's calls captured once (replays then are the samples); a variant that
    cannot be captured on some rank is out on every rank."""
    graphs = {}
    for name in runs:
        try:
            graphs[name] = _captured(variants[name], args)
        except Exception as e:  # e.g. a variant whose first use of a shape allocates
            tell_once(logging.WARNING, "overlap: variant %s cannot be captured in a CUDA graph: %s", name, failure(e))
    captured = _on_every_rank({n: n in graphs for n in runs}, group, device)
    return {n: graphs[n] for n in runs if captured[n]}


# choose's answer while a trial runs the calls of a key: dispatch hands each call to trial_call
TRIAL = "trial"
# (group name, key) -> its measurement over calls, until decided
_TRIALS: dict[tuple[str, str], "Trial"] = {}


class ForNow(str):
    """choose's answer for this call alone (dispatch keeps no variant for its signature): a
    bucket whose op has another bucket on trial runs NCCL + cuBLAS meanwhile."""


class Trial:
    """A key's measurement spread over the op's calls (config.measure_over_calls): each call
    of the key runs one step of it on its own inputs and returns its own result, so no call
    stalls on timing every variant. The steps, the same on every rank (calls are collective):

    - a variant's first call: NCCL + cuBLAS computes the call's result and the variant runs
      beside it, compared with it; out on every rank where it raises or differs on one (the
      ranks meet before it: its kernels may take seconds to compile);
    - then rounds of the usable variants in a shuffled order, a call each: the call is a
      sample of that variant, as _time takes one (the ranks in step, the GPU idle, SAMPLE_CALLS
      calls on the call's inputs, the last one's result returned), the first WARMUP rounds
      untimed;
    - then the choice: each variant's median, the slowest rank's, rank 0's fastest (_pick)."""

    def __init__(self, names: list[str], candidates: list[str]):
        self.names = names
        self.untried = [n for n in candidates if n != BASELINE]
        self.usable = [BASELINE]
        self.samples: dict[str, list] = {n: [] for n in names}
        self.order: list[str] = []
        self.rounds = 0
        self.calls = 0
        self.shuffle = random.Random(0)  # the same order on every rank
        self.begin = time.perf_counter()

    def done(self) -> bool:
        return not self.untried and not self.order and self.rounds == WARMUP + ROUNDS

    def call(self, variants: dict, args: tuple, group, device):
        """This call's step of the trial, and the call's result. Where the variant whose turn it
        is refuses this call's operands (a token count of the bucket it does not take), NCCL +
        cuBLAS runs the call, untimed."""
        self.calls += 1
        stats["trial steps"] += 1
        if self.untried:
            name = self.untried.pop(0)
            result = variants[BASELINE](*args)
            # the variants tried at later calls compile meanwhile, behind the model's steps
            with compiling_ahead(config.compile_ahead, wait=False):
                ok = _first_calls(variants, [name], args, group, device, _outputs(result))
            if ok[name]:
                self.usable.append(name)
            return result
        if not self.order:
            self.rounds += 1
            self.order = list(self.usable)
            self.shuffle.shuffle(self.order)
        name = self.order.pop(0)
        # a sample as _time takes it, on this call's inputs: a call timed alone as it runs in
        # the model's stream would take the peers' skew and the host's pace with it, and run
        # eagerly where the model's addresses move between calls, so the fused variants would
        # time several times slower than NCCL + cuBLAS
        _in_step(group, device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            result = _calls(variants[name], args)
        except refusals() as error:
            if name == BASELINE:
                raise
            tell_refused(name, error)
            return variants[BASELINE](*args)
        end.record()
        if self.rounds > WARMUP:
            self.samples[name].append((start, end))
        return result

    def times(self, group, device) -> dict[str, float]:
        """Per variant timed: the slowest rank's median µs a call (collective)."""
        torch.cuda.synchronize(device)  # (the events are some calls old)
        local = _trial_times({n: s for n, s in self.samples.items() if s})
        times = torch.tensor([local.get(n, float("inf")) for n in self.names], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return {n: t for n, t in zip(self.names, times.tolist()) if t != float("inf")}

    def summary(self) -> str:
        return f"measured over {self.calls} calls in {time.perf_counter() - self.begin:.1f} s"


def _trial_times(samples: dict[str, list]) -> dict[str, float]:
    """A variant's median µs a call over its timed samples (start and end events)."""
    return {
        name: statistics.median(start.elapsed_time(end) * 1e3 / SAMPLE_CALLS for start, end in timed)
        for name, timed in samples.items()
    }


def trial_call(key: str, variants: dict, group, device, *args):
    """A call of ``key`` while its trial runs (choose answered TRIAL): the trial's step."""
    return _TRIALS[(group.group_name, key)].call(variants, args, group, device)


def choose(key: str, variants: dict, args: tuple, group, device) -> str:
    """The variant to run for ``key``: forced by config.implementation, known, cached on disk,
    or measured now. Collective on first use of a key (every rank calls it in the same order,
    as it does the op)."""
    forced = config.implementation
    if forced != "auto":
        matches = [n for n in variants if n == forced or n.split(":")[0] == forced]
        if matches:
            return _forced(key, matches[0], variants, args, group, device)
        # e.g. cublas_push for an all-gather, or fused for a sum of matmuls: measure instead
        log.warning("overlap: implementation %r is not one of %s here; choosing by measurement", forced, sorted(variants))
    known, nearest = _known(group, key)
    if known is not None:
        return known
    if torch.cuda.is_current_stream_capturing():
        # nothing can be measured or broadcast inside a capture; the same answer on every rank
        log.warning("overlap: first call of %s inside a CUDA graph capture: running %s", key, BASELINE)
        return BASELINE
    graphs = replays_graphs(device)  # graph trees keep their state per thread: asked here
    # a compiled model's first call may run with allocations routed to a CUDA graph pool
    return symm.outside_graph_pool(
        device, _choose_collectively, key, variants, args, group, device, graphs, (), nearest
    )  # fmt: skip


def _known(group, key: str) -> tuple[str | None, tuple[str, str] | None]:
    """(What this process decided for ``key``'s token bucket (at another count: the same on
    every rank, as decisions are collective), else the choice measured for a bucket next to
    it, taken for this one without measuring (predicted, never a base for another
    prediction); else None, and (choice, key) of the nearest measured bucket, if any). No
    call is made here: dispatch runs the choice, and where it refuses a count (the same on
    every rank), NCCL + cuBLAS runs that count."""
    decided = _DECIDED.get((group.group_name, key)) or _PREDICTED.get((group.group_name, key))
    if decided is not None:
        return decided, None
    if (group.group_name, key) in _TRIALS:  # its own measurement runs: not a neighbour's choice
        return None, None
    nearest = _nearest_measured(group.group_name, key)
    if nearest is None:
        return None, None
    apart, decided, neighbour = nearest
    if apart > 1:
        return None, (decided, neighbour)
    _PREDICTED[(group.group_name, key)] = decided
    CHOICES.setdefault(key, {"choice": decided, "source": f"predicted from {neighbour}"})
    return decided, None


@functools.cache
def refusals() -> tuple[type, ...]:
    """The errors a variant raises, the same on every rank, when it cannot take a call's
    operands: before it starts (NotImplementedError), or when a kernel does not compile for
    them."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return NotImplementedError, CompilationError, OutOfResources


def _forced(key: str, name: str, variants: dict, args: tuple, group, device) -> str:
    """The variant config.implementation names, once its first call has run on every rank;
    where it fails on one, it is out and the choice is measured among the rest (every rank
    alike). Collective on first use of a key, as choose."""
    if name == BASELINE:  # the fallback itself: nothing to fall back to
        return name
    decided_key = (group.group_name, f"{key} | forced {name}")
    decided = _DECIDED.get(decided_key)
    if decided is not None:
        return decided
    if torch.cuda.is_current_stream_capturing():  # as choose: nothing can be tried in a capture
        log.warning("overlap: first call of %s inside a CUDA graph capture: %s, not %s", key, BASELINE, name)
        return BASELINE
    graphs = replays_graphs(device)  # (asked on the calling thread, as in choose)

    def tried() -> str:
        if runs_everywhere(name, variants, args, group, device):
            return name
        reason = "it does not run here; choosing by measurement"
        tell_once(logging.WARNING, "overlap: forced variant %s is out: %s", name, reason)
        return _choose_collectively(key, variants, args, group, device, graphs, out=(name,))

    decided = _DECIDED[decided_key] = symm.outside_graph_pool(device, tried)
    return decided


def _choose_collectively(
    key: str, variants: dict, args: tuple, group, device, graphs: bool, out=(), nearest=None
) -> str:  # fmt: skip
    """choose's collective part: the cache file's choice for the key's token bucket or one
    next to it (rank 0's), or a measurement now (timing replayed CUDA graphs if ``graphs``).
    ``out``: variants known not to run (the same on every rank), timed as inf without running.
    A cached choice other than the baseline is tried once on this call; where it fails on a
    rank, it is out and the shape measured again. ``nearest``: (choice, key) of the measured
    bucket nearest this one, whose choice runs instead of a measurement until the bucket's
    config.measure_bucket_after-th distinct token count."""
    decided_key = key
    if graphs:  # timed apart and cached apart: host time does not count
        key += GRAPHS_KEY
    names = list(variants)
    rank = group.rank()
    trial = _TRIALS.get((group.group_name, decided_key))
    if trial is not None:
        if not trial.done():
            return TRIAL
        del _TRIALS[(group.group_name, decided_key)]
        return _pick(key, decided_key, names, trial.times(group, device), group, device, trial.summary())
    if config.measure_over_calls and not graphs and _sibling_on_trial(group.group_name, decided_key):
        # one trial per op at a time: this bucket then takes that one's choice, or the nearest
        # one's until measured itself, rather than running every variant's first calls too
        return ForNow(BASELINE)
    # the cache file's choice for this token bucket, or for one next to it (rank 0's)
    found = _cached_among([key, *neighbour_keys(key)], names) if rank == 0 else None
    found = None if found in out else found
    found = _broadcast_name(found, names, group, device)
    if found is not None and (found == BASELINE or runs_everywhere(found, variants, args, group, device)):
        CHOICES[key] = {"choice": found, "source": "cache"}
        _DECIDED[(group.group_name, decided_key)] = found
        return found
    if found is not None:
        log.warning("overlap: the cached choice %s for %s does not run here; measuring again", found, key)
        out = (*out, found)
    elif nearest is not None and nearest[0] not in out:
        seen = _UNMEASURED[(group.group_name, decided_key)] = _UNMEASURED.get((group.group_name, decided_key), 0) + 1
        if seen < config.measure_bucket_after:  # (the same count on every rank: calls are collective)
            CHOICES[key] = {"choice": nearest[0], "source": f"predicted from {nearest[1]} until measured"}
            return nearest[0]
    candidates = [n for n in names if n not in out]
    if config.measure_over_calls and not graphs:
        _TRIALS[(group.group_name, decided_key)] = Trial(names, candidates)
        return TRIAL
    begin = time.perf_counter()
    times = _measure({n: variants[n] for n in candidates}, args, group, device, graphs)
    return _pick(key, decided_key, names, times, group, device, f"measured in {time.perf_counter() - begin:.1f} s")


def _pick(key: str, decided_key: str, names: list[str], times: dict, group, device, how: str) -> str:
    """The fastest of ``times`` (the slowest rank's µs per variant measured; a name without
    one is out), rank 0's pick on every rank, decided, kept and logged."""
    times = {n: float("inf") for n in names} | times
    best = min(names, key=lambda n: times[n]) if group.rank() == 0 else None
    best = _broadcast_name(best, names, group, device)
    entry = {"choice": best, "times_us": {n: round(t, 1) for n, t in times.items()}}
    CHOICES[key] = {**entry, "source": "measured"}
    _DECIDED[(group.group_name, decided_key)] = best
    if group.rank() == 0:
        _store(key, entry)
    log.info("overlap: %s -> %s (%s; %s)", key, best, ", ".join(f"{n} {t:.0f} us" for n, t in times.items()), how)
    return best
