"""find_matmul_reduce_scatters: the matmul, or sum of matmuls, a reduce-scatter scatters,
found in a post-grad graph.

The scattered tensor (in its scatter-dim layout, layouts.py) must be a matmul's result, or a
sum of them (the input gradient of linears sharing one input), seen through views that keep the
elements' order, one widening cast and a bias added after the matmul. Nothing here mutates the
graph.
"""

import dataclasses

import torch
from torch.fx import Graph, Node

from ..graph.nodes import (
    BMM, CASTS, REDUCE_SCATTER, SCALED_MM, WAIT, cast_dtype, keeps_order, meta_val, scaled_mm_args, tensor_shape,
)
from ..graph.sizes import same, same_shape
from .layouts import scattered_layout
from .matches import (
    MATMUL_REDUCE_SCATTER, Candidate, MatmulReduceScatterMatch, NoMatch, ReduceTerm, Scaled, candidate,
    node_names,
)
from .matmul_checks import bias_of_addmm, check_scaled_mm, require_static_features, shared_matrix, tensorwise

aten = torch.ops.aten


def _one_user(node: Node) -> None:
    if len(node.users) != 1:
        raise NoMatch("matmul result has other users")


def _widening(cast: Node) -> bool:
    """Whether ``cast`` only converts a bf16 or fp16 tensor to fp32, the dtype the op's
    reduction sums in (ops/matmul_ops.py: out_dtype)."""
    before = meta_val(cast.args[0])
    narrow = isinstance(before, torch.Tensor) and before.dtype in (torch.bfloat16, torch.float16)
    return narrow and cast_dtype(cast) == torch.float32


def _sum_of_matmuls(
    node: Node, terms: list[ReduceTerm], between: list[Node], widened: list[bool], cast_seen: bool = False
) -> None:  # fmt: skip
    """Collects the matmuls of ``node``, a matmul or a sum of matmuls seen through views that
    keep the elements' order and widening casts, into ``terms`` (and into ``widened`` whether a
    cast is on the term's path), and the views, casts and adds on the way into ``between``;
    NoMatch if any term is not a matmul, or any node on the way is read elsewhere. Whether the
    views keep the rows (the last dim) is checked on the terms found."""
    if keeps_order(node):
        between.append(node)
        _one_user(node.args[0])
        _sum_of_matmuls(node.args[0], terms, between, widened, cast_seen)
    elif node.target in CASTS:
        if cast_seen or not _widening(node):
            raise NoMatch(
                f"dtype cast between the matmul and the reduce-scatter that is not one cast from "
                f"bf16 or fp16 to fp32 ({node_names([node])})"
            )
        between.append(node)
        _one_user(node.args[0])
        _sum_of_matmuls(node.args[0], terms, between, widened, True)
    elif node.target is aten.add.Tensor:
        operands = node.args[:2]
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            raise NoMatch(f"reduce-scatter input is a scaled sum: {node_names([node])}")
        if _added_bias(node) is not None:
            _biased_term(node, terms, between, widened, cast_seen)
            return
        if not all(isinstance(a, Node) and same_shape(tensor_shape(a), tensor_shape(node)) for a in operands):
            raise NoMatch(
                f"reduce-scatter input adds a broadcast or scalar term: {node_names([node])}"
            )
        between.append(node)
        for operand in operands:
            _one_user(operand)
            _sum_of_matmuls(operand, terms, between, widened, cast_seen)
    elif node.target is aten.mm.default:
        terms.append(ReduceTerm(node, node.args[0], node.args[1], None))
        widened.append(cast_seen)
    elif node.target is aten.addmm.default:
        terms.append(ReduceTerm(node, node.args[1], node.args[2], bias_of_addmm(node)))
        widened.append(cast_seen)
    elif node.target is BMM:
        if not shared_matrix(node.args[1]):
            raise NoMatch(
                f"reduce-scatter input is a batched matmul with a different mat2 per batch "
                f"element (not a linear): {node_names([node])}"
            )
        terms.append(ReduceTerm(node, node.args[0], node.args[1], None))
        widened.append(cast_seen)
    elif node.target is SCALED_MM:
        named = check_scaled_mm(node)
        terms.append(
            ReduceTerm(
                node, named["self"], named["mat2"], named["bias"], named["scale_a"], named["scale_b"],
                named["out_dtype"],
            )
        )  # fmt: skip
        widened.append(cast_seen)
    elif node.target is aten.cat.default:
        raise NoMatch(
            f"reduce-scatter input is not a matmul result: {node_names([node])} is not one equal "
            "chunk per rank (uneven shards are padded before the collective)"
        )
    elif between and between[-1].target is aten.add.Tensor:
        raise NoMatch(
            f"reduce-scatter input is not a sum of matmuls: the term {node_names([node])} is not "
            "a matmul (e.g. a residual gradient added before the collective)"
        )
    else:
        raise NoMatch(f"reduce-scatter input is not a matmul result: {node_names([node])}")


