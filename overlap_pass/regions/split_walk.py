"""plan(graph): the regions of the all-reduce split (split_regions.py), found by a walk of the
graph and decided.

Each region starts at an all-reduce (or a sum of them) or at an all-gather no matmul reads
directly, and grows along row-wise ops (rows.py) in graph order; regions that meet merge.
Nothing here mutates the graph.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.fx import Graph, Node

from ..graph.nodes import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, graph_order, meta_val
from ..graph.sizes import is_static, same_shape
from ..fusion.layouts import gathered_layout
from ..fusion.matches import NoMatch
from . import rows
from .split_cost import decide, per_token_count
from .split_records import record, with_region
from .split_regions import ENTRY, FLAT, Layout, Region, feeds_matmul, feeds_scaled_mm, random

aten = torch.ops.aten


# ops whose output differs between ranks in plain TP although their inputs may not
_RANK_LOCAL = (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_mm.default, aten.convolution.default,
)  # fmt: skip


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
        elif random(target):
            local.add(node)
        elif any(arg in local for arg in node.all_input_nodes):
            local.add(node)
    return local


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
    if dim == len(shape) - 1 or feeds_matmul(gathered):
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
        region.split, region.reason = decide(region, order)
        if isinstance(region.tokens, torch.SymInt) and not is_static(region.tokens):
            region.split, region.reason = per_token_count(region, order, region.split, region.reason)
        merged = [ar for ars in region.entries.values() for ar in ars]
        for ar in merged:
            with_region(records[ar], region, merged)
        if any(feeds_scaled_mm(n) for n in region.exits):  # else no float8 candidate: no record
            for gather in region.gathers.values():
                records[gather] = with_region(record(gather, None), region, merged)
    return Plan(tuple(found), records)


def _all_alike(kinds: list[tuple]) -> bool:
    """Whether tuples of (a name, a shape, ...) are equal, shapes for every value of their
    symbols."""
    first = kinds[0]
    return all(
        all(same_shape(x, y) if isinstance(x, tuple) else x == y for x, y in zip(kind, first)) for kind in kinds[1:]
    )
