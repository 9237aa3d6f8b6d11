"""find_all_gather_matmuls: an all-gather's matmul users, found in a post-grad graph.

The gathered tensor's rows (in their gather-dim layout, layouts.py) may feed matmuls as their
left operand, be contracted in a weight gradient (g^T @ other, other @ g), or feed bmms that are
such a matmul over blocks of the rows; float8 rows feed _scaled_mm, whose rowwise scale is
gathered beside them. Nothing here mutates the graph.
"""

import torch
from torch.fx import Graph, Node

from ..graph.nodes import (
    ALL_GATHER, BMM, CASTS, SCALED_MM, VIEWS, WAIT, depends_on, graph_order, is_transpose, keeps_order,
    meta_val, reaches_matmul, scaled_mm_args, tensor_shape, under_views,
)
from ..graph.sizes import prod, same, same_shape
from .layouts import equal_chunks, gathered_layout
from .matches import (
    ALL_GATHER_MATMUL, AllGatherMatmulMatch, Candidate, ContractionUse, MatmulUse, NoMatch, Scaled, candidate,
    node_names,
)
from .matmul_checks import (
    batch_sum, bias_of_addmm, check_scaled_mm, require_static_features, shared_matrix, tensorwise,
)

aten = torch.ops.aten


def _contiguous_copy(node: Node) -> bool:
    """A clone into the contiguous format (a reshape of a permuted tensor leaves one): the same
    values in row-major order."""
    return (
        node.target is aten.clone.default
        and len(node.args) == 1
        and node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format
    )


def _contracting_mms(transposed: Node) -> list[Node] | None:
    """The mms that take ``transposed`` (g^T) as their left operand, if those are all its users."""
    users = list(transposed.users)
    if users and all(
        u.target is aten.mm.default and u.args[0] is transposed and u.args[1] is not transposed
        for u in users
    ):
        return users
    return None


def _batch_transpose(node: Node) -> bool:
    return node.target is aten.permute.default and [d % 3 for d in node.args[1]] == [0, 2, 1]


def _contracting_bmms(transposed: Node) -> list[Node] | None:
    """The bmms that take ``transposed`` (g^T per batch element) as their left operand, each
    summed over its batch, if those are all its users."""
    users = list(transposed.users)
    if users and all(
        u.target is BMM and u.args[0] is transposed and u.args[1] is not transposed and batch_sum(u) is not None
        for u in users
    ):
        return users
    return None


def _contraction(bmm: Node, other: Node, gathered_left: bool) -> ContractionUse:
    total = batch_sum(bmm)
    return ContractionUse(bmm, other, gathered_left, None if total is bmm else total)


def _bmm_use(bmm: Node, node: Node, matmuls: list, contractions: list, notes: list) -> bool:
    """Takes a bmm that reads ``node`` (the gathered rows, in [B, M / B, K] blocks): as its
    rows with a mat2 shared by every batch element (a linear), or as its mat2, contracted and
    summed over the batch (a linear's weight gradient). False, with a note, for the others."""
    if bmm.args[0] is node and bmm.args[1] is not node:
        if shared_matrix(bmm.args[1]):
            matmuls.append(MatmulUse(bmm, bmm.args[1], None))
            return True
        notes.append(
            f"a batched matmul with a different mat2 per batch element reads the gathered rows "
            f"(not a linear): {node_names([bmm])}"
        )
    elif bmm.args[1] is node and bmm.args[0] is not node:
        if batch_sum(bmm) is not None:
            contractions.append(_contraction(bmm, bmm.args[0], False))
            return True
        notes.append(_PER_BATCH_CONTRACTION + node_names([bmm]))
    return False


_PER_BATCH_CONTRACTION = (
    "a batched matmul contracts the gathered rows per batch element, not summed over the batch "
    "(not a weight gradient): "
)


