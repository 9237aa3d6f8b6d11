"""find_*: locate all-gather -> matmul and matmul -> reduce-scatter candidates in a post-grad graph.

Every all_gather_into_tensor and reduce_scatter_tensor node is a candidate. Each comes back as a
Candidate holding either a frozen match record or the reason it does not match. Nothing here
mutates the graph.
"""

import dataclasses
import operator

import torch
from torch.fx import Graph, Node

from .sizes import prod, same, same_shape, static_shape

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
BMM = aten.bmm.default
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
SCALED_MM = aten._scaled_mm.default

ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"


@dataclasses.dataclass(frozen=True)
class MatmulUse:
    """One matmul that reads the gathered tensor (through views) as its left operand."""

    mm: Node  # aten.mm, aten.addmm, aten._scaled_mm, or aten.bmm with a shared mat2
    mat2: Node  # [K, N]; a bmm's [B, K, N], one matrix for every batch element
    bias: Node | None
    mat2_scale: Node | None = None  # a _scaled_mm's


@dataclasses.dataclass(frozen=True)
class Scaled:
    """What float8 matmuls (aten._scaled_mm) add to a match: the scale of the gathered or
    scattered rows (tensorwise: as the matmul reads it; rowwise: the shard's rows, [..., 1],
    for an all-gather), its all-gather's nodes where it is gathered too, and the matmuls'
    out_dtype and fast accumulation, shared by all of them."""

    rows_scale: Node | None
    rowwise: bool
    out_dtype: torch.dtype
    use_fast_accum: bool
    scale_gather: tuple[Node, ...] = ()  # the rows' scale's all-gather, wait [, split, cat]


@dataclasses.dataclass(frozen=True)
class ContractionUse:
    """One matmul that contracts the gathered rows (a weight gradient):
    mm(permute(g), other) with ``gathered_left``, or mm(other, g) without (other: [K, M]);
    or the same as a bmm over [B, M / B, ...] row blocks, summed over its batch (``summed``,
    the node holding the value) where the batch is above 1."""

    mm: Node
    other: Node
    gathered_left: bool
    summed: Node | None = None


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulMatch:
    """shard -> all_gather -> wait [-> split/cat for gather_dim > 0] -> views -> mm(s)."""

    gather: Node
    wait: Node
    gathered: Node  # the gathered tensor in its gather_dim layout: wait, or the cat
    shard: Node
    gather_dim: int
    world_size: int
    group_name: str
    matmuls: tuple[MatmulUse, ...]
    contractions: tuple[ContractionUse, ...]
    # users of the gathered tensor other than the matmuls (the op then returns it)
    other_users: tuple[Node, ...]
    scaled: Scaled | None = None  # float8: the matmuls are _scaled_mm
    byte_view: torch.dtype | None = None  # float8 gathered as uint8, then viewed as this dtype


@dataclasses.dataclass(frozen=True)
class ReduceTerm:
    """One matmul whose result (through views and adds) the reduce-scatter scatters."""

    mm: Node  # aten.mm, aten.addmm, aten._scaled_mm, or aten.bmm with a shared mat2
    input: Node  # its left operand: 2-D, or a bmm's [B, M, K]
    mat2: Node
    bias: Node | None
    input_scale: Node | None = None  # a _scaled_mm's scales
    mat2_scale: Node | None = None
    mm_dtype: torch.dtype | None = None  # the dtype a scaled term is rounded to


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatterMatch:
    """mm, or a sum of mms (the input gradient of linears sharing one input) -> views
    [-> split/cat, or movedim to the front, for scatter_dim > 0] -> reduce_scatter -> wait;
    each term may be widened on the way (autocast's bf16 input gradients summed and scattered
    in fp32)."""

    terms: tuple[ReduceTerm, ...]
    between: tuple[Node, ...]  # the views, casts and adds from the matmuls to the scattered tensor
    scattered: Node  # the tensor the collective scatters, in its scatter_dim layout
    reduce_scatter: Node
    wait: Node
    scatter_dim: int
    reduce_op: str
    world_size: int
    group_name: str
    out_dtype: torch.dtype | None = None  # the scattered dtype, where casts widen the matmuls'
    # the permutation that moved scatter_dim to the front before the collective (spmd_types'
    # movedim form): the wait's value is the op's output permuted so; None for the other forms
    moved: tuple[int, ...] | None = None
    scaled: Scaled | None = None  # float8: the terms are _scaled_mm (rows_scale unused)


Match = AllGatherMatmulMatch | MatmulReduceScatterMatch


