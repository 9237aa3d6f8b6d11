"""Before matching: split each all-reduce into a reduce-scatter and an all-gather around the
row-wise ops that follow it (tensor parallelism without sequence parallelism).

all_reduce(x) = all_gather(reduce_scatter(x)). In plain TP each row-parallel linear ends in an
all-reduce, and the next column-parallel linear reads its result after row-wise ops (residual
add, RMSNorm, casts; rows.py). Those ops give the same rows on a shard of the tokens, so

    y = all_reduce(mm(a, w));  h = norm(x + y);  z = mm(h, w2)
becomes
    ys = reduce_scatter(mm(a, w));  hs = norm(x[rank's rows] + ys);  z = mm(all_gather(hs), w2)

and the matchers that run next fuse the reduce-scatter with its matmul and the all-gather with
its consumers. The tokens are the flattened leading dims: rank r holds rows [r T/W, (r+1) T/W),
the reduce-scatter's and the all-gather's order. A sum of all-reduces (DTensor all-reduces the
input gradient of Q, K and V one by one) becomes one reduce-scatter of the sum.

- A region tensor read by anything else (a graph output, a saved activation, an op that is not
  row-wise) is all-gathered for it; where a matmul reads it, that gather is fused.
- A sum over every token (a norm weight's or a bias's gradient) becomes the shard's sum,
  all-reduced: sums are linear.
- A region is split when the bytes its collectives then move outside a fused op are fewer than
  its all-reduces move.

Numerics: each token's sum over ranks now runs in the reduce-scatter (in fp32, in rank order, on
GPUs), a sum of all-reduces is reduced once, and a sum over tokens adds the shards' sums: the
order of these sums differs from NCCL's all-reduce, as a different NCCL algorithm's would.

Operands that a region op reads from outside it (the residual, a saved activation) are sliced to
the rank's rows. That is exact when they hold the same values on every rank, as every such
tensor does in plain TP. Matmul and reduce-scatter outputs, and anything computed from them,
count as rank-local and are never sliced; graph inputs count as replicated.

The slices name the rank, so each rank's graph differs: the pass's cache key carries the rank.

The same regions start at an all-gather whose result no matmul reads directly, where the
quantization of float8 training (torchao's Float8Linear) sits between the gather and its
_scaled_mm: abs, amax, scale and cast are row-wise, or reductions over every token. They then run
on the rank's shard, and the float8 data and its rowwise scales are gathered instead, fused with
the scaled matmuls (half the bytes of a bf16 gather). A tensorwise scale's amax over the gathered
tensor becomes each shard's amax, all-reduced with max: exactly the same value. The gathered rows
of an all-gather along a later dim (DTensor's split/cat) are not the token order's blocks, so
such a region reads no row-shaped operand from outside.
"""

import contextlib
import dataclasses
import math
import operator

import torch
import torch.distributed as dist
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from .. import config
from ..debug import describe_node
from ..fusion.patterns import (
    ALL_GATHER,
    REDUCE_SCATTER,
    SCALED_MM,
    VIEWS,
    WAIT,
    NoMatch,
    depends_on,
    gathered_layout,
    graph_order,
    is_transpose,
    meta_val,
)
from ..fusion.rewrite import call, erase_dead, reshape
from ..fusion.sizes import (
    arith, divisible, hint, is_static, judged_at, same, same_shape, size_arg, substituted, traced_values,
)
from .. import size_ranges
from . import rows

aten = torch.ops.aten
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
KIND = "all_reduce_split"
GATHER_KIND = "quantize_before_gather"
ENTRY = "entry"  # a region's rule for the node holding an all-reduced value