def _added_bias(add: Node) -> Node | None:
    """The operand of ``add`` that is one value per output column ([N], in the sum's dtype),
    where the other is of the sum's shape: a linear's bias added after its matmul (NeMo
    Automodel's bmm form; DTensor adds a row-parallel bias as bias / W on every rank)."""
    shape, val = tensor_shape(add), meta_val(add)
    if not shape:
        return None
    for bias, other in (add.args[:2], add.args[1::-1]):
        if isinstance(bias, Node) and isinstance(other, Node) and same_shape(tensor_shape(other), shape):
            bias_val = meta_val(bias)
            if same_shape(tensor_shape(bias), shape[-1:]) and bias_val.dtype == val.dtype:
                return bias
    return None


def _biased_term(add: Node, terms: list[ReduceTerm], between: list[Node], widened: list[bool], cast_seen: bool) -> None:
    """The matmuls under ``add`` and the bias it adds to them (to a matmul, or to a sum of
    them: the op adds the sum of its terms' biases to each rank's partial), held by the first
    of those terms without a bias of its own."""
    bias = _added_bias(add)
    other = add.args[1] if add.args[0] is bias else add.args[0]
    between.append(add)
    _one_user(other)
    found = len(terms)
    _sum_of_matmuls(other, terms, between, widened, cast_seen)
    if widened[-1] and not cast_seen:  # the op adds a bias to the partial before widening it
        raise NoMatch(f"a bias is added after the widening cast before the reduce-scatter: {node_names([add])}")
    free = [i for i in range(found, len(terms)) if terms[i].bias is None]
    if not free:
        raise NoMatch(f"a bias is added to a matmul that has its own before the reduce-scatter: {node_names([add])}")
    terms[free[0]] = dataclasses.replace(terms[free[0]], bias=bias)


def _match_reduce_scatter(reduce_scatter: Node) -> MatmulReduceScatterMatch:
    collective_input, reduce_op, world_size, group_name = reduce_scatter.args[:4]
    require_static_features(collective_input, reduce_scatter)
    users = list(reduce_scatter.users)
    if len(users) != 1 or users[0].target is not WAIT:
        raise NoMatch("reduce-scatter result is not read through exactly one wait_tensor")
    if reduce_op not in ("sum", "avg"):
        raise NoMatch(f"reduce op {reduce_op!r} (only sum and avg)")
    scattered, scatter_dim, cutters, moved = scattered_layout(collective_input, world_size)
    shape = tensor_shape(scattered)
    if shape is None:
        raise NoMatch("scattered tensor has no shape metadata")
    if scatter_dim == len(shape) - 1:
        raise NoMatch("scatter along the matmul's N dim (the last dim)")
    if not set(scattered.users) <= cutters | {reduce_scatter}:
        raise NoMatch("matmul result has other users")

    terms, between, widened = [], [], []
    _sum_of_matmuls(scattered, terms, between, widened)
    if any(not same(tensor_shape(t.mm)[-1], shape[-1]) for t in terms):
        raise NoMatch("reshape between matmul and reduce-scatter changes the last dim")
    require_static_features(*(t.input for t in terms))
    if any(widened) and not all(widened):
        raise NoMatch("some matmuls of the sum are widened before the reduce-scatter and others not")
    scaled = _scaled_terms(terms)
    if scaled is not None and any(widened):
        narrow_adds = [n for n in between if n.target is aten.add.Tensor and meta_val(n).dtype == scaled.out_dtype]
        if narrow_adds:
            raise NoMatch(
                f"the scaled matmuls are summed in {scaled.out_dtype} before the widening cast "
                f"({node_names(narrow_adds)}); the op sums them widened"
            )
    return MatmulReduceScatterMatch(
        terms=tuple(terms),
        between=tuple(between),
        scattered=scattered,
        reduce_scatter=reduce_scatter,
        wait=users[0],
        scatter_dim=scatter_dim,
        reduce_op=reduce_op,
        world_size=world_size,
        group_name=group_name,
        out_dtype=meta_val(scattered).dtype if any(widened) else None,
        moved=moved,
        scaled=scaled,
    )


def _scaled_terms(terms: list[ReduceTerm]) -> Scaled | None:
    """The Scaled of a sum of scaled matmuls (None for plain ones), or NoMatch for a mix."""
    scaled = [t for t in terms if t.mm.target is SCALED_MM]
    if not scaled:
        return None
    if len(scaled) < len(terms):
        raise NoMatch("some terms of the sum are scaled (float8) matmuls and others not")
    dtypes = {t.mm_dtype for t in terms}
    fast = {bool(scaled_mm_args(t.mm)["use_fast_accum"]) for t in terms}
    if len(dtypes) != 1 or len(fast) != 1:
        raise NoMatch("the scaled matmuls of the sum differ in out_dtype or accumulation")
    for term in terms:
        scale = meta_val(term.input_scale)
        if not (tensorwise(scale) or same_shape(tuple(scale.shape), (tensor_shape(term.input)[0], 1))):
            raise NoMatch(f"a scaled matmul's scale_a of shape {list(scale.shape)} is neither one value nor one per row")
    return Scaled(None, False, dtypes.pop(), fast.pop())


def find_matmul_reduce_scatters(graph: Graph) -> list[Candidate]:
    """One Candidate per reduce_scatter_tensor in ``graph``."""
    return [
        candidate(MATMUL_REDUCE_SCATTER, node, _match_reduce_scatter)
        for node in graph.find_nodes(op="call_function", target=REDUCE_SCATTER)
    ]
