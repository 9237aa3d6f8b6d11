"""Row-wise ops: what can run on a rank's 1/W of the tokens instead of on all of them.

A tensor is in row form when its last dim holds one token's values and its leading dims,
flattened, are the tokens. An op is row-wise when each output row depends only on the same token's
input rows: elementwise ops, reshapes that keep the last dim, reductions over the last dim that
keep it, an expand of a last dim of 1. Computed on a shard of the tokens, such an op gives exactly
the shard's rows of its full result, so a region of them can run on the shard
(the all-reduce split, split_regions.py). A sum, max or min over every token is not row-wise, but the shards' sums,
maxima or minima, all-reduced, give it (a float8 scale's amax, a norm weight's gradient).

Sharded tensors are 2-D, [tokens / W, last dim]: a reshape between row forms is then no op.
"""

import operator

import torch
from torch.fx import Node

from ..graph.nodes import VIEWS, meta_val
from ..graph.sizes import is_static, prod, same, same_shape

aten = torch.ops.aten

# reductions that take (input, dims, keepdim) or (input, dims, *, correction, keepdim)
_REDUCTIONS = (
    aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.var_mean.correction,
)  # fmt: skip

SAME = "same"  # a reshape between row forms: the shard itself
GETITEM = "getitem"  # an element of a row-wise op's tuple (var_mean)
EXPAND = "expand"  # a last dim of 1 expanded
POINTWISE = "pointwise"
REDUCE_LAST = "reduce_last"  # a reduction over the last dim, keepdim
ACROSS_TOKENS = "across_tokens"  # a sum, max or min over every token: the shards', all-reduced

# reductions over every token and how their shards' results combine; the ones without dims
# (max.default) reduce every dim, and so do the others given every dim
TOKEN_REDUCE_OPS = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum",
    aten.amax.default: "max", aten.max.default: "max",
    aten.amin.default: "min", aten.min.default: "min",
}  # fmt: skip


def tensor_shape(node) -> tuple | None:
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def tokens(shape: tuple | None):
    """How many rows a tensor of ``shape`` has in row form, an int or a SymInt (None: not a
    row-form tensor, or one whose last dim is symbolic)."""
    if shape is None or len(shape) < 2 or not is_static(shape[-1]):
        return None
    return prod(shape[:-1])


def row_free(shape: tuple) -> bool:
    """A shape that broadcasts the same values to every row: [n], [1, ..., 1, n] or a scalar."""
    return all(same(s, 1) for s in shape[:-1])


def _reduction_dims(node: Node) -> tuple[list[int], bool] | None:
    val = meta_val(node.args[0])
    if not isinstance(val, torch.Tensor) or len(node.args) < 2 or node.args[1] is None:
        return None
    dims = sorted({d % val.dim() for d in node.args[1]})
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dims, bool(keepdim)


def is_pointwise(node: Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if target is aten._to_copy.default:  # a dtype conversion only
        return set(node.kwargs) <= {"dtype"} and len(node.args) == 1
    return torch.Tag.pointwise in target.tags


def rule(node: Node, source: Node, in_region, rows: int) -> str | None:
    """How ``node``, a user of the region node ``source``, runs on the shard; None where it
    cannot (it then reads the gathered tensor). ``in_region(n)`` says whether a node is already
    in the region; ``rows`` is the region's token count."""
    shape = tensor_shape(node)
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return GETITEM if isinstance(meta_val(source), (tuple, list)) else None
    if isinstance(meta_val(source), (tuple, list)):
        return None
    source_shape = tensor_shape(source)
    if node.target in VIEWS:
        same_rows = shape is not None and same(tokens(shape), rows) and same(shape[-1], source_shape[-1])
        return SAME if same_rows else None
    if node.target is aten.expand.default:
        ok = shape is not None and same_shape(shape[:-1], source_shape[:-1]) and same(source_shape[-1], 1)
        return EXPAND if ok else None
    if node.target in (aten.sum.default, aten.max.default, aten.min.default):
        return ACROSS_TOKENS if node.args[0] is source and len(node.args) == 1 else None
    if node.target in _REDUCTIONS and node.args[0] is source:
        reduced = _reduction_dims(node)
        if reduced is None:
            return None
        dims, keepdim = reduced
        last = len(source_shape) - 1
        if dims == [last] and keepdim:
            return REDUCE_LAST  # var_mean: a tuple of two such tensors
        if node.target in TOKEN_REDUCE_OPS and dims in (list(range(last)), list(range(last + 1))):
            return ACROSS_TOKENS
        return None
    if is_pointwise(node) and shape is not None and tokens(shape) is not None and same(tokens(shape), rows):
        for arg in node.all_input_nodes:
            arg_shape = tensor_shape(arg)
            if arg_shape is None:
                return None
            if in_region(arg) or arg is source:
                if not same_shape(arg_shape[:-1], shape[:-1]):
                    return None  # a region tensor broadcast along rows
            elif len(arg_shape) > len(shape):
                return None
        return POINTWISE
    return None
