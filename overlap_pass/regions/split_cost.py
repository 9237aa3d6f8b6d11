"""Whether a region of the all-reduce split pays: the bytes each rank sends in collectives
left in the open (not fused with a matmul), plus each collective's latency, against its
all-reduces' and all-gathers' now; on a symbolic token count, from which count on it pays.
"""

import contextlib
import math

from torch.fx import Node

from .. import config
from ..shapes import size_ranges
from ..graph.nodes import depends_on, meta_val
from ..graph.sizes import divisible, hint, judged_at, substituted, traced_values
from . import rows
from .split_regions import (
    Region, feeds_from_matmul, feeds_matmul, feeds_scaled_mm, matmul_readers, padded_producer, padded_readers,
)

# what one more collective costs beyond its bytes, in bytes (launch and latency, ~10 us)
LATENCY_BYTES = 1 << 20


@contextlib.contextmanager
def sizes_ignored(ignored: bool = True):
    """Regions judged as if a collective cost its bytes alone, with no latency and no minimum
    size for a fused one (``ignored``): how tests and tests/fuzz_models.py split the tiny
    shapes they run."""
    global LATENCY_BYTES
    if not ignored:
        yield
        return
    kept = LATENCY_BYTES
    LATENCY_BYTES = 0
    try:
        with config.patch(split_min_bytes=0):
            yield
    finally:
        LATENCY_BYTES = kept


def _bytes(node: Node) -> int:
    val = meta_val(node)
    return hint(val.numel()) * val.element_size()


def decide(region: Region, order: dict[Node, int]) -> tuple[bool, str]:
    """Split when the collectives left in the open (not fused with a matmul) cost less than the
    all-reduces and all-gathers do now: bytes each rank sends, plus LATENCY_BYTES a collective
    (none for a gather that will ride in a fused one as a passenger). A region from
    all-gathers alone is taken only for a scaled (float8) matmul: casts.py moves a plain cast."""
    if any(isinstance(meta_val(n), (tuple, list)) for n in region.exits):
        return False, "a row-wise op's tuple result is read whole"
    if region.gathers and not region.entries and not any(feeds_scaled_mm(n) for n in region.exits):
        return False, "no scaled (float8) matmul reads a tensor computed from the gathered one"
    share = (region.world_size - 1) / region.world_size

    def latency_bound(node: Node) -> bool:
        # too few bytes for a fused op to pay for its call (config.split_min_bytes): the matmul
        # beside it is short (a decode step's few tokens, a short prompt), so it saves nothing
        return share * _bytes(node) < config.split_min_bytes

    padded = not divisible(region.tokens, region.world_size)

    def fuses_reduce_scatter(ar: Node) -> bool:  # (padded: the matmuls made again on padded rows)
        if padded:
            return padded_producer(ar.args[0], region.tokens) is not None
        return feeds_from_matmul(ar.args[0])

    def fuses_gather(node: Node) -> bool:
        if padded:
            return any(padded_readers(u, node, region.tokens) for u in region.exits[node])
        return feeds_matmul(node)

    all_reduces = [ar for ars in region.entries.values() for ar in ars]
    # entries whose all-reduces would become fused reduce-scatters, and those that count as
    # fused (enough bytes); one gather per shard (reshapes share it), fused where a matmul reads
    # any of its tensors, likewise
    scatters = {entry for entry, ars in region.entries.items() if all(fuses_reduce_scatter(ar) for ar in ars)}
    fused_scatters = {entry for entry in scatters if not latency_bound(region.entries[entry][0])}
    would_fuse = [n for n in region.exits if fuses_gather(n)]
    gathers = {_root(region, n) for n in would_fuse}
    fused = {_root(region, n) for n in would_fuse if not latency_bound(n)}
    # collectives that would fuse but move too few bytes to count as fused (told in the summary)
    short = len(scatters - fused_scatters) + len(gathers - fused)
    before = sum(2 * share * _bytes(ar) + LATENCY_BYTES for ar in all_reduces)
    before += sum(share * _bytes(g) + LATENCY_BYTES for g in region.gathers)
    after = 0.0
    for entry, ars in region.entries.items():
        if entry not in fused_scatters:
            after += share * _bytes(ars[0]) + LATENCY_BYTES
    plain = {_root(region, n) for n in region.exits} - fused
    # a rider moves behind its host's matmul, which may not cover its bytes: only its
    # collective's latency is saved
    riders = _riders(region, plain, fused, order)
    after += sum(share * _bytes(n) + (0 if n in riders else LATENCY_BYTES) for n in plain)
    after += sum(2 * share * _bytes(n) + LATENCY_BYTES for n in region.token_reductions)
    collectives = f"{len(all_reduces)} all-reduce(s)" if all_reduces else ""
    if region.gathers:
        collectives += (" and " if collectives else "") + f"{len(region.gathers)} all-gather(s)"
    summary = (
        f"{collectives} move {_size(before)} in the open, on the shards {_size(after)} "
        f"(bytes a rank sends, {_size(LATENCY_BYTES)} a collective for its latency"
        + (f"; {len(riders)} gather(s) ride in a fused one, no latency" if riders else "")
        + (
            f"; {short} collective(s) under {_size(config.split_min_bytes)} a rank "
            "count as plain: too short to pay for a fused op's call"
            if short
            else ""
        )
        + ")"
    )
    if after >= before:
        return False, f"does not pay: {summary}"
    return True, summary


