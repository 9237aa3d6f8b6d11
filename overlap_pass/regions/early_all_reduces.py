"""After the rewrites: small all-reduces that the graph's inputs alone determine, coalesced into
one collective per (reduce op, dtype, group).

Float8 training under tensor parallelism (torchao's Float8Linear, rowwise and tensorwise) adds
an all-reduce of an amax for every weight sharded along the dim its scale spans, and for each
gathered activation whose scale spans its tokens. Each moves a few KiB and costs what any
collective costs on the host (an NCCL enqueue, its work object, a wait): in a forward and
backward of one block, some twenty of them, on steps whose queuing time is their GPU time.
Those whose input is computed from graph inputs only (parameters, the block's input, the
backward's tangents and saved tensors) can all run at the first one's place:

    m1 = all_reduce(amax(|w1|), max);  ...;  m2 = all_reduce(amax(|w2|), max)
becomes
    m = all_reduce(cat([amax(|w1|), amax(|w2|)]), max);  m1, m2 = slices of m

Max, min and sum over ranks act element by element, so each slice holds what its own
all-reduce held, bit for bit (a sum is added in whatever order NCCL picks for either). A max or
min of floats of several types runs in float64, to which each widens exactly and from which
the result narrows exactly (bf16 amaxes next to float64 ones, say). The inputs' computations
move up to the first all-reduce with them (only where nothing else reads them, so no tensor
stays alive longer, and no matmul or attention among them); nothing else moves. Every rank
compiles the same graph, so every rank issues the same collectives in the same order.
"""

import torch
from torch.fx import Graph, Node

from ..graph.edits import call
from ..graph.nodes import ALL_REDUCE, WAIT, describe_node, meta_val

aten = torch.ops.aten
SMALL_BYTES = 1 << 20  # an all-reduce this size or under is all latency: merging it is free
# what never moves up with an all-reduce: matmuls and attention, whose place in the schedule
# (next to a collective in flight) matters more than one collective's host cost
_HEAVY = {
    getattr(aten, name).default
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(aten, name)  # each torch release has its own attention kernels
}
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "overlap", "symm_mem")


