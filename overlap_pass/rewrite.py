"""rewrite_*: the only module that edits graphs.

Operands are read from the live graph (the collective and matmul nodes), not from the frozen
match, so that rewriting one end of a back-to-back chain never leaves the other end's match
pointing at an erased node.
"""

import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from . import ops  # noqa: F401  (registers torch.ops.overlap)
from .patterns import (
    AllGatherMatmulMatch,
    Match,
    MatmulReduceScatterMatch,
    depends_on,
    graph_order,
)

aten = torch.ops.aten


def _call(graph: Graph, target, args: tuple) -> Node:
    """Adds a call_function node and fills its meta["val"] by running ``target`` on fake
    tensors, as Inductor's lowering needs it."""
    node = graph.call_function(target, args)
    vals = map_arg(args, lambda n: n.meta["val"])
    if target is operator.getitem:
        node.meta["val"] = target(*vals)
    else:
        flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
        with detect_fake_mode(flat):
            node.meta["val"] = target(*vals)
    return node


def _reshape(graph: Graph, node: Node, shape) -> Node:
    if tuple(node.meta["val"].shape) == tuple(shape):
        return node
    return _call(graph, aten.reshape.default, (node, list(shape)))


def _mm_operands(mm: Node) -> tuple[Node, Node, Node | None]:
    """(rows, mat2, bias) of an aten.mm or aten.addmm node."""
    if mm.target is aten.addmm.default:
        return mm.args[1], mm.args[2], mm.args[0]
    return mm.args[0], mm.args[1], None


def _erase_dead(graph: Graph, nodes) -> None:
    """Erases ``nodes`` that nothing reads any more, consumers before producers."""
    order = graph_order(graph)
    for node in sorted(set(nodes), key=lambda n: order.get(n, -1), reverse=True):
        if node.graph is graph and node in order and not node.users:
            graph.erase_node(node)


def _chain(start: Node, stop: Node) -> list[Node]:
    """Nodes from ``start`` back to ``stop`` along first arguments, plus split outputs."""
    nodes, node = [], start
    while node is not stop and isinstance(node, Node) and node.args:
        nodes.append(node)
        if node.target is aten.cat.default:
            nodes += list(node.args[0])
            node = node.args[0][0].args[0]  # getitem -> split
            continue
        node = node.args[0]
    return nodes + [stop]


def would_create_cycle(match: Match) -> bool:
    """Whether the op would read a value computed from its own result, on the graph as it is
    now (after the rewrites before it, sorted): the inputs of an all-gather op must not depend
    on the all-gather. A reduce-scatter's nodes form a single-user chain, which cannot close a
    loop."""
    if not isinstance(match, AllGatherMatmulMatch):
        return False
    inputs = [match.gather.args[0]]
    for use in match.matmuls:
        _, mat2, bias = _mm_operands(use.mm)
        inputs += [mat2] + ([bias] if bias is not None else [])
    order = graph_order(match.gather.graph)
    return any(depends_on(node, match.gather, order) for node in inputs)


def rewrite_all_gather_matmul(graph: Graph, match: AllGatherMatmulMatch) -> Node:
    """
        g = wait(all_gather(shard)) [-> split -> cat(gather_dim)]
        y_i = mm(reshape(g), w_i) (+ b_i)
    becomes
        g, ys = overlap.all_gather_matmul(shard, [w_i], [b_i], gather_dim, ...)
        y_i = reshape(ys[i])
    """
    shard = match.gather.args[0]
    operands = [_mm_operands(use.mm) for use in match.matmuls]
    first_mm = min((use.mm for use in match.matmuls), key=graph_order(graph).__getitem__)
    return_gathered = bool(match.other_users)
    dead = [use.mm for use in match.matmuls] + _chain(match.gathered, match.gather)
    for rows, _, _ in operands:
        dead += _chain(rows, match.gathered)
    with graph.inserting_before(first_mm):
        op = _call(
            graph,
            torch.ops.overlap.all_gather_matmul.default,
            (
                shard,
                [mat2 for _, mat2, _ in operands],
                [bias for _, _, bias in operands],
                match.gather_dim,
                match.world_size,
                match.group_name,
                return_gathered,
            ),
        )
        outputs = _call(graph, operator.getitem, (op, 1))
        for index, use in enumerate(match.matmuls):
            out = _call(graph, operator.getitem, (outputs, index))
            use.mm.replace_all_uses_with(_reshape(graph, out, use.mm.meta["val"].shape))
        if return_gathered:
            match.gathered.replace_all_uses_with(_call(graph, operator.getitem, (op, 0)))

    _erase_dead(graph, dead)
    return op


def rewrite_matmul_reduce_scatter(graph: Graph, match: MatmulReduceScatterMatch) -> Node:
    """
        y = mm(a, w) (+ b)
        z = wait(reduce_scatter([split(scatter_dim) -> cat] reshape(y)))
    becomes
        z = overlap.matmul_reduce_scatter([reshape(a)], [w], b, reduce_op, scatter_dim, ...)
    """
    rows, mat2, bias = _mm_operands(match.mm)
    dead = _chain(match.wait, match.mm)
    scattered_shape = match.scattered.meta["val"].shape
    with graph.inserting_before(match.mm):
        a = _reshape(graph, rows, list(scattered_shape[:-1]) + [rows.meta["val"].shape[-1]])
        op = _call(
            graph,
            torch.ops.overlap.matmul_reduce_scatter.default,
            (
                [a],
                [mat2],
                bias,
                match.reduce_op,
                match.scatter_dim,
                match.world_size,
                match.group_name,
            ),
        )
    match.wait.replace_all_uses_with(op)
    _erase_dead(graph, dead)
    return op

