"""A token count's first calls on plain Inductor's graph (backend="overlap", symbolic graphs).

A fused op cannot pay at a token count it has just met: its symmetric-memory variant's first call
runs eagerly and its second captures the per-call CUDA graph, some 20 ms of host time together
at the 8B block's counts, which only a count that comes back pays off. So a count's first
``config.fused_from_call - 1`` calls run something else. Each op on NCCL + cuBLAS inside
overlap's graph runs slower than plain Inductor: the op calls' host time and the graph around
them (docs/rewrites.md#a-counts-first-calls), so shapes that changed at every call would run
below plain Inductor's pace.

Here backend="overlap" compiles a graph on symbolic token counts twice: with the pass, and as
plain Inductor compiles it (the same Inductor settings, no overlap pass). A call at a count met
fewer than ``fused_from_call - 1`` times runs the plain graph, forward and backward (the
autograd function of the graph the forward ran); from the next call on, overlap's, whose ops
then run their chosen variants from their first call (lowering/dispatch.py's
first_calls_on_nccl is False once such a graph exists: the graph has done the waiting). Counts
are the values of the graph's symbols, the ``config.shapes_kept * 4`` most recent kept.

A fused op pays from its per-call CUDA graph's replays, which need its tensors at addresses
met before. Where a count's calls keep finding them elsewhere (the caching allocator's state
differs from call to call: counts that change between calls and other work between steps), each
op call runs eagerly, which costs far more host time than plain Inductor's collectives
(docs/rewrites.md#a-counts-first-calls). Such a count (an op call of its forward eager or
capturing in each of UNREPLAYED_STREAK calls in a row, or in a quarter of its first
JUDGED_CALLS, once settled) goes back to the plain graph.

Only where the ops would wait on NCCL + cuBLAS: CUDA inputs, the per-shape choice on
(config.implementation "auto") and CUDA graph trees off (under them a warm-up records a graph
of its own per count and shape; the ops choose at once there).
"""

import collections
import dataclasses
import functools
import logging

import torch

from .. import config
from ..pipeline.install import SLOTS, without_overlap_passes
from ..pipeline.passes import SAME_GRAPH_ON_EVERY_RANK
from . import size_ranges

log = logging.getLogger("overlap_pass")

# overlap's first calls at a count: eager, then capturing the per-call graphs, twice where the
# allocator alternates between two sets of addresses; judged from the next one on
SETTLING_CALLS = 4
UNREPLAYED_STREAK = 4
# and, over its first JUDGED_CALLS judged calls, fewer than this share replaying every op call
JUDGED_CALLS, REPLAYED_SHARE = 12, 0.75
stats: collections.Counter = collections.Counter()  # "counts back on plain" (tests, tools)