# token counts searched for where a symbolic region starts to split
_MOST_TOKENS = 1 << 24


def _split_from(region: Region, order: dict[Node, int]) -> int | None:
    """The fewest tokens at which ``region`` (on a symbolic token count) splits, by bisection
    (its costs grow with the count), or None: at every count or at none, or a count that is
    not a multiple of one symbol. A count is judged by setting the symbol with the largest
    traced value (the sequence; a batch keeps its own) to the count over the rest."""
    expr = region.tokens.node.expr
    traced = traced_values(region.tokens.node.shape_env)
    symbol = max(expr.free_symbols, key=lambda s: traced.get(s, 0))
    per_symbol = substituted(expr / symbol, traced)
    if not per_symbol.is_number or per_symbol <= 0 or symbol in (expr / symbol).free_symbols:
        return None

    def splits(tokens: int) -> bool:
        with judged_at({symbol: max(1, math.ceil(tokens / per_symbol))}):
            return decide(region, order)[0]

    low, high = 1, _MOST_TOKENS
    if splits(low) or not splits(high):
        return None
    while high - low > 1:  # splits(high), not splits(low)
        middle = (low + high) // 2
        low, high = (low, middle) if splits(middle) else (middle, high)
    return high


def per_token_count(region: Region, order: dict[Node, int], split: bool, reason: str) -> tuple[bool, str]:
    """A symbolic region's decision: where it splits from some count on, as backend="overlap"
    compiles this graph for the range of counts it runs (size_ranges.py), else as judged at the
    traced count."""
    threshold = _split_from(region, order)
    region.split_from = threshold
    if threshold is None:
        return split, reason
    chosen = size_ranges.decide(region.tokens.node.expr, threshold, split)
    region.split_elsewhere = not chosen and size_ranges.compiling_per_range()
    if chosen == split:
        return split, f"{reason}; splits from {threshold} tokens"
    if chosen:
        return True, f"this graph runs {threshold} tokens or more, where it pays"
    return False, f"does not pay: this graph runs fewer than {threshold} tokens"


def _riders(region: Region, plain: set[Node], fused: set[Node], order: dict[Node, int]) -> set[Node]:
    """The plain gathers of ``plain`` that passengers.py will likely move into a fused gather of
    the region (one of ``fused``): those that do not follow one of its matmuls (which read the
    gathered rows, so they cannot wait for a shard computed from their results)."""
    if not config.gather_passengers:
        return set()
    hosts = [matmul_readers(n) for n in region.exits if _root(region, n) in fused]
    return {
        node
        for node in plain
        if any(not any(depends_on(node, mm, order) for mm in readers) for readers in hosts)
    }


def _size(count: float) -> str:
    return f"{count / (1 << 20):.1f} MiB" if count >= 1 << 20 else f"{count / 1024:.1f} KiB"


def _root(region: Region, node: Node) -> Node:
    """The region node whose shard ``node`` shares (reshapes between row forms are no ops)."""
    while region.nodes.get(node) == rows.SAME:
        node = node.args[0]
    return node