@dataclasses.dataclass(frozen=True)
class Candidate:
    kind: str
    collective: Node
    match: Match | None = None
    reason: str | None = None  # why there is no match


class NoMatch(Exception):
    """Raised inside the matchers to return a reason."""


def meta_val(node: Node | None):
    """The fake tensor (or other value) Inductor recorded for a node; None for non-nodes."""
    return node.meta.get("val") if isinstance(node, Node) else None


def _shape(node: Node) -> tuple | None:
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


SYMBOLIC_FEATURES = "a symbolic feature dim (the matmul's K): only token dims may be dynamic"


def _require_static_features(*nodes: Node) -> None:
    """The last dim (a matmul's K) must be an int; the leading (token) dims may be symbolic."""
    for node in nodes:
        shape = _shape(node)
        if shape and not static_shape(shape[-1:]):
            raise NoMatch(SYMBOLIC_FEATURES)


def keeps_order(view: Node) -> bool:
    """A view that keeps the elements in their row-major order: a reshape, an unsqueeze or a
    squeeze, or a permute that moves only dims of size 1 (einsum's lowering adds and moves such
    dims around its bmm). Between two tensors of the same last dim, such views keep every row
    intact, so they commute with `@ mat2`."""
    if view.target in VIEWS or view.target in SQUEEZES or view.target is aten.unsqueeze.default:
        return True
    shape = _shape(view.args[0]) if view.target is aten.permute.default else None
    if shape is None:
        return False
    moved = [d % len(shape) for d in view.args[1] if not same(shape[d], 1)]
    return moved == sorted(moved)


def _contiguous_copy(node: Node) -> bool:
    """A clone into the contiguous format (a reshape of a permuted tensor leaves one): the same
    values in row-major order."""
    return (
        node.target is aten.clone.default
        and len(node.args) == 1
        and node.kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format
    )


def shared_matrix(mat2: Node) -> bool:
    """Whether a bmm's mat2 [B, K, N] is one matrix for every batch element: a batch of 1, or a
    batch dim of stride 0 (a 2-D weight unsqueezed and expanded, as NeMo Automodel's linear
    writes it under torch.compile). Such a bmm is one matmul over its flattened rows."""
    val = meta_val(mat2)
    return isinstance(val, torch.Tensor) and val.dim() == 3 and (same(val.shape[0], 1) or same(val.stride(0), 0))


def batch_sum(bmm: Node) -> Node | None:
    """The node holding sum over the batch of ``bmm``'s products: the bmm itself for a batch
    of 1, else its only user where that sums dim 0; None otherwise."""
    if same(_shape(bmm)[0], 1):
        return bmm
    users = list(bmm.users)
    if len(users) != 1 or users[0].target is not aten.sum.dim_IntList or users[0].kwargs.get("dtype") is not None:
        return None
    dims = users[0].args[1] if len(users[0].args) > 1 else None
    return users[0] if dims is not None and [d % 3 for d in dims] == [0] else None


def _is_unit(value) -> bool:
    return value in (1, 1.0)


def _bias_of_addmm(mm: Node) -> Node:
    """The 1-D bias of an addmm with default alpha and beta, or NoMatch."""
    if not (_is_unit(mm.kwargs.get("alpha", 1)) and _is_unit(mm.kwargs.get("beta", 1))):
        raise NoMatch("addmm with alpha or beta other than 1")
    bias, out = mm.args[0], _shape(mm)
    shape = _shape(bias)
    if shape is None or out is None or not same_shape(shape, out[-1:]):
        described = list(shape) if shape is not None else "?"
        raise NoMatch(f"addmm bias of shape {described} is not one value per output column")
    return bias


_SCALED_MM_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


def scaled_mm_args(mm: Node) -> dict:
    """An aten._scaled_mm node's arguments by name, defaults filled in."""
    named = dict.fromkeys(_SCALED_MM_ARGS)
    named["use_fast_accum"] = False
    named.update(zip(_SCALED_MM_ARGS, mm.args))
    named.update(mm.kwargs)
    return named


