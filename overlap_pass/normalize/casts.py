"""Before matching: a cast that narrows a gathered tensor's dtype moves in front of its all-gather.

cast(all_gather(x)) == all_gather(cast(x)) bit for bit: a gather moves values unchanged and a cast
is elementwise. Under autocast a sequence-parallel model gathers its fp32 activations (the
residual stream and RMSNorm run in fp32) and each linear then casts the gathered tensor to bf16,
so the collective moves twice the bytes it needs and no matmul reads the gathered tensor
directly. Done on the shard instead, the cast halves the transfer and leaves
all_gather -> views -> mm, which the all-gather + matmul rewrite takes.

A move is planned only where every path from the gathered tensor, through dtype-blind data
movement (views, split/cat, transposes), ends in a cast to one narrower dtype: a tensor also read
in its own dtype stays as it is (a widening cast would double the bytes instead).
"""

import contextlib
import dataclasses
import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..graph.nodes import ALL_GATHER, CASTS, SPLITS, VIEWS, WAIT, cast_dtype
from ..graph.sizes import same_shape

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default
# ops that move values without looking at them: they take any dtype and keep it
_DATA_MOVEMENT = (*VIEWS, *SPLITS, operator.getitem, aten.cat.default, aten.permute.default, aten.t.default)


@dataclasses.dataclass(frozen=True)
class CastMove:
    gather: Node
    region: tuple[Node, ...]  # the wait and the data movement after it
    casts: tuple[Node, ...]  # the casts that end every path, all to ``dtype``
    dtype: torch.dtype
    source_dtype: torch.dtype


def _keeps_layout(cast: Node) -> bool:
    """Whether the cast's result has its input's shape and strides, so that its users can read
    the input itself once that holds the cast dtype."""
    before, after = cast.args[0].meta.get("val"), cast.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    return same_shape(tuple(before.shape), tuple(after.shape)) and same_shape(before.stride(), after.stride())


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _plan_one(gather: Node) -> CastMove | None:
    source_dtype = _dtype(gather)
    users = list(gather.users)
    if source_dtype is None or len(users) != 1 or users[0].target is not WAIT:
        return None
    region, casts, stack = [users[0]], [], [users[0]]
    while stack:
        for user in stack.pop().users:
            if user in region or user in casts:
                continue
            if user.target in CASTS:
                casts.append(user)
            elif user.target in _DATA_MOVEMENT:
                region.append(user)
                stack.append(user)
            else:
                return None  # read in its own dtype
    dtypes = {cast_dtype(c) for c in casts}
    if not casts or len(dtypes) != 1 or not all(_keeps_layout(c) for c in casts):
        return None
    (dtype,) = dtypes
    narrower = dtype is not None and dtype.itemsize < source_dtype.itemsize
    if not narrower or dtype.is_floating_point != source_dtype.is_floating_point:
        return None
    # closed: every tensor a region node reads comes from the gather or from the region itself
    inside = {gather, *region}
    for node in region:
        if any(arg not in inside for arg in node.all_input_nodes):
            return None
    return CastMove(gather, tuple(region), tuple(casts), dtype, source_dtype)


def plan(graph: Graph) -> list[CastMove]:
    """The casts to move, one CastMove per all-gather (nothing is changed here)."""
    moves = [_plan_one(g) for g in graph.find_nodes(op="call_function", target=ALL_GATHER)]
    return [m for m in moves if m is not None]


def _retyped(val, dtype: torch.dtype):
    """``val`` (a fake tensor, or a list or tuple of them) with ``dtype``, shape and strides kept."""
    if isinstance(val, torch.Tensor):
        with detect_fake_mode([val]) or contextlib.nullcontext():
            return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)
    if isinstance(val, (list, tuple)):
        return type(val)(_retyped(v, dtype) for v in val)
    return val


def apply(graph: Graph, moves: list[CastMove]) -> None:
    """shard -> cast -> all_gather -> (the region, now in the narrow dtype) -> the casts' users."""
    for move in moves:
        gather = move.gather
        shard = gather.args[0]
        with graph.inserting_before(gather):
            cast = graph.call_function(CONVERT, (shard, move.dtype))
        cast.meta["val"] = _retyped(shard.meta["val"], move.dtype)
        gather.args = (cast, *gather.args[1:])
        for node in (gather, *move.region):
            node.meta["val"] = _retyped(node.meta["val"], move.dtype)
            if isinstance(node.meta["val"], torch.Tensor) and "tensor_meta" in node.meta:
                node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
        for old in move.casts:
            old.replace_all_uses_with(old.args[0])
            graph.erase_node(old)