# ops whose output differs between ranks in plain TP although their inputs may not
_RANK_LOCAL = (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_mm.default, aten.convolution.default,
)  # fmt: skip
_MATMULS = (aten.mm.default, aten.addmm.default)
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which rows a rank's shard holds. ``dim`` None: the r-th 1/W of the flattened tokens (a
    reduce-scatter's, an all-gather's along dim 0); else the r-th 1/W along ``dim`` of the
    gathered ``shape`` (an all-gather along a later dim)."""

    dim: int | None = None
    shape: tuple = ()


FLAT = Layout()


@dataclasses.dataclass
class Region:
    """Row-wise ops reached from one or more all-reduces or all-gathers, all in one group, on one
    token count and row layout."""

    group_name: str
    world_size: int
    rank: int
    tokens: int
    layout: Layout = FLAT
    split_from: int | None = None  # on a symbolic count: the fewest tokens at which it splits
    split_elsewhere: bool = False  # whole here, split in the graph of another range of counts
    entries: dict = dataclasses.field(default_factory=dict)  # entry node -> its all-reduces
    gathers: dict = dataclasses.field(default_factory=dict)  # entry node -> its all-gather
    absorbed: set = dataclasses.field(default_factory=set)  # the collectives, waits and adds
    nodes: dict = dataclasses.field(default_factory=dict)  # region node -> rows.* rule
    token_reductions: list = dataclasses.field(default_factory=list)
    exits: dict = dataclasses.field(default_factory=dict)  # region node -> its outside users
    sliced: set = dataclasses.field(default_factory=set)  # outside operands cut to the shard
    split: bool = False
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    regions: tuple[Region, ...]
    records: dict  # all-reduce node -> its decision record

    def accepted(self) -> list[Region]:
        return [r for r in self.regions if r.split]


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _why_not(all_reduce: Node) -> str | None:
    """Why this all-reduce cannot be split, or None."""
    x, reduce_op, group_name = all_reduce.args[:3]
    users = list(all_reduce.users)
    if len(users) != 1 or users[0].target is not WAIT:
        return "all-reduce result is not read through exactly one wait_tensor"
    if reduce_op != "sum":
        return f"reduce op {reduce_op!r} (only sum)"
    shape = rows.tensor_shape(x)
    tokens = rows.tokens(shape)
    if tokens is None:
        return "a 1-D all-reduce, or one of a symbolic last dim, has no rows to shard"
    try:
        world_size = _group(group_name).size()
    except Exception as error:
        return f"group {group_name!r} cannot be resolved ({error})"
    if world_size == 1:
        return "group of size 1"
    if not meta_val(x).dtype.is_floating_point:
        return f"dtype {meta_val(x).dtype} is not a floating-point dtype"
    return None


def _entries(graph: Graph, eligible: list[Node]) -> dict[Node, tuple[list[Node], set[Node]]]:
    """{the node holding an all-reduced value: (the all-reduces it sums, the nodes on the way)}:
    a wait, or an add of two such values (each read only there) in one group, shape and dtype."""
    sums = {next(iter(ar.users)): ([ar], {ar}) for ar in eligible}
    for node in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        if len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if a in sums and b in sums and a is not b and len(a.users) == 1 and len(b.users) == 1:
            (ars_a, on_a), (ars_b, on_b) = sums[a], sums[b]
            if _all_alike([(ar.args[2], rows.tensor_shape(ar), meta_val(ar).dtype) for ar in ars_a + ars_b]):
                del sums[a], sums[b]
                sums[node] = (ars_a + ars_b, on_a | on_b | {a, b})
    return sums


def _rank_local(graph: Graph) -> set[Node]:
    """Nodes whose values may differ between ranks: matmul and reduce-scatter outputs, random
    values, and what is computed from them. All-reduces and all-gathers make values replicated
    again; graph inputs count as replicated."""
    local = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is WAIT:
            collective = node.args[0]
            if collective.target not in (ALL_REDUCE, ALL_GATHER):
                local.add(node)
        elif target in _RANK_LOCAL or target is REDUCE_SCATTER:
            local.add(node)
        elif _random(target):
            local.add(node)
        elif any(arg in local for arg in node.all_input_nodes):
            local.add(node)
    return local


def _matmul_readers(node: Node) -> list[Node]:
    """The matmuls that read ``node`` (through reshapes and a transpose), and the scaled
    matmuls that read it as their rows or their scales: its all-gather will be fused there."""
    found = []
    for user in node.users:
        if user.target in _MATMULS or (user.target is SCALED_MM and node in (user.args[0], user.args[2])):
            found.append(user)
        elif user.target in VIEWS or is_transpose(user):
            found += _matmul_readers(user)
    return found


def _feeds_matmul(node: Node) -> bool:
    return bool(_matmul_readers(node))


class _Regions:
    """Union-find over regions, keyed by the entry that started each."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.regions: dict[int, Region] = {}
        self.of: dict[Node, int] = {}  # region node -> region id

    def new(self, region: Region) -> int:
        key = len(self.parent)
        self.parent[key], self.regions[key] = key, region
        return key

    def find(self, key: int) -> int:
        while self.parent[key] != key:
            key = self.parent[key]
        return key

    def region(self, node: Node) -> Region:
        return self.regions[self.find(self.of[node])]

    def union(self, keys: list[int]) -> int:
        roots = sorted({self.find(k) for k in keys})
        first = self.regions[roots[0]]
        for other in roots[1:]:
            self.parent[other] = roots[0]
            merged = self.regions.pop(other)
            first.entries.update(merged.entries)
            first.absorbed |= merged.absorbed
            first.nodes.update(merged.nodes)
            first.gathers.update(merged.gathers)
            first.token_reductions += merged.token_reductions
            first.sliced |= merged.sliced
            for node, users in merged.exits.items():
                first.exits.setdefault(node, []).extend(users)
        return roots[0]