def _check_scaled_mm(mm: Node) -> dict:
    """The arguments of a _scaled_mm the scaled ops take, or NoMatch."""
    named = scaled_mm_args(mm)
    if named["scale_result"] is not None:
        raise NoMatch("_scaled_mm with a result scale (a float8 output)")
    if named["out_dtype"] not in (torch.bfloat16, torch.float16, torch.float32):
        raise NoMatch(f"_scaled_mm with out_dtype {named['out_dtype']}")
    for name in ("scale_a", "scale_b"):
        val = meta_val(named[name])
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            raise NoMatch(f"_scaled_mm whose {name} is not a float32 tensor")
    b_scale = meta_val(named["scale_b"])
    if not (_tensorwise(b_scale) or tuple(b_scale.shape) == (1, _shape(mm)[-1])):
        raise NoMatch(f"_scaled_mm whose scale_b of shape {list(b_scale.shape)} is neither one value nor [1, N]")
    return named


def _tensorwise(scale: torch.Tensor) -> bool:
    return scale.dim() <= 1 and same(scale.numel(), 1)


def _node_names(nodes) -> str:
    return ", ".join(sorted({f"{n.name} ({_describe_target(n)})" for n in nodes}))


def _describe_target(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def _cat_dim(cat: Node) -> int:
    return cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)


def _equal_chunks(pieces: list[Node], world_size: int) -> tuple[Node, int] | None:
    """(source, dim) when ``pieces`` are ``world_size`` equal consecutive chunks of one tensor
    along ``dim``, in order, each read only once: getitems of a split, or slices."""
    if len(pieces) != world_size or any(len(p.users) != 1 for p in pieces):
        return None
    if all(p.target is operator.getitem for p in pieces):
        split = pieces[0].args[0]
        if split.target not in SPLITS or [p.args for p in pieces] != [
            (split, i) for i in range(world_size)
        ]:
            return None
        if len(split.users) != world_size:
            return None
        source = split.args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    elif all(p.target is aten.slice.Tensor for p in pieces):
        source = pieces[0].args[0]
        dim = pieces[0].args[1] if len(pieces[0].args) > 1 else 0
        size = _shape(source)[dim] // world_size if _shape(source) else None
        if size is None or not all(_slices(p, source, dim, i * size, (i + 1) * size) for i, p in enumerate(pieces)):
            return None
    else:
        return None
    shape = _shape(source)
    if shape is None:
        return None
    dim %= len(shape)
    sizes = [_shape(p)[dim] if _shape(p) else None for p in pieces]
    if None in sizes or not all(same(s, sizes[0]) for s in sizes):
        return None
    return (source, dim) if same(sizes[0] * world_size, shape[dim]) else None


def _slices(piece: Node, source: Node, dim: int, start, end) -> bool:
    """Whether ``piece`` is source[start:end] along ``dim`` (bounds as ints or SymInt nodes)."""
    args = tuple(piece.args) + (None, 0, None, None, 1)[len(piece.args) :]  # slice.Tensor's defaults
    bounds = [meta_val(a) if isinstance(a, Node) else a for a in args[2:4]]
    return args[:2] == (source, dim) and args[4] == 1 and same(bounds[0], start) and same(bounds[1], end)


# ---------------------------------------------------------------------------------------------
# all_gather -> matmul


def gathered_layout(wait: Node, shard: Node, world_size: int) -> tuple[Node, int]:
    """The node holding the gathered tensor and its gather dim (in the shard's dims).

    all_gather_into_tensor stacks shards along dim 0; a gather along dim d > 0 appears as
    one chunk per rank along dim 0 (split or slices) -> cat(dim d)."""
    pieces = [p for u in wait.users for p in (u.users if u.target in SPLITS else [u])]
    cats = {c for p in pieces for c in p.users if c.target is aten.cat.default}
    if len(cats) == 1:
        (cat,) = cats
        chunks = _equal_chunks(list(cat.args[0]), world_size)
        shape = _shape(shard)
        if chunks == (wait, 0) and shape is not None:
            cutters = {p.args[0] if p.target is operator.getitem else p for p in cat.args[0]}
            if set(wait.users) != cutters:
                raise NoMatch(
                    "the all-gather result (ranks stacked on dim 0) is also read outside the "
                    "split/cat that gathers it along a later dim"
                )
            return cat, _cat_dim(cat) % len(shape)
    return wait, 0


