"""The op targets and node facts the stages share: collectives and their waits, views, matmuls,
casts; a node's recorded value and shape, its place in the graph, what it is computed from, and
how decisions.json describes it. Nothing here mutates the graph.
"""

import torch
from torch.fx import Graph, Node

from .sizes import same

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
BMM = aten.bmm.default
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
SCALED_MM = aten._scaled_mm.default
MATMULS = (aten.mm.default, aten.addmm.default, SCALED_MM, BMM)


def meta_val(node: Node | None):
    """The fake tensor (or other value) Inductor recorded for a node; None for non-nodes."""
    return node.meta.get("val") if isinstance(node, Node) else None


def tensor_shape(node: Node) -> tuple | None:
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def graph_order(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def depends_on(node: Node, ancestor: Node, order: dict[Node, int]) -> bool:
    """Whether ``ancestor`` is among the inputs of ``node``, transitively. In a topologically
    sorted graph (``order``), nodes placed before ``ancestor`` cannot depend on it, which bounds
    the walk."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is ancestor:
            return True
        if current in seen or order[current] < order[ancestor]:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def under_views(node: Node) -> Node:
    """What ``node`` is a view, reshape or _unsafe_view of (through any chain of them)."""
    while isinstance(node, Node) and node.target in VIEWS:
        node = node.args[0]
    return node


def is_transpose(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    return node.target is aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2])


def keeps_order(view: Node) -> bool:
    """A view that keeps the elements in their row-major order: a reshape, an unsqueeze or a
    squeeze, or a permute that moves only dims of size 1 (einsum's lowering adds and moves such
    dims around its bmm). Between two tensors of the same last dim, such views keep every row
    intact, so they commute with `@ mat2`."""
    if view.target in VIEWS or view.target in SQUEEZES or view.target is aten.unsqueeze.default:
        return True
    shape = tensor_shape(view.args[0]) if view.target is aten.permute.default else None
    if shape is None:
        return False
    moved = [d % len(shape) for d in view.args[1] if not same(shape[d], 1)]
    return moved == sorted(moved)


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype a cast node converts to, when converting the dtype is all it does."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1] if len(node.args) > 1 else None
    if node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.kwargs["dtype"]
    return None


_SCALED_MM_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


def scaled_mm_args(mm: Node) -> dict:
    """An aten._scaled_mm node's arguments by name, defaults filled in."""
    named = dict.fromkeys(_SCALED_MM_ARGS)
    named["use_fast_accum"] = False
    named.update(zip(_SCALED_MM_ARGS, mm.args))
    named.update(mm.kwargs)
    return named


def reaches_matmul(node: Node, depth: int = 4) -> bool:
    if node.target in MATMULS:
        return True
    return depth > 0 and any(reaches_matmul(u, depth - 1) for u in node.users)


def _reached_from_matmul(node: Node, depth: int = 4) -> bool:
    if node.target in MATMULS:
        return True
    return depth > 0 and any(_reached_from_matmul(a, depth - 1) for a in node.all_input_nodes)


def next_to_matmul(collective: Node) -> bool:
    """Whether a collective is a tensor-parallel one: an all-gather whose result a matmul reads
    within a few nodes, or a reduce-scatter or all-reduce of a matmul's result."""
    if collective.target is ALL_GATHER:
        return reaches_matmul(collective, depth=6)
    return _reached_from_matmul(collective.args[0], depth=6)


def describe_node(node: Node | None) -> dict | None:
    """Name, op, shape and dtype of a node, for decisions.json."""
    if node is None:
        return None
    val = node.meta.get("val")
    described = {"name": node.name, "op": _target_name(node)}
    if isinstance(val, torch.Tensor):
        described["shape"] = [int(s) if isinstance(s, int) else str(s) for s in val.shape]
        described["dtype"] = str(val.dtype).replace("torch.", "")
    return described


def _target_name(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "name", None)
    return name() if callable(name) else getattr(target, "__name__", str(target))