def _matmul_users(gathered: Node):
    """Matmuls reading ``gathered`` through views that keep its rows: as their left operand
    (rows), or contracting its rows (g^T @ other, other @ g); bmms over blocks of those rows
    that are such a matmul (shared_matrix, batch_sum); the other users; and reasons why some
    matmul-looking users were not taken."""
    matmuls, contractions, others, notes = [], [], [], []
    k = (tensor_shape(gathered) or (None,))[-1]

    def visit(node: Node) -> None:
        shape = tensor_shape(node) or ()
        in_rows = bool(shape) and same(shape[-1], k)  # its rows, flattened, are the gathered rows
        two_d, three_d = in_rows and len(shape) == 2, in_rows and len(shape) == 3
        for user in node.users:
            if in_rows and user.target is aten.mm.default and user.args[0] is node and user.args[1] is not node:
                matmuls.append(MatmulUse(user, user.args[1], None))
            elif two_d and is_transpose(user) and _contracting_mms(user):
                contractions.extend(ContractionUse(mm, mm.args[1], True) for mm in _contracting_mms(user))
            elif two_d and user.target is aten.mm.default and user.args[1] is node and user.args[0] is not node:
                contractions.append(ContractionUse(user, user.args[0], False))
            elif three_d and user.target is BMM and _bmm_use(user, node, matmuls, contractions, notes):
                pass
            elif three_d and _batch_transpose(user) and any(u.target is BMM and u.args[0] is user for u in user.users):
                if _contracting_bmms(user):
                    contractions.extend(_contraction(bmm, bmm.args[1], True) for bmm in _contracting_bmms(user))
                else:
                    notes.append(_PER_BATCH_CONTRACTION + node_names(user.users))
                    others.append(user)
            elif in_rows and user.target is aten.addmm.default and user.args[1] is node:
                try:
                    matmuls.append(MatmulUse(user, user.args[2], bias_of_addmm(user)))
                except NoMatch as why:
                    notes.append(str(why))
                    others.append(user)
            elif in_rows and user.target is SCALED_MM and user.args[0] is node and user.args[1] is not node:
                try:
                    named = check_scaled_mm(user)
                    matmuls.append(MatmulUse(user, named["mat2"], named["bias"], named["scale_b"]))
                except NoMatch as why:
                    notes.append(str(why))
                    others.append(user)
            elif keeps_order(user) or _contiguous_copy(user):
                visit(user)
            else:
                moved = user.target is aten.permute.default and any(u.target is BMM for u in user.users)
                if moved or (user.target is BMM and not three_d):
                    notes.append(
                        f"a batched matmul reads the gathered tensor in another layout than its "
                        f"rows (not a linear's rows or weight gradient): {node_names([user])}"
                    )
                others.append(user)

    visit(gathered)
    # The op takes mat2, bias and the contracted operands as inputs, so they must not be
    # computed from its own output.
    order = graph_order(gathered.graph)

    def independent(uses, operands, what):
        kept = []
        for use in uses:
            if any(n is not None and depends_on(n, gathered, order) for n in operands(use)):
                notes.append(f"the {what} is computed from the gathered tensor")
                others.append(use.mm)
            else:
                kept.append(use)
        return kept

    matmuls = independent(matmuls, lambda u: (u.mat2, u.bias, u.mat2_scale), "matmul's mat2 or bias")
    contractions = independent(contractions, lambda u: (u.other,), "contracted operand")
    return matmuls, contractions, others, notes


def _why_no_matmul(gathered: Node, gather_dim: int, others: list[Node], notes: list[str]) -> str:
    shape = tensor_shape(gathered)
    if shape is not None and gather_dim == len(shape) - 1 and reaches_matmul(gathered):
        return "K-sharded gather: the gathered dim is the matmul's contraction dim"
    if notes:
        return notes[0]
    casts = [u for u in others if u.target in CASTS and reaches_matmul(u)]
    if casts:
        return "dtype cast between the all-gather and the matmul"
    slices = [u for u in others if u.target in (aten.slice.Tensor, aten.narrow.default)]
    if slices and all(reaches_matmul(u) for u in slices):
        return "uneven shards: the gathered tensor is sliced (padding removed) before the matmul"
    mats = [u for u in others if u.target in (aten.mm.default, aten.addmm.default)]
    if mats:
        return "gathered tensor is the matmul's right operand (mat2), not its rows"
    scaled = [u for u in others if u.target is SCALED_MM]
    if any(under_views(scaled_mm_args(u)["mat2"]) is gathered for u in scaled):
        return "a scaled matmul reads the gathered tensor as its mat2 (a float8 weight gradient): not fused yet"
    if scaled:
        return "the gathered tensor is a scaled matmul's scale: it goes with its rows' all-gather"
    if not others:
        return "gathered tensor has no users"
    return f"no matmul reads the gathered rows; users: {node_names(others)}"


def _byte_view(gathered: Node) -> torch.dtype | None:
    """The float8 dtype of a uint8 gathered tensor read only as that dtype (the bytes of a
    float8 tensor, gathered on backends without float8), else None."""
    users = list(gathered.users)
    dtype = meta_val(gathered).dtype if isinstance(meta_val(gathered), torch.Tensor) else None
    if dtype == torch.uint8 and len(users) == 1 and users[0].target is aten.view.dtype:
        return users[0].args[1]
    return None


