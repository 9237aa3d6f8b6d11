"""Sizes that may be symbolic: compared without guards, and spelled as graph arguments.

After torch.compile's automatic dynamic recompile (or ``mark_dynamic``), the token dims of the
activations are SymInts (s0, 2*s0, ...) while the weights' stay ints. Comparing SymInts with
``==`` installs a guard on the shape environment; a pattern test must not (it would tie the
graph to the sizes of the call that compiled it), so every comparison here asks whether the
answer is known for all sizes, and a match that cannot be proven is not taken.
"""

import contextlib
import math
import operator

import sympy
import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def is_static(size) -> bool:
    """An int, or a SymInt whose value is a constant (rank 0's first row, 0 * s0): ranks whose
    sizes differ only there must build the same graph, as their collectives must match."""
    return isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.expr.is_number)


def static_shape(shape) -> bool:
    return all(is_static(s) for s in shape)


def same(a, b) -> bool:
    """``a == b`` for every value of the symbols (ints compare as ints)."""
    if is_static(a) and is_static(b):
        return int(a) == int(b)
    return statically_known_true(a == b)


def same_shape(a, b) -> bool:
    """Two shapes (or None) equal dim by dim for every value of the symbols."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def divisible(size, by: int) -> bool:
    """``size % by == 0`` for every value of the symbols (``2*s0`` by 2: yes; ``s0`` by 2: not
    known)."""
    return same(size % by, 0)


def prod(shape):
    return math.prod(int(s) for s in shape) if static_shape(shape) else math.prod(shape, start=1)


# symbol -> the value cost models read for it instead of its traced one (judged_at)
_JUDGED: dict = {}


@contextlib.contextmanager
def judged_at(values: dict):
    """Cost models (``hint``) read the symbols of ``values`` (sympy symbol -> int) at those
    values: how a region is judged at token counts other than the traced one."""
    kept = dict(_JUDGED)
    _JUDGED.update(values)
    try:
        yield
    finally:
        _JUDGED.clear()
        _JUDGED.update(kept)


def hint(size, fallback: int = 4096) -> int:
    """An int for a cost model: the size itself, or the value a symbolic size had when the
    graph was traced (or is judged at: ``judged_at``)."""
    if is_static(size):
        return int(size)
    if _JUDGED:
        expr = substituted(size.node.expr, _JUDGED)
        if not expr.is_number:
            expr = substituted(expr, traced_values(size.node.shape_env))
        if expr.is_number:
            return int(expr)
    value = getattr(size.node, "hint", None)
    return int(value) if value is not None else fallback


def substituted(expr: sympy.Expr, values: dict) -> sympy.Expr:
    """``expr`` with ``values`` (symbol -> value) put in, as a sympy expression: xreplace hands
    back a value as it is given (an int) where it replaces the whole of ``expr``, a bare symbol."""
    return sympy.sympify(expr.xreplace(values))


def traced_values(shape_env) -> dict:
    """symbol -> the value it had when the graph was traced (``backed_var_to_val`` from torch
    2.13 on, ``var_to_val`` before)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


def size_arg(graph: Graph, size, sources):
    """``size`` as a graph argument: an int, or a node holding it (as shape_arg finds one)."""
    return int(size) if is_static(size) else _size_node(graph, size, sources)


def shape_arg(graph: Graph, shape, sources) -> list:
    """``shape`` as a reshape's argument in ``graph``: ints as they are; one symbolic dim as -1;
    several as nodes holding their values: a SymInt input of the graph, or a dim of one of the
    ``sources`` (tensor nodes) read with aten.sym_size, times an int where the size is a
    multiple of it. ValueError where no such node is found (the rewrite then leaves the graph
    as it was)."""
    symbolic = [i for i, s in enumerate(shape) if not is_static(s)]
    if len(symbolic) <= 1:
        return [-1 if i in symbolic else int(s) for i, s in enumerate(shape)]
    return [size_arg(graph, s, sources) for s in shape]


def arith(graph: Graph, target, a, b):
    """``target(a, b)`` (operator.add, floordiv, mul, sub) of sizes that are ints or nodes
    holding SymInts: an int where both are, else a node computing it in the graph."""
    if not isinstance(a, Node) and not isinstance(b, Node):
        return target(a, b)
    if target is operator.mul and b in (0, 1):  # (rank 0's first row, rank 0's end)
        return 0 if b == 0 else a
    value = target(*(x.meta["val"] if isinstance(x, Node) else x for x in (a, b)))
    return _new(graph, target, (a, b), value)


def _held_sizes(graph: Graph, sources):
    """(SymInt, how to make its node) for the graph's SymInt inputs and the symbolic dims of
    ``sources``."""
    for node in graph.find_nodes(op="placeholder"):  # (defined before any insertion point)
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            yield val, lambda node=node: node
    for source in sources:
        val = source.meta.get("val")
        for dim, held in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if not is_static(held):
                yield held, lambda source=source, dim=dim, held=held: _new(graph, aten.sym_size.int, (source, dim), held)


def _size_node(graph: Graph, size, sources) -> Node:
    symbols = {}
    for held, make in _held_sizes(graph, sources):
        if same(held, size):
            return make()
        ratio = size.node.expr / held.node.expr  # (sympy's own evaluation: 2*s0 / s0 is 2)
        if ratio.is_Integer and ratio > 0:
            return _new(graph, operator.mul, (make(), int(ratio)), size)
        if held.node.expr.is_Symbol:
            symbols.setdefault(held.node.expr, make)
    # a product or sum of held symbols (batch * sequence, both symbolic): computed in the graph
    built = _built(graph, size.node.expr, symbols)
    if built is None:
        raise ValueError(f"no node in the graph holds the size {size}")
    return built


def _built(graph: Graph, expr, symbols: dict):
    """``expr`` (sympy: integers, symbols of ``symbols``, sums and products of them) as a graph
    argument, the nodes made from ``symbols`` (symbol -> a function making its node), or None."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return symbols[expr]() if expr in symbols else None
    target = {sympy.Mul: operator.mul, sympy.Add: operator.add}.get(type(expr))
    parts = [_built(graph, a, symbols) for a in expr.args] if target else [None]
    if any(p is None for p in parts):
        return None
    result = parts[0]
    for part in parts[1:]:
        result = arith(graph, target, result, part)
    return result


def _new(graph: Graph, target, args: tuple, val) -> Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node
