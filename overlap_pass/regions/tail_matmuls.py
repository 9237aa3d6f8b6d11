"""After the fused rewrites: the weight gradients of a reduce-scatter op's linears run in its tail.

A matmul -> reduce-scatter op ends by summing its chunk's partials, and the last partial to
arrive left its peer as the peer's last matmul finished: the op waits for that transfer with
nothing to compute. In a backward graph the op's inputs are output gradients dy of linears
whose input gradients it reduce-scatters, and their weight gradients contract the same dy over
the tokens, dy^T @ x, computed anyway and reading nothing of the op's result. Queued inside the
op, after its partials and before its sum, they run while the last partials travel
(lowering/matmul_reduce_scatter.py):

    out = overlap.matmul_reduce_scatter([dq, dk, dv], ...)        (out, [gq, gk, gv]) =
    gq = aten.mm(t(dq'), x)     # dq': dq's rows        ->          overlap.matmul_reduce_scatter
    ...                                                               .tail(..., [0, 1, 2], [x, x, x])

Taken: an aten.mm whose left operand is the transpose of a 2-D view of one of the op's inputs
(the same rows: a view of the same result) and whose right operand is computed before the op and
not from its result. The op gets the input's index, not the view: Inductor stores each argument
of an op apart, and a second view of a result the op already reads would be stored again.
What read a taken matmul now reads the op's output for it (and comes after the op). float8's
reduce-scatters keep their weight gradients outside: those are scaled matmuls. Off unless
config.tail_matmuls: the GEMMs slow the transfers they run beside about as much as they hide.
"""

import operator

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from ..graph import sizes
from ..graph.edits import call
from ..graph.nodes import describe_node, graph_order, is_transpose, under_views
from ..ops import registry  # noqa: F401  (registers torch.ops.overlap)

OP = torch.ops.overlap.matmul_reduce_scatter.default
TAIL_OP = torch.ops.overlap.matmul_reduce_scatter.tail
MM = torch.ops.aten.mm.default


def _shape(node: Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _input_index(left: Node, inputs: list[Node]) -> int | None:
    """The op input whose rows ``left`` transposes (``t(view of it)``), if any."""
    if left.op != "call_function" or not is_transpose(left):
        return None
    rows = left.args[0]
    for i, inp in enumerate(inputs):
        shape = _shape(inp)
        if under_views(inp) is under_views(rows) and sizes.same_shape((sizes.prod(shape[:-1]), shape[-1]), _shape(rows)):
            return i
    return None


def reachable(node: Node, step) -> set[Node]:
    """Every node reached from ``node`` through ``step`` (a node's users, or its inputs)."""
    seen, stack = set(), [node]
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _tail_of(op: Node, order: dict[Node, int]) -> list[tuple[Node, int]]:
    """(matmul, the op input it contracts) for each weight gradient the op takes (module
    docstring), in graph order."""
    inputs = op.args[0]
    after = reachable(op, lambda n: n.users)
    before = reachable(op, lambda n: n.all_input_nodes)
    taken = {}
    for base in {under_views(inp) for inp in inputs}:
        for mm in reachable(base, lambda n: n.users):
            if mm.op != "call_function" or mm.target is not MM or mm in taken or mm in before:
                continue
            index, right = _input_index(mm.args[0], inputs), mm.args[1]
            if index is not None and isinstance(right, Node) and right not in after and order[right] < order[op]:
                taken[mm] = index
    return sorted(taken.items(), key=lambda pair: order[pair[0]])


def take_all(graph: Graph) -> dict[str, dict]:
    """Moves the weight gradients into the reduce-scatter ops' tails (module docstring);
    returns, per op node name it replaced, {"op": the new node's name, "tail_matmuls":
    [described matmuls]}."""
    results = {}
    for op in list(graph.find_nodes(op="call_function", target=OP)):
        taken = _tail_of(op, graph_order(graph))
        if taken:
            described = [describe_node(mm) for mm, _ in taken]
            results[op.name] = {"op": _replace(graph, op, taken).name, "tail_matmuls": described}
            stable_topological_sort(graph)  # a taken matmul's readers that sat before the op move after it
    return results


def _replace(graph: Graph, op: Node, taken: list[tuple[Node, int]]) -> Node:
    """``op`` and the matmuls ``taken`` as one ``.tail`` node at the op's place; returns it."""
    out_dtype = op.args[7] if len(op.args) > 7 else op.kwargs.get("out_dtype")
    tail_args = ([index for _, index in taken], [mm.args[1] for mm, _ in taken])
    with graph.inserting_before(op):
        fused = call(graph, TAIL_OP, (*op.args[:7], out_dtype, *tail_args))
        out = call(graph, operator.getitem, (fused, 0))
        outs = call(graph, operator.getitem, (fused, 1))
        for i, (mm, _) in enumerate(taken):
            mm.replace_all_uses_with(call(graph, operator.getitem, (outs, i)))
    op.replace_all_uses_with(out)
    for node in (op, *(mm for mm, _ in taken)):
        graph.erase_node(node)
    return fused
