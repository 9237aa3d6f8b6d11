"""The graph edits every rewriting stage makes: a node added with the fake value Inductor's
lowering reads, a reshape spelled with symbolic sizes, and erasing what nothing reads any more;
and a copy of a graph to restore where a stage's edits fail (pipeline/stages.py).
"""

import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from .nodes import graph_order
from .sizes import same_shape, shape_arg

aten = torch.ops.aten


def call(graph: Graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    """Adds a call_function node and fills its meta["val"] by running ``target`` on fake
    tensors, as Inductor's lowering needs it."""
    node = graph.call_function(target, args, kwargs)
    vals, kwvals = map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    if target is operator.getitem:
        node.meta["val"] = target(*vals)
    else:
        flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
        with detect_fake_mode(flat):
            node.meta["val"] = target(*vals, **kwvals)
    if torch.Tag.needs_exact_strides in getattr(target, "tags", ()):
        # Inductor pins such an op's inputs to these strides only where the node carries them;
        # a node inserted by a custom pass without them keeps inputs of flexible layout, which
        # a fused kernel may store in another order than the op (a _scaled_mm: cuBLASLt) accepts
        node.meta["eager_input_vals"] = (vals, kwvals)
    return node


def reshape(graph: Graph, node: Node, shape, sources=()) -> Node:
    """``node`` reshaped to ``shape``, whose symbolic sizes (if any) ``node`` or ``sources``
    hold in some dim (sizes.shape_arg)."""
    if same_shape(tuple(node.meta["val"].shape), tuple(shape)):
        return node
    return call(graph, aten.reshape.default, (node, shape_arg(graph, shape, (node, *sources))))


def erase_dead(graph: Graph, nodes) -> None:
    """Erases ``nodes`` that nothing reads any more, consumers before producers."""
    order = graph_order(graph)
    for node in sorted(set(nodes), key=lambda n: order.get(n, -1), reverse=True):
        if node.graph is graph and node in order and not node.users:
            graph.erase_node(node)


def copy_graph(graph: Graph) -> Graph:
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def restore_graph(graph: Graph, snapshot: Graph) -> None:
    """Makes ``graph`` hold the nodes of ``snapshot`` again. A failed rewrite can leave the
    graph unsorted, so every node lets go of its inputs before any is erased."""
    nodes = list(graph.nodes)
    for node in nodes:
        node.args, node.kwargs = (), {}
    for node in nodes:
        graph.erase_node(node)
    graph.output(graph.graph_copy(snapshot, {}))