def is_transpose(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    return node.target is aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2])


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
            f"(not a linear): {_node_names([bmm])}"
        )
    elif bmm.args[1] is node and bmm.args[0] is not node:
        if batch_sum(bmm) is not None:
            contractions.append(_contraction(bmm, bmm.args[0], False))
            return True
        notes.append(_PER_BATCH_CONTRACTION + _node_names([bmm]))
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
    k = (_shape(gathered) or (None,))[-1]

    def visit(node: Node) -> None:
        shape = _shape(node) or ()
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
                    notes.append(_PER_BATCH_CONTRACTION + _node_names(user.users))
                    others.append(user)
            elif in_rows and user.target is aten.addmm.default and user.args[1] is node:
                try:
                    matmuls.append(MatmulUse(user, user.args[2], _bias_of_addmm(user)))
                except NoMatch as why:
                    notes.append(str(why))
                    others.append(user)
            elif in_rows and user.target is SCALED_MM and user.args[0] is node and user.args[1] is not node:
                try:
                    named = _check_scaled_mm(user)
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
                        f"rows (not a linear's rows or weight gradient): {_node_names([user])}"
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


MATMULS = (aten.mm.default, aten.addmm.default, SCALED_MM, BMM)


def _reaches_matmul(node: Node, depth: int = 4) -> bool:
    if node.target in MATMULS:
        return True
    return depth > 0 and any(_reaches_matmul(u, depth - 1) for u in node.users)


def _reached_from_matmul(node: Node, depth: int = 4) -> bool:
    if node.target in MATMULS:
        return True
    return depth > 0 and any(_reached_from_matmul(a, depth - 1) for a in node.all_input_nodes)


def next_to_matmul(collective: Node) -> bool:
    """Whether a collective is a tensor-parallel one: an all-gather whose result a matmul reads
    within a few nodes, or a reduce-scatter or all-reduce of a matmul's result."""
    if collective.target is ALL_GATHER:
        return _reaches_matmul(collective, depth=6)
    return _reached_from_matmul(collective.args[0], depth=6)


def under_views(node: Node) -> Node:
    """What ``node`` is a view, reshape or _unsafe_view of (through any chain of them)."""
    while isinstance(node, Node) and node.target in VIEWS:
        node = node.args[0]
    return node


def _why_no_matmul(gathered: Node, gather_dim: int, others: list[Node], notes: list[str]) -> str:
    shape = _shape(gathered)
    if shape is not None and gather_dim == len(shape) - 1 and _reaches_matmul(gathered):
        return "K-sharded gather: the gathered dim is the matmul's contraction dim"
    if notes:
        return notes[0]
    casts = [u for u in others if u.target in CASTS and _reaches_matmul(u)]
    if casts:
        return "dtype cast between the all-gather and the matmul"
    slices = [u for u in others if u.target in (aten.slice.Tensor, aten.narrow.default)]
    if slices and all(_reaches_matmul(u) for u in slices):
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
    return f"no matmul reads the gathered rows; users: {_node_names(others)}"


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
        chunks = _equal_chunks(list(node.args[0]), world_size)
        wait = chunks[0] if chunks and chunks[1] == 0 else None
    gather = wait.args[0] if wait is not None and wait.target is WAIT else None
    if gather is None or gather.target is not ALL_GATHER or tuple(gather.args[1:3]) != (world_size, group_name):
        raise NoMatch("the rows' rowwise scale is not all-gathered along with them")
    shard_scale = gather.args[0]
    if gathered_layout(wait, shard_scale, world_size) != (node, gather_dim) or not same(_shape(node)[-1], 1):
        raise NoMatch("the rows' rowwise scale is gathered along another dim than the rows")
    if not same(prod(_shape(node)), rows):
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
    if _tensorwise(meta_val(scale)):
        if depends_on(scale, gathered, graph_order(gathered.graph)):
            raise NoMatch("the rows' tensorwise scale is computed from the gathered tensor")
        return kept, Scaled(scale, False, out_dtype, fast)
    rows = prod(_shape(gathered)[:-1])
    if not same_shape(_shape(scale), (rows, 1)):
        raise NoMatch(f"the rows' scale of shape {list(_shape(scale))} is neither one value nor one per row")
    shard_scale, nodes = _gathered_scale(
        scale, rows, match_args["world_size"], match_args["group_name"], match_args["gather_dim"]
    )
    return kept, Scaled(shard_scale, True, out_dtype, fast, nodes)


def _match_all_gather(gather: Node) -> AllGatherMatmulMatch:
    shard, world_size, group_name = gather.args[:3]
    _require_static_features(shard, gather)
    users = list(gather.users)
    if len(users) != 1 or users[0].target is not WAIT:
        raise NoMatch("all-gather result is not read through exactly one wait_tensor")
    wait = users[0]
    gathered, gather_dim = gathered_layout(wait, shard, world_size)
    byte_view = _byte_view(gathered)
    if byte_view is not None:
        gathered = next(iter(gathered.users))
    matmuls, contractions, others, notes = _matmul_users(gathered)
    shape = _shape(gathered)
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
        _candidate(ALL_GATHER_MATMUL, node, _match_all_gather)
        for node in graph.find_nodes(op="call_function", target=ALL_GATHER)
    ]


