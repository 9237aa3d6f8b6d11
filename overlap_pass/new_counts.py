"""A token count's first calls on plain Inductor's graph (backend="overlap", symbolic graphs).

A fused op cannot pay at a token count it has just met: its symmetric-memory variant's first call
runs eagerly and its second captures the per-call CUDA graph, some 20 ms of host time together
at the 8B block's counts, which only a count that comes back pays off. So a count's first
``config.fused_from_call - 1`` calls run something else. Inside overlap's graph that was each
op on NCCL + cuBLAS, and that ran slower than plain Inductor: the op calls' host time and the
graph around them (the 8B block at 2048 tokens, W=4, forward: 1609 against 1438 µs on the GPU,
4xH200), so shapes that changed at every call ran below plain Inductor's pace.

Here backend="overlap" compiles a graph on symbolic token counts twice: with the pass, and as
plain Inductor compiles it (the same Inductor settings, no overlap pass). A call at a count met
fewer than ``fused_from_call - 1`` times runs the plain graph, forward and backward (the
autograd function of the graph the forward ran); from the next call on, overlap's, whose ops
then run their chosen variants from their first call (ops_warm_up() is False once such a graph
exists: the graph has done the waiting). Counts are the values of the graph's symbols, the
``config.shapes_kept * 4`` most recent kept.

Only where the ops would wait on NCCL + cuBLAS: CUDA inputs, the per-shape choice on
(config.implementation "auto") and CUDA graph trees off (under them a warm-up records a graph
of its own per count and shape; the ops choose at once there).
"""

import collections
import logging

import torch

from . import config

log = logging.getLogger("overlap_pass")

_GRAPHS_WARM_COUNTS = False


def ops_warm_up() -> bool:
    """Whether each op call signature runs NCCL + cuBLAS at its own first calls
    (config.fused_from_call): not once a graph that warms its token counts up on plain
    Inductor has been compiled in this process."""
    return not _GRAPHS_WARM_COUNTS


def applies(example_inputs, patches: dict) -> bool:
    """Whether a symbolic graph compiled with Inductor ``patches`` gets a plain graph for its
    new counts (config.plain_graph_at_new_counts, CUDA inputs, no CUDA graph trees)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return config.plain_graph_at_new_counts and on_cuda and not patches.get("triton.cudagraphs")


def plain_patches(patches: dict) -> dict:
    """``patches`` (overlap's Inductor settings) with overlap's graph passes taken out of
    their slots, and shape padding as the user has it (overlap turns it off so that every rank
    fuses alike; a graph without overlap's ops may pad its matmuls differently on each rank):
    the graph plain Inductor compiles."""
    from .backend import SAME_GRAPH_ON_EVERY_RANK
    from .graph_pass import ChainedGraphPass, OverlapPass
    from .regather import RegatherPass

    plain = {k: v for k, v in patches.items() if k not in SAME_GRAPH_ON_EVERY_RANK}
    for slot in ("post_grad_custom_pre_pass", "joint_custom_pre_pass"):
        held = plain.get(slot, getattr(torch._inductor.config, slot))
        passes = held.passes if isinstance(held, ChainedGraphPass) else [] if held is None else [held]
        kept = [p for p in passes if not isinstance(p, (OverlapPass, RegatherPass))]
        plain[slot] = None if not kept else kept[0] if len(kept) == 1 else ChainedGraphPass(kept)
    return plain


def with_plain_first_calls(compiled, compile_plain, readers: list):
    """``compiled`` behind a function that runs ``compile_plain()``'s graph at a count's first
    calls; ``compiled`` alone where that compile fails. ``readers``: (symbol, (input index,
    dim or None)) for every symbol of the graph's inputs (size_ranges.symbol_readers)."""
    global _GRAPHS_WARM_COUNTS
    try:
        plain = compile_plain()
    except Exception as error:
        if config.strict:
            raise
        log.warning("overlap: plain Inductor's graph for new token counts failed to compile (%r)", error)
        return compiled
    _GRAPHS_WARM_COUNTS = True
    log.info("overlap: a token count's first %d calls run plain Inductor's graph", config.fused_from_call - 1)
    return PlainFirstCalls(compiled, plain, [where for _, where in readers])


class PlainFirstCalls:
    """Runs ``plain`` at a count's first config.fused_from_call - 1 calls, then ``overlap``."""

    def __init__(self, overlap, plain, readers: list) -> None:
        self._overlap = overlap
        self._plain = plain
        self._readers = readers
        self._calls: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.plain_calls = 0  # (tests, tools)

    def count(self, args) -> tuple:
        return tuple(args[i] if dim is None else args[i].shape[dim] for i, dim in self._readers)

    def __call__(self, *args):
        wait = config.fused_from_call - 1  # (read each call: a config patch takes effect)
        if wait <= 0 or config.implementation != "auto":
            return self._overlap(*args)
        count = self.count(args)
        seen = self._calls.get(count, 0)
        if seen >= wait:
            self._calls.move_to_end(count)
            return self._overlap(*args)
        self._calls[count] = seen + 1
        self._calls.move_to_end(count)
        while len(self._calls) > 4 * max(config.shapes_kept, 1):
            self._calls.popitem(last=False)
        self.plain_calls += 1
        return self._plain(*args)