def _gather_entry(gather: Node) -> tuple[Node, Layout, set[Node]] | None:
    """(the gathered tensor, its layout, the nodes from the collective to it) for an all-gather
    of row-form tensors along a leading dim that no matmul reads directly (the matchers take
    those as they are); else None."""
    shard, world_size = gather.args[:2]
    users = list(gather.users)
    shape = rows.tensor_shape(shard)
    if len(users) != 1 or users[0].target is not WAIT or rows.tokens(shape) is None:
        return None
    if world_size == 1 or not meta_val(shard).dtype.is_floating_point:
        return None
    try:
        gathered, dim = gathered_layout(users[0], shard, world_size)
    except NoMatch:
        return None
    if dim == len(shape) - 1 or _feeds_matmul(gathered):
        return None
    between = {gather, users[0], gathered}
    if gathered is not users[0]:  # split -> getitems -> cat
        between |= {p for p in gathered.args[0]} | {p.args[0] for p in gathered.args[0]}
    layout = FLAT if dim == 0 else Layout(dim, rows.tensor_shape(gathered))
    return gathered, layout, between


def plan(graph: Graph, all_reduces: bool = True, gathers: bool = True) -> Plan:
    """Finds the regions (from all-reduces, from all-gathers, as asked), grows them along
    row-wise ops in graph order, and decides each."""
    records, eligible = {}, []
    for all_reduce in graph.find_nodes(op="call_function", target=ALL_REDUCE) if all_reduces else ():
        reason = _why_not(all_reduce)
        records[all_reduce] = record(all_reduce, reason)
        if reason is None:
            eligible.append(all_reduce)
    entries = _entries(graph, eligible)
    gathered = {}
    for gather in graph.find_nodes(op="call_function", target=ALL_GATHER) if gathers else ():
        found = _gather_entry(gather)
        if found is not None:
            gathered[found[0]] = (gather, *found[1:])
    absorbed = {n for _, on_the_way in entries.values() for n in on_the_way}
    absorbed |= {n for _, _, between in gathered.values() for n in between} - set(gathered)
    local = _rank_local(graph)
    regions = _Regions()

    for node in graph.nodes:
        if node in absorbed:
            continue
        if node in entries or node in gathered:
            collective = entries[node][0][0] if node in entries else gathered[node][0]
            group_name = collective.args[-1]
            group = _group(group_name)
            tokens = rows.tokens(rows.tensor_shape(node))
            region = Region(group_name, group.size(), dist.get_rank(group), tokens)
            if node in entries:
                region.entries[node], region.absorbed = entries[node]
            else:
                region.gathers[node], region.layout, region.absorbed = gathered[node]
            region.nodes[node] = ENTRY
            regions.of[node] = regions.new(region)
            continue
        inside = [a for a in node.all_input_nodes if a in regions.of]
        if not inside:
            continue
        keys = [regions.of[a] for a in inside]
        kinds = [(r.group_name, (r.tokens,), r.layout.dim, r.layout.shape) for r in (regions.region(a) for a in inside)]
        rule, sliced = None, set()
        if _all_alike(kinds):
            region = regions.region(inside[0])
            rule = rows.rule(node, inside[0], lambda n: n in regions.of, region.tokens)
            if rule == rows.POINTWISE:
                outside = [a for a in node.all_input_nodes if a not in regions.of]
                sliced = {a for a in outside if not rows.row_free(rows.tensor_shape(a))}
                if any(a in local for a in outside) or (sliced and region.layout != FLAT):
                    # the shard's rows of it would be another rank's values, or rows this
                    # layout cannot cut
                    rule, sliced = None, set()
        if rule == rows.ACROSS_TOKENS:
            regions.region(inside[0]).token_reductions.append(node)
        elif rule is not None:
            key = regions.union(keys)
            regions.regions[key].nodes[node] = rule
            regions.regions[key].sliced |= sliced
            regions.of[node] = key
        else:
            for a in inside:
                regions.region(a).exits.setdefault(a, []).append(node)

    found = list(regions.regions.values())
    order = graph_order(graph)
    for region in found:
        region.split, region.reason = _decide(region, order)
        if isinstance(region.tokens, torch.SymInt) and not is_static(region.tokens):
            region.split, region.reason = _per_token_count(region, order, region.split, region.reason)
        merged = [ar for ars in region.entries.values() for ar in ars]
        for ar in merged:
            records[ar].update(_region_record(region, merged))
        if any(_feeds_scaled_mm(n) for n in region.exits):  # else no float8 candidate: no record
            for gather in region.gathers.values():
                records[gather] = {**record(gather, None), **_region_record(region, merged)}
    return Plan(tuple(found), records)