# ---------------------------------------------------------------------------------------------
# matmul -> reduce_scatter


def _scattered_layout(collective_input: Node, world_size: int) -> tuple[Node, int, set[Node], tuple | None]:
    """The tensor being scattered, its scatter dim, the nodes between it and the collective, and
    the permutation that moved the scatter dim to the front (or None).

    reduce_scatter_tensor scatters along dim 0; a scatter along dim d > 0 appears as one chunk
    per rank along dim d (split or slices) -> cat(dim 0) in front of it (DTensor's form), or as
    the tensor with dim d moved to the front, made contiguous (spmd_types' form)."""
    node = collective_input
    if node.target is aten.cat.default and _cat_dim(node) == 0:
        pieces = list(node.args[0])
        chunks = _equal_chunks(pieces, world_size)
        if chunks is not None:
            return *chunks, {node, *pieces, *(p.args[0] for p in pieces)}, None
    moved = _moved_to_front(node)
    if moved is not None:
        return moved
    return node, 0, set(), None


def _moved_to_front(node: Node) -> tuple[Node, int, set[Node], tuple] | None:
    """(x, d, the nodes, the permutation) when ``node`` is x.movedim(d, 0) for d > 0, made
    contiguous or not: a permute that puts dim d first and keeps the others in order, then
    maybe a clone, each read only on the way to the collective."""
    between = set()
    if node.target is aten.clone.default and len(node.args) == 1 and len(node.users) == 1:
        between.add(node)  # a copy of the same values, in whatever layout
        node = node.args[0]
    if node.target is not aten.permute.default or len(node.users) != 1:
        return None
    rank = len(_shape(node) or ())
    perm = tuple(p % rank for p in node.args[1]) if rank else ()
    if not perm or perm[0] == 0 or perm != (perm[0], *(i for i in range(rank) if i != perm[0])):
        return None
    return node.args[0], perm[0], between | {node}, perm


def _one_user(node: Node) -> None:
    if len(node.users) != 1:
        raise NoMatch("matmul result has other users")


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype a cast node converts to, when converting the dtype is all it does."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1] if len(node.args) > 1 else None
    if node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.kwargs["dtype"]
    return None


def _widening(cast: Node) -> bool:
    """Whether ``cast`` only converts a bf16 or fp16 tensor to fp32, the dtype the op's
    reduction sums in (ops.py: out_dtype)."""
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
                f"bf16 or fp16 to fp32 ({_node_names([node])})"
            )
        between.append(node)
        _one_user(node.args[0])
        _sum_of_matmuls(node.args[0], terms, between, widened, True)
    elif node.target is aten.add.Tensor:
        operands = node.args[:2]
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            raise NoMatch(f"reduce-scatter input is a scaled sum: {_node_names([node])}")
        if _added_bias(node) is not None:
            _biased_term(node, terms, between, widened, cast_seen)
            return
        if not all(isinstance(a, Node) and same_shape(_shape(a), _shape(node)) for a in operands):
            raise NoMatch(
                f"reduce-scatter input adds a broadcast or scalar term: {_node_names([node])}"
            )
        between.append(node)
        for operand in operands:
            _one_user(operand)
            _sum_of_matmuls(operand, terms, between, widened, cast_seen)
    elif node.target is aten.mm.default:
        terms.append(ReduceTerm(node, node.args[0], node.args[1], None))
        widened.append(cast_seen)
    elif node.target is aten.addmm.default:
        terms.append(ReduceTerm(node, node.args[1], node.args[2], _bias_of_addmm(node)))
        widened.append(cast_seen)
    elif node.target is BMM:
        if not shared_matrix(node.args[1]):
            raise NoMatch(
                f"reduce-scatter input is a batched matmul with a different mat2 per batch "
                f"element (not a linear): {_node_names([node])}"
            )
        terms.append(ReduceTerm(node, node.args[0], node.args[1], None))
        widened.append(cast_seen)
    elif node.target is SCALED_MM:
        named = _check_scaled_mm(node)
        terms.append(
            ReduceTerm(
                node, named["self"], named["mat2"], named["bias"], named["scale_a"], named["scale_b"],
                named["out_dtype"],
            )
        )  # fmt: skip
        widened.append(cast_seen)
    elif node.target is aten.cat.default:
        raise NoMatch(
            f"reduce-scatter input is not a matmul result: {_node_names([node])} is not one equal "
            "chunk per rank (uneven shards are padded before the collective)"
        )
    elif between and between[-1].target is aten.add.Tensor:
        raise NoMatch(
            f"reduce-scatter input is not a sum of matmuls: the term {_node_names([node])} is not "
            "a matmul (e.g. a residual gradient added before the collective)"
        )
    else:
        raise NoMatch(f"reduce-scatter input is not a matmul result: {_node_names([node])}")