def _gathered_scale(scale: Node, rows: int, world_size: int, group_name: str, gather_dim: int):
    """(the all-gather's input, its nodes) where ``scale`` ([rows, 1], through reshapes) is an
    all-gathered tensor along ``gather_dim``, one value per gathered row; else NoMatch."""
    node, views = scale, []
    while node.target in VIEWS:
        views.append(node)
        node = node.args[0]
    wait = node
    if node.target is aten.cat.default:
        chunks = equal_chunks(list(node.args[0]), world_size)
        wait = chunks[0] if chunks and chunks[1] == 0 else None
    gather = wait.args[0] if wait is not None and wait.target is WAIT else None
    if gather is None or gather.target is not ALL_GATHER or tuple(gather.args[1:3]) != (world_size, group_name):
        raise NoMatch("the rows' rowwise scale is not all-gathered along with them")
    shard_scale = gather.args[0]
    if gathered_layout(wait, shard_scale, world_size) != (node, gather_dim) or not same(tensor_shape(node)[-1], 1):
        raise NoMatch("the rows' rowwise scale is gathered along another dim than the rows")
    if not same(prod(tensor_shape(node)), rows):
        raise NoMatch("the rows' rowwise scale does not hold one value per gathered row")
    nodes = {gather, wait, node, *views}
    if node is not wait:
        nodes |= set(node.args[0]) | {p.args[0] for p in node.args[0]}
    return shard_scale, tuple(nodes)


def _scaled_uses(match_args: dict, matmuls: list, others: list, notes: list) -> tuple[list, Scaled | None]:
    """The scaled matmuls of a gathered tensor that share the rows' scale, out_dtype and
    accumulation (the others become other users), and their Scaled; (matmuls, None) when none
    is scaled."""
    scaled = [u for u in matmuls if u.mm.target is SCALED_MM]
    if not scaled:
        return matmuls, None

    def key(use):
        named = scaled_mm_args(use.mm)
        return named["scale_a"], named["out_dtype"], bool(named["use_fast_accum"])

    kept = [u for u in scaled if key(u) == key(scaled[0])]
    if len(kept) < len(scaled):
        notes.append("the scaled matmuls of the gathered rows differ in scale, out_dtype or accumulation")
        others.extend(u.mm for u in scaled if u not in kept)
    scale, out_dtype, fast = key(scaled[0])
    gathered = match_args["gathered"]
    if tensorwise(meta_val(scale)):
        if depends_on(scale, gathered, graph_order(gathered.graph)):
            raise NoMatch("the rows' tensorwise scale is computed from the gathered tensor")
        return kept, Scaled(scale, False, out_dtype, fast)
    rows = prod(tensor_shape(gathered)[:-1])
    if not same_shape(tensor_shape(scale), (rows, 1)):
        raise NoMatch(f"the rows' scale of shape {list(tensor_shape(scale))} is neither one value nor one per row")
    shard_scale, nodes = _gathered_scale(
        scale, rows, match_args["world_size"], match_args["group_name"], match_args["gather_dim"]
    )
    return kept, Scaled(shard_scale, True, out_dtype, fast, nodes)


def _match_all_gather(gather: Node) -> AllGatherMatmulMatch:
    shard, world_size, group_name = gather.args[:3]
    require_static_features(shard, gather)
    users = list(gather.users)
    if len(users) != 1 or users[0].target is not WAIT:
        raise NoMatch("all-gather result is not read through exactly one wait_tensor")
    wait = users[0]
    gathered, gather_dim = gathered_layout(wait, shard, world_size)
    byte_view = _byte_view(gathered)
    if byte_view is not None:
        gathered = next(iter(gathered.users))
    matmuls, contractions, others, notes = _matmul_users(gathered)
    shape = tensor_shape(gathered)
    if shape is None:
        raise NoMatch("gathered tensor has no shape metadata")
    if not (matmuls or contractions) or gather_dim == len(shape) - 1:
        raise NoMatch(_why_no_matmul(gathered, gather_dim, others, notes))
    context = dict(gathered=gathered, world_size=world_size, group_name=group_name, gather_dim=gather_dim)
    matmuls, scaled = _scaled_uses(context, matmuls, others, notes)
    if scaled is not None and contractions:
        others.extend(u.mm for u in contractions)
        contractions = []
    return AllGatherMatmulMatch(
        gather=gather,
        wait=wait,
        gathered=gathered,
        shard=shard,
        gather_dim=gather_dim,
        world_size=world_size,
        group_name=group_name,
        matmuls=tuple(matmuls),
        contractions=tuple(contractions),
        other_users=tuple(others),
        scaled=scaled,
        byte_view=byte_view,
    )


def find_all_gather_matmuls(graph: Graph) -> list[Candidate]:
    """One Candidate per all_gather_into_tensor in ``graph``."""
    return [
        candidate(ALL_GATHER_MATMUL, node, _match_all_gather)
        for node in graph.find_nodes(op="call_function", target=ALL_GATHER)
    ]