def _all_alike(kinds: list[tuple]) -> bool:
    """Whether tuples of (a name, a shape, ...) are equal, shapes for every value of their
    symbols."""
    first = kinds[0]
    return all(
        all(same_shape(x, y) if isinstance(x, tuple) else x == y for x, y in zip(kind, first)) for kind in kinds[1:]
    )


def _bytes(node: Node) -> int:
    val = meta_val(node)
    return hint(val.numel()) * val.element_size()


_ROWS_OPERAND = {aten.mm.default: 0, aten.addmm.default: 1}  # which argument holds a matmul's rows


def _padded_producer(reduced: Node, tokens) -> tuple[list[Node], Node] | None:
    """(the views on the way, the matmul) where ``reduced`` is a matmul's result whose [T, k]
    rows a padded split can pad and multiply again, so that its reduce-scatter still fuses."""
    views, producer = [], reduced
    while producer.target in VIEWS:
        views.append(producer)
        producer = producer.args[0]
    if producer.target not in _ROWS_OPERAND:
        return None
    shape = rows.tensor_shape(producer.args[_ROWS_OPERAND[producer.target]])
    return (views, producer) if len(shape) == 2 and same(shape[0], tokens) else None


def _padded_readers(user: Node, node: Node, tokens) -> tuple[Node, list[Node]] | None:
    """(what they read, the matmuls) where ``user`` is a matmul reading ``node`` ([T, n]) as
    its rows, or a reshape of it to [T, n] read only so: a padded split runs them on the padded
    gathered rows and slices their results, so that its all-gather fuses with them."""
    source = user if user.target in VIEWS else node
    matmuls = list(user.users) if user.target in VIEWS else [user]
    shape = rows.tensor_shape(source)
    if shape is None or len(shape) != 2 or not same(shape[0], tokens) or not matmuls:
        return None
    if not all(m.target in _ROWS_OPERAND and m.args[_ROWS_OPERAND[m.target]] is source for m in matmuls):
        return None
    return source, matmuls


def _decide(region: Region, order: dict[Node, int]) -> tuple[bool, str]:
    """Split when the collectives left in the open (not fused with a matmul) cost less than the
    all-reduces and all-gathers do now: bytes each rank sends, plus LATENCY_BYTES a collective
    (none for a gather that will ride in a fused one as a passenger). A region from
    all-gathers alone is taken only for a scaled (float8) matmul: casts.py moves a plain cast."""
    if any(isinstance(meta_val(n), (tuple, list)) for n in region.exits):
        return False, "a row-wise op's tuple result is read whole"
    if region.gathers and not region.entries and not any(_feeds_scaled_mm(n) for n in region.exits):
        return False, "no scaled (float8) matmul reads a tensor computed from the gathered one"
    share = (region.world_size - 1) / region.world_size

    def latency_bound(node: Node) -> bool:
        # too few bytes for a fused op to pay for its call (config.split_min_bytes): the matmul
        # beside it is short (a decode step's few tokens, a short prompt), so it saves nothing
        return share * _bytes(node) < config.split_min_bytes

    padded = not divisible(region.tokens, region.world_size)

    def fuses_reduce_scatter(ar: Node) -> bool:  # (padded: the matmuls made again on padded rows)
        if padded:
            return _padded_producer(ar.args[0], region.tokens) is not None
        return _feeds_from_matmul(ar.args[0])

    def fuses_gather(node: Node) -> bool:
        if padded:
            return any(_padded_readers(u, node, region.tokens) for u in region.exits[node])
        return _feeds_matmul(node)

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
            return _decide(region, order)[0]

    low, high = 1, _MOST_TOKENS
    if splits(low) or not splits(high):
        return None
    while high - low > 1:  # splits(high), not splits(low)
        middle = (low + high) // 2
        low, high = (low, middle) if splits(middle) else (middle, high)
    return high


