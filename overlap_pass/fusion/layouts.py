"""Where a collective along a later dim puts its tensor. all_gather_into_tensor stacks the
ranks' shards along dim 0 and reduce_scatter_tensor scatters along dim 0; a gather or scatter
along dim d > 0 appears around them as one equal chunk per rank (split or slices) and a cat
(DTensor's form), or as dim d moved to the front (spmd_types' form, for a reduce-scatter).
"""

import operator

import torch
from torch.fx import Node

from ..graph.nodes import SPLITS, meta_val, tensor_shape
from ..graph.sizes import same
from .matches import NoMatch

aten = torch.ops.aten


def cat_dim(cat: Node) -> int:
    return cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)


def equal_chunks(pieces: list[Node], world_size: int) -> tuple[Node, int] | None:
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
        size = tensor_shape(source)[dim] // world_size if tensor_shape(source) else None
        if size is None or not all(_slices(p, source, dim, i * size, (i + 1) * size) for i, p in enumerate(pieces)):
            return None
    else:
        return None
    shape = tensor_shape(source)
    if shape is None:
        return None
    dim %= len(shape)
    sizes = [tensor_shape(p)[dim] if tensor_shape(p) else None for p in pieces]
    if None in sizes or not all(same(s, sizes[0]) for s in sizes):
        return None
    return (source, dim) if same(sizes[0] * world_size, shape[dim]) else None


def _slices(piece: Node, source: Node, dim: int, start, end) -> bool:
    """Whether ``piece`` is source[start:end] along ``dim`` (bounds as ints or SymInt nodes)."""
    args = tuple(piece.args) + (None, 0, None, None, 1)[len(piece.args) :]  # slice.Tensor's defaults
    bounds = [meta_val(a) if isinstance(a, Node) else a for a in args[2:4]]
    return args[:2] == (source, dim) and args[4] == 1 and same(bounds[0], start) and same(bounds[1], end)


def gathered_layout(wait: Node, shard: Node, world_size: int) -> tuple[Node, int]:
    """The node holding the gathered tensor and its gather dim (in the shard's dims).

    all_gather_into_tensor stacks shards along dim 0; a gather along dim d > 0 appears as
    one chunk per rank along dim 0 (split or slices) -> cat(dim d)."""
    pieces = [p for u in wait.users for p in (u.users if u.target in SPLITS else [u])]
    cats = {c for p in pieces for c in p.users if c.target is aten.cat.default}
    if len(cats) == 1:
        (cat,) = cats
        chunks = equal_chunks(list(cat.args[0]), world_size)
        shape = tensor_shape(shard)
        if chunks == (wait, 0) and shape is not None:
            cutters = {p.args[0] if p.target is operator.getitem else p for p in cat.args[0]}
            if set(wait.users) != cutters:
                raise NoMatch(
                    "the all-gather result (ranks stacked on dim 0) is also read outside the "
                    "split/cat that gathers it along a later dim"
                )
            return cat, cat_dim(cat) % len(shape)
    return wait, 0


def scattered_layout(collective_input: Node, world_size: int) -> tuple[Node, int, set[Node], tuple | None]:
    """The tensor being scattered, its scatter dim, the nodes between it and the collective, and
    the permutation that moved the scatter dim to the front (or None).

    reduce_scatter_tensor scatters along dim 0; a scatter along dim d > 0 appears as one chunk
    per rank along dim d (split or slices) -> cat(dim 0) in front of it (DTensor's form), or as
    the tensor with dim d moved to the front, made contiguous (spmd_types' form)."""
    node = collective_input
    if node.target is aten.cat.default and cat_dim(node) == 0:
        pieces = list(node.args[0])
        chunks = equal_chunks(pieces, world_size)
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
    rank = len(tensor_shape(node) or ())
    perm = tuple(p % rank for p in node.args[1]) if rank else ()
    if not perm or perm[0] == 0 or perm != (perm[0], *(i for i in range(rank) if i != perm[0])):
        return None
    return node.args[0], perm[0], between | {node}, perm