def _added_bias(add: Node) -> Node | None:
    """The operand of ``add`` that is one value per output column ([N], in the sum's dtype),
    where the other is of the sum's shape: a linear's bias added after its matmul (NeMo
    Automodel's bmm form; DTensor adds a row-parallel bias as bias / W on every rank)."""
    shape, val = _shape(add), meta_val(add)
    if not shape:
        return None
    for bias, other in (add.args[:2], add.args[1::-1]):
        if isinstance(bias, Node) and isinstance(other, Node) and same_shape(_shape(other), shape):
            bias_val = meta_val(bias)
            if same_shape(_shape(bias), shape[-1:]) and bias_val.dtype == val.dtype:
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
        raise NoMatch(f"a bias is added after the widening cast before the reduce-scatter: {_node_names([add])}")
    free = [i for i in range(found, len(terms)) if terms[i].bias is None]
    if not free:
        raise NoMatch(f"a bias is added to a matmul that has its own before the reduce-scatter: {_node_names([add])}")
    terms[free[0]] = dataclasses.replace(terms[free[0]], bias=bias)


def _match_reduce_scatter(reduce_scatter: Node) -> MatmulReduceScatterMatch:
    collective_input, reduce_op, world_size, group_name = reduce_scatter.args[:4]
    _require_static_features(collective_input, reduce_scatter)
    users = list(reduce_scatter.users)
    if len(users) != 1 or users[0].target is not WAIT:
        raise NoMatch("reduce-scatter result is not read through exactly one wait_tensor")
    if reduce_op not in ("sum", "avg"):
        raise NoMatch(f"reduce op {reduce_op!r} (only sum and avg)")
    scattered, scatter_dim, cutters, moved = _scattered_layout(collective_input, world_size)
    shape = _shape(scattered)
    if shape is None:
        raise NoMatch("scattered tensor has no shape metadata")
    if scatter_dim == len(shape) - 1:
        raise NoMatch("scatter along the matmul's N dim (the last dim)")
    if not set(scattered.users) <= cutters | {reduce_scatter}:
        raise NoMatch("matmul result has other users")

    terms, between, widened = [], [], []
    _sum_of_matmuls(scattered, terms, between, widened)
    if any(not same(_shape(t.mm)[-1], shape[-1]) for t in terms):
        raise NoMatch("reshape between matmul and reduce-scatter changes the last dim")
    _require_static_features(*(t.input for t in terms))
    if any(widened) and not all(widened):
        raise NoMatch("some matmuls of the sum are widened before the reduce-scatter and others not")
    scaled = _scaled_terms(terms)
    if scaled is not None and any(widened):
        narrow_adds = [n for n in between if n.target is aten.add.Tensor and meta_val(n).dtype == scaled.out_dtype]
        if narrow_adds:
            raise NoMatch(
                f"the scaled matmuls are summed in {scaled.out_dtype} before the widening cast "
                f"({_node_names(narrow_adds)}); the op sums them widened"
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
        if not (_tensorwise(scale) or same_shape(tuple(scale.shape), (_shape(term.input)[0], 1))):
            raise NoMatch(f"a scaled matmul's scale_a of shape {list(scale.shape)} is neither one value nor one per row")
    return Scaled(None, False, dtypes.pop(), fast.pop())


def find_matmul_reduce_scatters(graph: Graph) -> list[Candidate]:
    """One Candidate per reduce_scatter_tensor in ``graph``."""
    return [
        _candidate(MATMUL_REDUCE_SCATTER, node, _match_reduce_scatter)
        for node in graph.find_nodes(op="call_function", target=REDUCE_SCATTER)
    ]


def _candidate(kind: str, node: Node, matcher) -> Candidate:
    try:
        return Candidate(kind, node, match=matcher(node))
    except NoMatch as why:
        return Candidate(kind, node, reason=str(why))
    except Exception as error:  # a graph shape the matcher did not foresee: skip, never crash
        return Candidate(kind, node, reason=f"not understood ({type(error).__name__}: {error})")
