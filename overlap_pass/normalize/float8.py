"""Before matching: torchao's rowwise float8 matmul, written as one _scaled_mm again.

Without fast accumulation, torchao's rowwise Float8Linear calls _scaled_mm with scales of 1
(the tensorwise cuBLAS kernel, faster than the rowwise one) and applies the row and column
scales afterwards:

    cast(_scaled_mm(a, b, 1, 1, out_dtype=bf16) * (row_scales * column_scales), dtype)
becomes
    _scaled_mm(a, b, row_scales, column_scales, out_dtype=dtype)

so the matchers see the scaled matmul of a and b with rowwise scales, whose scales follow its
rows through an all-gather or a reduce-scatter. Numerics: the product is rounded once, after
scaling, instead of before and after (the rowwise kernels, and overlap's, scale the fp32
accumulator).
"""

import torch
from torch.fx import Graph, Node

from ..graph.edits import call, erase_dead
from ..graph.nodes import SCALED_MM, cast_dtype, meta_val, scaled_mm_args
from ..graph.sizes import same_shape

aten = torch.ops.aten


def _is_one(node) -> bool:
    """A constant tensor of ones (full(..., 1.0))."""
    return isinstance(node, Node) and node.target is aten.full.default and node.args[1] in (1, 1.0)


def _shape(node) -> tuple | None:
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _row_and_column_scales(outer: Node, rows, cols: int) -> tuple[Node, Node] | None:
    if outer.target is not aten.mul.Tensor or not all(isinstance(a, Node) for a in outer.args[:2]):
        return None
    row = next((a for a in outer.args[:2] if same_shape(_shape(a), (rows, 1))), None)
    col = next((a for a in outer.args[:2] if same_shape(_shape(a), (1, cols))), None)
    if row is None or col is None or {meta_val(row).dtype, meta_val(col).dtype} != {torch.float32}:
        return None
    return row, col


def _fold(cast: Node) -> Node | None:
    """The _scaled_mm that replaces ``cast``, or None where it is not torchao's form."""
    dtype = cast_dtype(cast)
    mul = cast.args[0] if cast.args else None
    if dtype != torch.bfloat16 or not isinstance(mul, Node) or mul.target is not aten.mul.Tensor:
        return None
    for mm, outer in (mul.args[:2], mul.args[1::-1]):
        if not (isinstance(mm, Node) and isinstance(outer, Node)) or mm.target is not SCALED_MM:
            continue
        named = scaled_mm_args(mm)
        if not (_is_one(named["scale_a"]) and _is_one(named["scale_b"])):
            continue
        if named["bias"] is not None or named["scale_result"] is not None or len(mm.users) != 1:
            continue
        scales = _row_and_column_scales(outer, *_shape(mm))
        if scales is None:
            continue
        with cast.graph.inserting_before(cast):
            kwargs = {"out_dtype": dtype, "use_fast_accum": bool(named["use_fast_accum"])}
            return call(cast.graph, SCALED_MM, (named["self"], named["mat2"], *scales), kwargs)
    return None


FOLDED = "overlap_folded_rowwise"  # meta key of the matmuls folded here (graph copies keep it)


def fold_rowwise_epilogues(graph: Graph) -> int:
    """Rewrites every such matmul; returns how many."""
    folded = 0
    for cast in list(graph.find_nodes(op="call_function", target=torch.ops.prims.convert_element_type.default)):
        scaled = _fold(cast)
        if scaled is None:
            continue
        mul = cast.args[0]
        cast.replace_all_uses_with(scaled)
        erase_dead(graph, [cast, mul, *mul.args[:2]])
        scaled.meta[FOLDED] = True
        folded += 1
    return folded


def unfold(graph: Graph) -> None:
    """Writes the folded matmuls that no overlap op took back in torchao's form: Inductor's
    _scaled_mm then runs the tensorwise kernel, and no rowwise scale reaches it in a layout
    (a [M, 1] view of a row, say) that _scaled_mm rejects."""
    for mm in list(graph.find_nodes(op="call_function", target=SCALED_MM)):
        if not mm.meta.get(FOLDED):
            continue
        named = scaled_mm_args(mm)
        device = meta_val(mm).device
        with graph.inserting_before(mm):
            one = call(graph, aten.full.default, ([], 1.0), {"dtype": torch.float32, "device": device})
            kwargs = {"out_dtype": torch.bfloat16, "use_fast_accum": named["use_fast_accum"]}
            plain = call(graph, SCALED_MM, (named["self"], named["mat2"], one, one), kwargs)
            outer = call(graph, aten.mul.Tensor, (named["scale_a"], named["scale_b"]))
            scaled = call(graph, aten.mul.Tensor, (plain, outer))
            cast = call(graph, torch.ops.prims.convert_element_type.default, (scaled, torch.bfloat16))
        mm.replace_all_uses_with(cast)
        graph.erase_node(mm)