def _per_token_count(region: Region, order: dict[Node, int], split: bool, reason: str) -> tuple[bool, str]:
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
    hosts = [_matmul_readers(n) for n in region.exits if _root(region, n) in fused]
    return {
        node
        for node in plain
        if any(not any(depends_on(node, mm, order) for mm in readers) for readers in hosts)
    }


def _feeds_scaled_mm(node: Node) -> bool:
    """Whether a scaled matmul reads ``node`` (through reshapes) as its rows or their scales."""
    return any(
        (user.target is SCALED_MM and node in (user.args[0], user.args[2]))
        or (user.target in VIEWS and _feeds_scaled_mm(user))
        for user in node.users
    )


def _size(count: float) -> str:
    return f"{count / (1 << 20):.1f} MiB" if count >= 1 << 20 else f"{count / 1024:.1f} KiB"


def _feeds_from_matmul(node: Node) -> bool:
    """Whether ``node`` is a matmul's (or scaled matmul's) result seen through reshapes and adds
    (the reduce-scatter will be fused with it)."""
    while node.target in VIEWS:
        node = node.args[0]
    if node.target is aten.add.Tensor:
        return all(isinstance(a, Node) and _feeds_from_matmul(a) for a in node.args[:2])
    return node.target in _MATMULS or node.target is SCALED_MM


def _root(region: Region, node: Node) -> Node:
    """The region node whose shard ``node`` shares (reshapes between row forms are no ops)."""
    while region.nodes.get(node) == rows.SAME:
        node = node.args[0]
    return node


def record(collective: Node, reason: str | None) -> dict:
    group_name = collective.args[2]
    return {
        "kind": KIND if collective.target is ALL_REDUCE else GATHER_KIND,
        "collective": describe_node(collective),
        "group": {"name": group_name},
        "rewritten": False,
        "reason": reason,
        "implementation": None,
    }


def _region_record(region: Region, all_reduces: list[Node]) -> dict:
    return {
        "rewritten": region.split,
        "reason": None if region.split else region.reason,
        "group": {"name": region.group_name, "size": region.world_size},
        "split": {
            "cost": region.reason,
            "all_reduces": sorted(ar.name for ar in all_reduces),
            "all_gathers": sorted(g.name for g in region.gathers.values()),
            "row_wise_ops": len(region.nodes) - len(region.entries) - len(region.gathers),
            "sliced_operands": sorted(n.name for n in region.sliced),
            "gathered": [
                {
                    **describe_node(n),
                    "fused_with_matmul": _feeds_matmul(n),
                    "read_by": sorted({describe_node(u)["op"] for u in users}),
                }
                for n, users in sorted(region.exits.items(), key=lambda item: item[0].name)
            ],
            "reduced_over_tokens": sorted(n.name for n in region.token_reductions),
            "padded": _padding_note(region),
            "split_from_tokens": region.split_from,
            "in_another_graph": region.split_elsewhere,
        },
    }


def _padding_note(region: Region) -> str | None:
    """How the shards are padded where W does not divide the token count (for every value of
    its symbols), else None."""
    if divisible(region.tokens, region.world_size):
        return None
    return (
        f"{region.tokens} tokens padded with zero rows to a multiple of {region.world_size}: each shard "
        "holds ceil(tokens / W) rows; the padding is sliced off the gathered rows, and reductions "
        "over tokens read the real rows alone"
    )


# ---------------------------------------------------------------------------------------------
# the rewrite


