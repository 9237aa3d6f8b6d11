"""After the fused rewrites: independent matmuls run in a reduce-scatter op's tail.

A matmul -> reduce-scatter op ends by summing its chunk's partials, and the last partial to
arrive left its peer as the peer's last matmul finished: the op waits for that transfer with
nothing to compute. A backward graph holds matmuls that read nothing of the op's result and
that the op does not read: the weight gradients of the same linears (x^T @ dy), computed anyway.
Queued inside the op, after its partials and before its sum, they run while the last partials
travel (lowering/matmul_reduce_scatter.py):

    out = overlap.matmul_reduce_scatter(...)                 (out, [g]) = overlap.matmul_reduce_scatter
    g = aten.mm(a, b)          # independent        ->                     .tail(..., [a], [b])

Taken: 2-D aten.mm nodes that are neither an input of the op (transitively) nor computed from
its result, whose operands exist before the op in graph order, and that sit between the overlap
ops either side of it (a whole model's backward: the same layer's, so no activation of another
layer is kept alive longer); nearest the op first, while their FLOPs stay within the op's own
(its tail needs far less; more would only keep its result waiting), each in one op. What read a taken matmul now reads the op's output for it (and comes
after the op). float8 ops keep their tails: their weight gradients are scaled matmuls.
"""

import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from ..debug import describe_node
from ..fusion import sizes
from ..fusion.patterns import graph_order
from ..fusion.rewrite import call

OP = torch.ops.overlap.matmul_reduce_scatter.default
TAIL_OP = torch.ops.overlap.matmul_reduce_scatter.tail
MM = torch.ops.aten.mm.default


def _flops(rows_shapes, mat2_shapes) -> int:
    return sum(2 * sizes.hint(sizes.prod(r[:-1])) * sizes.hint(r[-1]) * sizes.hint(m[1]) for r, m in zip(rows_shapes, mat2_shapes))


def _shape(node: Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _closure(start: Node, step) -> set[Node]:
    """Every node reachable from ``start`` through ``step(node)`` (its inputs, or its users)."""
    seen, stack = set(), [start]
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _tail_for(op: Node, free: list[Node], order: dict[Node, int], overlap_ops: list[int]) -> list[Node]:
    """The matmuls of ``free`` that ``op`` takes (module docstring), nearest first;
    ``overlap_ops``: the graph positions of every overlap op, sorted."""
    inputs, mat2s = op.args[0], op.args[1]
    most = _flops([_shape(a) for a in inputs], [_shape(m) for m in mat2s])
    tied = _closure(op, lambda n: n.all_input_nodes) | _closure(op, lambda n: n.users)
    here = order[op]
    after = max((p for p in overlap_ops if p < here), default=-1)
    before = min((p for p in overlap_ops if p > here), default=len(order))
    taken, spent = [], 0
    for mm in sorted(free, key=lambda n: abs(order[n] - here)):
        if not after < order[mm] < before or mm in tied or any(order[a] > here for a in mm.all_input_nodes):
            continue
        cost = _flops([_shape(mm.args[0])], [_shape(mm.args[1])])
        if spent + cost > most:
            continue
        taken.append(mm)
        spent += cost
    return sorted(taken, key=order.get)


def _is_overlap_op(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "overlap"


def _is_plain_mm(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bfloat16, torch.float16, torch.float32)


def take_all(graph: Graph) -> dict[str, dict]:
    """Moves matmuls into the reduce-scatter ops' tails (module docstring); returns, per op
    node name it replaced, {"op": the new node's name, "tail_matmuls": [described matmuls]}."""
    results = {}
    for op in list(graph.find_nodes(op="call_function", target=OP)):
        free = [n for n in graph.find_nodes(op="call_function", target=MM) if _is_plain_mm(n)]
        order = graph_order(graph)
        overlap_ops = sorted(order[n] for n in graph.nodes if _is_overlap_op(n))
        taken = _tail_for(op, free, order, overlap_ops)
        if taken:
            results[op.name] = {"op": _replace(graph, op, taken).name, "tail_matmuls": [describe_node(mm) for mm in taken]}
            stable_topological_sort(graph)  # a taken matmul's readers that sat before the op move after it
    return results


def _replace(graph: Graph, op: Node, taken: list[Node]) -> Node:
    """``op`` and the matmuls ``taken`` as one ``.tail`` node at the op's place; returns it."""
    out_dtype = op.args[7] if len(op.args) > 7 else op.kwargs.get("out_dtype")
    with graph.inserting_before(op):
        fused = call(graph, TAIL_OP, (*op.args[:7], out_dtype, [mm.args[0] for mm in taken], [mm.args[1] for mm in taken]))
        out = call(graph, operator.getitem, (fused, 0))
        outs = call(graph, operator.getitem, (fused, 1))
        for i, mm in enumerate(taken):
            mm.replace_all_uses_with(call(graph, operator.getitem, (outs, i)))
    op.replace_all_uses_with(out)
    for node in (op, *taken):
        graph.erase_node(node)
    return fused