def applies(example_inputs, patches: dict) -> bool:
    """Whether a symbolic graph compiled with Inductor ``patches`` gets a plain graph for its
    new counts (config.plain_graph_at_new_counts, CUDA inputs, no CUDA graph trees)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return config.plain_graph_at_new_counts and on_cuda and not patches.get("triton.cudagraphs")


def plain_patches(patches: dict) -> dict:
    """``patches`` (overlap's Inductor settings) with overlap's graph passes taken out of
    their slots, and shape padding as the user has it (overlap turns it off so that every rank
    fuses alike; a graph without overlap's ops may pad its matmuls differently on each rank):
    the graph plain Inductor compiles, but for its mix-order reductions' size checks, off here
    as in overlap's graph (backend.NO_GUARDS_ON_TOKEN_COUNTS: they would guard on the count)."""
    plain = {k: v for k, v in patches.items() if k not in SAME_GRAPH_ON_EVERY_RANK}
    for slot in SLOTS:
        plain[slot] = without_overlap_passes(plain.get(slot, getattr(torch._inductor.config, slot)))
    return plain


def with_plain_first_calls(compiled, compile_plain, readers: list):
    """``compiled`` behind a function that runs ``compile_plain()``'s graph at a count's first
    calls; ``compiled`` alone where that compile fails. ``readers``: (symbol, (input index,
    dim or None)) for every symbol of the graph's inputs (size_ranges.symbol_readers)."""
    try:
        plain = compile_plain()
    except Exception as error:
        if config.strict:
            raise
        log.warning("overlap: plain Inductor's graph for new token counts failed to compile (%r)", error)
        return compiled
    _ops_choose_at_first_calls()
    log.info("overlap: a token count's first %d calls run plain Inductor's graph", config.fused_from_call - 1)
    return PlainFirstCalls(compiled, plain, [where for _, where in readers])


def _ops_choose_at_first_calls() -> None:
    """From now on an op call signature runs its chosen variant from its first call, not NCCL
    + cuBLAS (lowering/dispatch.py): this graph does the waiting."""
    # deferred: the lowering imports triton (optional on a CPU install); this runs on CUDA
    from ..lowering import dispatch

    dispatch.first_calls_on_nccl = False


@functools.cache
def _op_calls() -> collections.Counter:
    """lowering/replay.py's counts of the symmetric-memory variants' calls by path (looked up
    once: the lowering loads on first use)."""
    from ..lowering import replay

    return replay.stats


@dataclasses.dataclass
class _Count:
    calls: int = 0
    unreplayed: int = 0  # overlap's calls in a row with an op call that did not replay its graph
    judged: int = 0
    replayed: int = 0  # judged calls whose op calls all replayed
    plain: bool = False  # back on plain Inductor's graph for good


class PlainFirstCalls:
    """Runs ``plain`` at a count's first config.fused_from_call - 1 calls, then ``overlap``;
    ``plain`` again for a count whose op calls keep missing their per-call graphs."""

    def __init__(self, overlap, plain, readers: list) -> None:
        self._overlap = overlap
        self._plain = plain
        self._readers = readers
        self._counts: collections.OrderedDict[tuple, _Count] = collections.OrderedDict()
        self.plain_calls = 0  # (tests, tools)

    def __call__(self, *args):
        wait = config.fused_from_call - 1  # (read each call: a config patch takes effect)
        if wait <= 0 or config.implementation != "auto":
            return self._overlap(*args)
        count = size_ranges.symbol_values(args, self._readers)
        state = self._counts.get(count)
        if state is None:
            state = self._counts[count] = _Count()
            while len(self._counts) > 4 * max(config.shapes_kept, 1):
                self._counts.popitem(last=False)
        self._counts.move_to_end(count)
        state.calls += 1
        if state.plain or state.calls <= wait:
            self.plain_calls += 1
            return self._plain(*args)
        if state.calls <= wait + SETTLING_CALLS:
            return self._overlap(*args)
        return self._judged(count, state, args)

    def _judged(self, count: tuple, state: _Count, args):
        """overlap's graph, whose op calls (those of the forward, which run inside this call)
        are watched: a count with an op call that ran eagerly or captured its graph in each of
        UNREPLAYED_STREAK calls in a row, or in more than 1 - REPLAYED_SHARE of its first
        JUDGED_CALLS, goes back to plain Inductor's graph, which those calls' host time made
        faster."""
        calls = _op_calls()
        before = calls["eager"] + calls["captured"]
        result = self._overlap(*args)
        missed = calls["eager"] + calls["captured"] > before
        state.unreplayed = state.unreplayed + 1 if missed else 0
        state.judged += 1
        state.replayed += not missed
        rarely = state.judged == JUDGED_CALLS and state.replayed < REPLAYED_SHARE * JUDGED_CALLS
        if state.unreplayed >= UNREPLAYED_STREAK or rarely:
            state.plain = True
            stats["counts back on plain"] += 1
            log.info(
                "overlap: token count %s: its op calls met their tensors at new addresses (no per-call CUDA graph "
                "to replay) in %d of its %d calls so far; it runs plain Inductor's graph from now on",
                count, state.judged - state.replayed, state.judged,
            )  # fmt: skip
        return result