def _random(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


class _Sharder:
    """Builds one region's ops on the shard, each placed before the op it replaces."""

    def __init__(self, graph: Graph, region: Region) -> None:
        self.graph, self.region = graph, region
        world = region.world_size
        # a token count W does not divide (for every value of its symbols): every shard holds
        # ceil(T / W) rows, the last ones zero rows past the real tokens
        self.padded = not divisible(region.tokens, world)
        self.rows = (region.tokens + world - 1) // world if self.padded else region.tokens // world
        self.start = region.rank * self.rows
        self.dead: list[Node] = []  # matmuls made again on padded rows, and their views
        self._padding_args: dict | None = None
        # tensors that stay, whose dims hold the region's symbolic sizes (beside the graph's
        # SymInt inputs): the all-reduced and the gathered tensors' inputs
        self.sources = [ar.args[0] for ars in region.entries.values() for ar in ars]
        self.sources += [g.args[0] for g in region.gathers.values()]
        self.shard: dict[Node, Node] = {}
        self.cut: dict[Node, Node] = {}  # replicated operand -> this rank's rows of it
        self.made: dict[str, Node] = {}
        self.structures: dict[Node, str] = {}

    def entry(self, node: Node) -> Node:
        if node in self.region.gathers:  # the gathered tensor's shard is the collective's input
            shard = self.region.gathers[node].args[0]
            return reshape(self.graph, shard, [self.rows, rows.tensor_shape(shard)[-1]])
        if self.padded:
            terms = [self._padded_term(ar.args[0]) for ar in self.region.entries[node]]
        else:
            terms = [reshape(self.graph, ar.args[0], self._rows_shape(ar)) for ar in self.region.entries[node]]
        summed = terms[0]
        for term in terms[1:]:
            summed = call(self.graph, aten.add.Tensor, (summed, term))
        scattered = call(
            self.graph, REDUCE_SCATTER, (summed, "sum", self.region.world_size, self.region.group_name)
        )
        return call(self.graph, WAIT, (scattered,))

    def _padding(self) -> dict:
        """The padded layout's sizes as graph arguments (ints where static; nodes made once, at
        the first entry, before every use): tokens, rows a shard, this rank's start and end,
        the zero rows added."""
        if self._padding_args is None:
            graph, world, rank = self.graph, self.region.world_size, self.region.rank
            tokens = size_arg(graph, self.region.tokens, self.sources)
            shard_rows = arith(graph, operator.floordiv, arith(graph, operator.add, tokens, world - 1), world)
            self._padding_args = {
                "tokens": tokens,
                "rows": shard_rows,
                "start": arith(graph, operator.mul, shard_rows, rank),
                "end": arith(graph, operator.mul, shard_rows, rank + 1),
                "pad": arith(graph, operator.sub, arith(graph, operator.mul, shard_rows, world), tokens),
            }
        return self._padding_args

    def _pad_rows(self, node: Node) -> Node:
        """A [T, n] tensor with zero rows added to W * ceil(T / W)."""
        return call(self.graph, aten.constant_pad_nd.default, (node, [0, 0, 0, self._padding()["pad"]], 0.0))

    def _padded_term(self, reduced: Node) -> Node:
        """An all-reduced tensor on the padded rows. A matmul's result is made again from its
        rows padded with zeros, so that the reduce-scatter still fuses with a matmul (Inductor
        fuses the padding into the kernel that writes those rows); anything else is padded."""
        found = _padded_producer(reduced, self.region.tokens)
        if found is None:
            return self._pad_rows(reshape(self.graph, reduced, [self.region.tokens, rows.tensor_shape(reduced)[-1]]))
        views, producer = found
        args, position = list(producer.args), _ROWS_OPERAND[producer.target]
        args[position] = self._pad_rows(args[position])
        self.dead += [*views, producer]
        return call(self.graph, producer.target, tuple(args), dict(producer.kwargs))

    def _real_rows(self, shard: Node, reduce_op: str) -> Node:
        """``shard`` with its padding rows set to ``reduce_op``'s identity, so that a reduction
        over the tokens reads the real rows alone (padding rows may hold a bias added, say)."""
        padding, val = self._padding(), meta_val(shard)
        index = call(
            self.graph, torch.ops.prims.iota.default, (padding["rows"],),
            {"start": padding["start"], "step": 1, "dtype": torch.int64, "device": val.device, "requires_grad": False},
        )  # fmt: skip
        real = call(self.graph, aten.lt.Scalar, (index, padding["tokens"]))
        real = call(self.graph, aten.reshape.default, (real, [-1] + [1] * (val.dim() - 1)))
        identity = {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduce_op]
        return call(self.graph, aten.where.ScalarOther, (real, shard, identity))

    def _rows_shape(self, node: Node) -> list[int]:
        shape = rows.tensor_shape(node)
        return [self.region.tokens, shape[-1]]

    def _operand(self, node, out_shape: tuple):
        """An argument of a row-wise op whose output has ``out_shape``, on the shard."""
        if not isinstance(node, Node):
            return node
        if node in self.shard:
            return self.shard[node]
        shape = rows.tensor_shape(node)
        if shape is None:
            return node
        if rows.row_free(shape):
            return reshape(self.graph, node, shape[-1:]) if len(shape) > 1 else node
        if node not in self.cut:
            full = node
            rows_shape = [*out_shape[:-1], shape[-1]]
            if not same_shape(shape, rows_shape):  # broadcast along some rows: make every row explicit
                full = call(self.graph, aten.expand.default, (node, self._sizes(rows_shape)))
            flat = reshape(self.graph, full, [self.region.tokens, shape[-1]])
            if self.padded:  # (Inductor reads the slice of the padding in place)
                flat = self._pad_rows(flat)
                bounds = [self._padding()["start"], self._padding()["end"]]
            else:
                bounds = self._sizes([self.start, self.start + self.rows])
            self.cut[node] = call(self.graph, aten.slice.Tensor, (flat, 0, *bounds))
        return self.cut[node]

    def _sizes(self, sizes) -> list:
        """Sizes as graph arguments: symbolic ones as nodes (sizes.size_arg; a padded shard's
        rows as the node computing them)."""
        return [
            self._padding()["rows"] if self.padded and not is_static(s) and same(s, self.rows)
            else size_arg(self.graph, s, self.sources)
            for s in sizes
        ]  # fmt: skip

    def _call(self, target, args: tuple, kwargs: dict | None = None) -> Node:
        """One node per distinct op on the shard: torchao quantizes a gathered tensor twice
        along the same ops (its forward and its saved copy, each with its own copy of the
        scale's ops), which then share one gather."""
        if _random(target):  # two draws are two values
            return call(self.graph, target, args, kwargs)
        key = repr((target, map_arg((args, kwargs or {}), self._structure)))
        if key not in self.made:
            self.made[key] = call(self.graph, target, args, kwargs)
        return self.made[key]

    def _structure(self, node: Node) -> str:
        """A key that elementwise ops outside the region share when they compute the same
        values from the same nodes."""
        if node not in self.structures:
            if node.op == "call_function" and rows.is_pointwise(node) and not _random(node.target):
                self.structures[node] = repr((node.target, map_arg((node.args, node.kwargs), self._structure)))
            else:
                self.structures[node] = node.name
        return self.structures[node]

    def op(self, node: Node, rule: str) -> Node:
        source = next(a for a in node.all_input_nodes if a in self.shard)
        if rule == rows.SAME:
            return self.shard[source]
        if rule == rows.GETITEM:
            return self._call(operator.getitem, (self.shard[source], node.args[1]))
        if rule == rows.EXPAND:
            return self._call(aten.expand.default, (self.shard[source], self._sizes([self.rows, node.args[1][-1]])))
        if rule == rows.REDUCE_LAST:
            args = (self.shard[source], [-1], *node.args[2:])
            return self._call(node.target, args, dict(node.kwargs))
        out_shape = rows.tensor_shape(node)
        args, kwargs = map_arg((node.args, dict(node.kwargs)), lambda a: self._operand(a, out_shape))
        return self._call(node.target, args, kwargs)

    def across_tokens(self, node: Node) -> Node:
        """A sum, max or min over every token = the shard's, all-reduced with the same op."""
        shard = self.shard[node.args[0]]
        if self.padded:
            shard = self._real_rows(shard, rows.TOKEN_REDUCE_OPS[node.target])
        if len(node.args) == 1:  # over every dim: max.default and the like
            local = self._call(node.target, (shard,), dict(node.kwargs))
        else:  # over the leading dims (the shard's dim 0), or every dim
            every_dim = len(node.args[1]) == len(rows.tensor_shape(node.args[0]))
            dims = [0, 1] if every_dim else [0]
            kwargs = {k: v for k, v in node.kwargs.items() if k != "keepdim"}
            local = self._call(node.target, (shard, dims), kwargs)
        reduced = self._call(ALL_REDUCE, (local, rows.TOKEN_REDUCE_OPS[node.target], self.region.group_name))
        return reshape(self.graph, self._call(WAIT, (reduced,)), meta_val(node).shape)

    def gather_exits(self, order: dict[Node, int]) -> None:
        """All-gathers each region tensor that is read outside, once per shard, right after the
        shard exists; its wait sits before the first reader."""
        outside = self.region.exits
        by_root: dict[Node, list[Node]] = {}
        for node in outside:
            by_root.setdefault(self.shard[node], []).append(node)
        for shard, nodes in by_root.items():
            readers = sorted({u for n in nodes for u in outside[n]}, key=order.__getitem__)
            with self.graph.inserting_after(shard):
                gather = self._all_gather(shard)
            with self.graph.inserting_before(readers[0]):
                gathered = self._gathered(gather, meta_val(shard).dtype)
                real = gathered
                if self.padded:  # the padding rows off
                    real = call(self.graph, aten.slice.Tensor, (gathered, 0, 0, self._padding()["tokens"]))
                for node in nodes:
                    full = reshape(self.graph, real, meta_val(node).shape)
                    # in graph order: the order ``full`` gains its users is the order later
                    # matches list them in, and every rank must build the same collectives
                    # (a set's order differs between processes)
                    for user in sorted(set(outside[node]), key=order.__getitem__):
                        if not (self.padded and self._on_padded_rows(user, node, gathered)):
                            user.replace_input_with(node, full)

    def _on_padded_rows(self, user: Node, node: Node, gathered: Node) -> bool:
        """Where ``user`` reads ``node`` as _padded_readers says: each matmul made again on the
        padded gathered rows and its result sliced to the real ones (a view), so that the
        all-gather fuses with it. Whether it was."""
        found = _padded_readers(user, node, self.region.tokens)
        if found is None:
            return False
        source, matmuls = found
        for matmul in matmuls:
            args = list(matmul.args)
            args[_ROWS_OPERAND[matmul.target]] = gathered
            with self.graph.inserting_before(matmul):
                remade = call(self.graph, matmul.target, tuple(args), dict(matmul.kwargs))
                real = call(self.graph, aten.slice.Tensor, (remade, 0, 0, self._padding()["tokens"]))
            matmul.replace_all_uses_with(real)
            self.dead.append(matmul)
        if source is user:
            self.dead.append(user)
        return True

    def _all_gather(self, shard: Node) -> Node:
        """The all-gather of a [rows, n] shard in the region's layout; float8 moves as bytes
        (gloo has no float8)."""
        layout, world_size = self.region.layout, self.region.world_size
        if layout != FLAT:  # the shard in the gathered tensor's dims, for DTensor's split/cat
            shape = list(layout.shape[:-1]) + [rows.tensor_shape(shard)[-1]]
            shape[layout.dim] //= world_size
            shard = reshape(self.graph, shard, shape)
        if meta_val(shard).dtype.itemsize == 1 and meta_val(shard).dtype != torch.uint8:
            shard = call(self.graph, aten.view.dtype, (shard, torch.uint8))
        return call(self.graph, ALL_GATHER, (shard, world_size, self.region.group_name))

    def _gathered(self, gather: Node, dtype: torch.dtype) -> Node:
        gathered = call(self.graph, WAIT, (gather,))
        layout, world_size = self.region.layout, self.region.world_size
        if layout != FLAT:
            (size,) = self._sizes([rows.tensor_shape(gathered)[0] // world_size])
            pieces = call(self.graph, aten.split.Tensor, (gathered, size))
            chunks = [call(self.graph, operator.getitem, (pieces, i)) for i in range(world_size)]
            gathered = call(self.graph, aten.cat.default, (chunks, layout.dim))
        if meta_val(gathered).dtype != dtype:
            gathered = call(self.graph, aten.view.dtype, (gathered, dtype))
        return gathered


def apply(graph: Graph, split_plan: Plan) -> None:
    """Rewrites every accepted region onto the shard; the all-reduces and the full-size ops
    they fed go."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    dead = []
    for region in split_plan.accepted():
        sharder = _Sharder(graph, region)
        for node in sorted([*region.nodes, *region.token_reductions], key=order.__getitem__):
            with graph.inserting_before(node):
                if node in region.entries or node in region.gathers:
                    sharder.shard[node] = sharder.entry(node)
                elif node in region.nodes:
                    sharder.shard[node] = sharder.op(node, region.nodes[node])
                else:
                    node.replace_all_uses_with(sharder.across_tokens(node))
        sharder.gather_exits(order)
        dead += [*region.nodes, *region.token_reductions, *region.absorbed, *sharder.dead]
    erase_dead(graph, dead)