def _moves_with_inputs(node: Node) -> bool:
    """Whether ``node`` may run anywhere after its inputs: a pure op that is neither a
    collective nor random."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return node.op == "call_function" and node.target.__module__ == "_operator"
    if node.target.namespace in _COLLECTIVE_NAMESPACES:
        return False
    return torch.Tag.nondeterministic_seeded not in node.target.tags and not node.is_impure()


def _early_nodes(graph: Graph) -> set[Node]:
    """The nodes computed from graph inputs alone, through ops that may move
    (_moves_with_inputs)."""
    early = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            early.add(node)
        elif _moves_with_inputs(node) and all(i in early for i in node.all_input_nodes):
            early.add(node)
    return early


def _small_static(node: Node) -> bool:
    val = meta_val(node)
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return False
    return val.numel() * val.element_size() <= SMALL_BYTES


def plan(graph: Graph) -> list[list[Node]]:
    """Groups of two or more all-reduces (each with its one wait) to coalesce, each group in
    graph order: same reduce op, dtype (any float width for max and min) and group; inputs
    computed from graph inputs alone, of static shapes, at most SMALL_BYTES. A later one joins
    only where what moves up with it is no matmul or attention (_HEAVY), keeps no large tensor
    alive longer (_private) and passes no write (an input mutation)."""
    early = _early_nodes(graph)
    groups: dict[tuple, list[Node]] = {}
    for node in graph.find_nodes(op="call_function", target=ALL_REDUCE):
        source, reduce_op, group_name = node.args[:3]
        users = list(node.users)
        if len(users) != 1 or users[0].target is not WAIT or source not in early or not _small_static(source):
            continue
        dtype = meta_val(source).dtype
        widens = reduce_op in ("max", "min") and dtype.is_floating_point
        groups.setdefault((reduce_op, "float" if widens else dtype, group_name), []).append(node)
    order = {node: i for i, node in enumerate(graph.nodes)}
    writes = [order[n] for n in graph.nodes if _writes(n)]
    merged = []
    for found in groups.values():
        found.sort(key=order.__getitem__)

        def movable(node: Node) -> bool:
            moving = _ancestors_after(node.args[0], found[0], order)
            # a read moved up past a write to its input would read the value from before it
            last = max((order[n] for n in moving), default=order[found[0]])
            light = not any(n.target in _HEAVY or n.op != "call_function" for n in moving)
            return light and _private(moving, node) and not any(order[found[0]] < w < last for w in writes)

        kept = found[:1] + [node for node in found[1:] if movable(node)]
        if len(kept) > 1:
            merged.append(kept)
    return merged


def _writes(node: Node) -> bool:
    """Whether ``node`` writes into a tensor (a mutable op, as a graph's input mutations are)."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _private(moving: set[Node], all_reduce: Node) -> bool:
    """Whether moving these nodes up with ``all_reduce`` keeps no large tensor alive longer: each
    feeds nothing else, or is small, or is a view of a graph input (alive anyway)."""
    return all(
        _small_static(node) or _views_an_input(node) or all(u in moving or u is all_reduce for u in node.users)
        for node in moving
    )


def _views_an_input(node: Node) -> bool:
    while isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def _ancestors_after(node: Node, position: Node, order: dict) -> set[Node]:
    """``node`` and the nodes it is computed from that sit after ``position`` (placeholders
    never do)."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in found or order[current] <= order[position]:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes)
    return found


PRIMS_CONVERT = torch.ops.prims.convert_element_type.default


def _flat(graph: Graph, node: Node, dtype: torch.dtype) -> Node:
    flat = call(graph, aten.reshape.default, (node, [-1]))
    return flat if meta_val(node).dtype == dtype else call(graph, PRIMS_CONVERT, (flat, dtype))


def apply(graph: Graph, groups: list[list[Node]]) -> list[dict]:
    """Coalesces each group at its first all-reduce's place; returns a record per group: the
    merged collective, the all-reduces it replaced, its reduce op and its elements."""
    records = []
    for all_reduces in groups:
        first = all_reduces[0]
        # found again, not taken from plan: an earlier group may have moved some of them up
        order = {node: i for i, node in enumerate(graph.nodes)}
        moving = set()
        for node in all_reduces[1:]:
            moving |= _ancestors_after(node.args[0], first, order)
        for node in sorted(moving, key=order.__getitem__):  # in order, so inputs come first
            first.prepend(node)
        waits = [next(iter(node.users)) for node in all_reduces]
        reduce_op, group_name = first.args[1], first.args[2]
        dtypes = {meta_val(node.args[0]).dtype for node in all_reduces}
        wide = dtypes.pop() if len(dtypes) == 1 else torch.float64  # holds every float exactly
        with graph.inserting_before(first):
            flats = [_flat(graph, node.args[0], wide) for node in all_reduces]
            joined = call(graph, aten.cat.default, (flats,))
            merged = call(graph, ALL_REDUCE, (joined, reduce_op, group_name))
            done = call(graph, WAIT, (merged,))
            start = 0
            for node, wait in zip(all_reduces, waits):
                val = meta_val(node.args[0])
                piece = call(graph, aten.slice.Tensor, (done, 0, start, start + val.numel()))
                start += val.numel()
                if val.dtype != wide:
                    piece = call(graph, PRIMS_CONVERT, (piece, val.dtype))
                wait.replace_all_uses_with(call(graph, aten.reshape.default, (piece, list(val.shape))))
        for node, wait in zip(all_reduces, waits):
            graph.erase_node(wait)
            graph.erase_node(node)
        records.append(
            {
                "collective": describe_node(merged),
                "group": {"name": group_name},
                "all_reduces": [n.name for n in all_reduces],
                "reduce_op": reduce_op,
                "elements": start,
            }
        )
    return records
