"""Before anything else: each collective read through one wait_tensor.

Every stage after this one reads a collective's result through its single wait (fusion/'s
matchers, casts.py, the all-reduce split's split_walk.py, passengers.py). A graph may wait on
one collective more than once: torch 2.15 leaves one all-gather with a wait_tensor for each of
its readers in a backward graph (DeepSeek-V3's MoE layer: the output gradient, gathered for the
shared experts and for the routed ones), each wait followed by its own slices and cat of the
gathered ranks. A wait may also wait on another wait. Once the first wait has returned, the
later ones are no-ops on the same tensor (Inductor drops them itself, in
deduplicate_wait_tensors, but only after this pass has run), so

    g = all_gather(x);  a = wait(g);  b = wait(g)  [or wait(a)];  f(a);  h(b)
becomes
    g = all_gather(x);  a = wait(g);  f(a);  h(a)

and the data movement that rebuilt the same layout from the later waits (the same slice, split,
cat, view of the same tensor) is merged into the first wait's, so that the gathered tensor is
built once and the matchers see all of its readers. Nothing else changes.
"""

import operator

import torch
from torch.fx import Graph, Node

from ..graph.nodes import SPLITS, VIEWS, WAIT, graph_order

aten = torch.ops.aten

# ops that only move or cut the values they read: the same op on the same inputs is the same value
_DATA_MOVEMENT = (
    *VIEWS, *SPLITS, operator.getitem, aten.slice.Tensor, aten.cat.default, aten.permute.default,
    aten.t.default,
)  # fmt: skip


def _waited(wait: Node):
    """What ``wait`` waits for, through waits of waits."""
    value = wait.args[0]
    while isinstance(value, Node) and value.target is WAIT:
        value = value.args[0]
    return value


def plan(graph: Graph) -> dict[Node, list[Node]]:
    """{value: its waits, the first first} for each value waited on more than once (nothing is
    changed here)."""
    by_value: dict[Node, list[Node]] = {}
    for wait in graph.find_nodes(op="call_function", target=WAIT):  # in graph order
        by_value.setdefault(_waited(wait), []).append(wait)
    return {value: found for value, found in by_value.items() if len(found) > 1}


def apply(graph: Graph, repeated: dict[Node, list[Node]]) -> None:
    """Merges the later waits of each value of ``repeated`` (plan's) into its first, and the
    data movement they led to into the first's."""
    for first, *later in repeated.values():
        for wait in later:  # a wait of a later wait reads the first once that one is replaced
            wait.replace_all_uses_with(first)
            graph.erase_node(wait)
        _merge_same_data_movement(graph, first)


def _frozen(value):
    """``value`` (node arguments) with lists as tuples, so that equal arguments hash equal."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _key(node: Node):
    key = (node.target, _frozen(node.args), _frozen(node.kwargs))
    try:
        hash(key)
    except TypeError:  # an argument that cannot be compared (e.g. a symbolic size): kept apart
        return None
    return key


def _merge_same_data_movement(graph: Graph, source: Node) -> None:
    """Merges each node of data movement reached from ``source`` that repeats an earlier one
    (the same op on the same inputs) into that earlier node. In graph order, so that a node's
    inputs are merged before the node itself is compared."""
    reached, first_of = {source}, {}
    start = graph_order(graph)[source]
    for node in list(graph.nodes)[start + 1 :]:
        if node.target not in _DATA_MOVEMENT or not any(n in reached for n in node.all_input_nodes):
            continue
        key = _key(node)
        earlier = first_of.get(key) if key is not None else None
        if earlier is None:
            if key is not None:
                first_of[key] = node
            reached.add(node)
        else:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
