"""Before matching: split each all-reduce into a reduce-scatter and an all-gather around the
row-wise ops that follow it (tensor parallelism without sequence parallelism).

all_reduce(x) = all_gather(reduce_scatter(x)). In plain TP each row-parallel linear ends in an
all-reduce, and the next column-parallel linear reads its result after row-wise ops (residual
add, RMSNorm, casts; rows.py). Those ops give the same rows on a shard of the tokens, so

    y = all_reduce(mm(a, w));  h = norm(x + y);  z = mm(h, w2)
becomes
    ys = reduce_scatter(mm(a, w));  hs = norm(x[rank's rows] + ys);  z = mm(all_gather(hs), w2)

and the matchers that run next fuse the reduce-scatter with its matmul and the all-gather with
its consumers. The tokens are the flattened leading dims: rank r holds rows [r T/W, (r+1) T/W),
the reduce-scatter's and the all-gather's order. A sum of all-reduces (DTensor all-reduces the
input gradient of Q, K and V one by one) becomes one reduce-scatter of the sum.

- A region tensor read by anything else (a graph output, a saved activation, an op that is not
  row-wise) is all-gathered for it; where a matmul reads it, that gather is fused.
- A sum over every token (a norm weight's or a bias's gradient) becomes the shard's sum,
  all-reduced: sums are linear.
- A region is split when the bytes its collectives then move outside a fused op are fewer than
  its all-reduces move.

Numerics: each token's sum over ranks now runs in the reduce-scatter (in fp32, in rank order, on
GPUs), a sum of all-reduces is reduced once, and a sum over tokens adds the shards' sums: the
order of these sums differs from NCCL's all-reduce, as a different NCCL algorithm's would.

Operands that a region op reads from outside it (the residual, a saved activation) are sliced to
the rank's rows. That is exact when they hold the same values on every rank, as every such
tensor does in plain TP. Matmul and reduce-scatter outputs, and anything computed from them,
count as rank-local and are never sliced; graph inputs count as replicated.

The slices name the rank, so each rank's graph differs: the pass's cache key carries the rank.

The same regions start at an all-gather whose result no matmul reads directly, where the
quantization of float8 training (torchao's Float8Linear) sits between the gather and its
_scaled_mm: abs, amax, scale and cast are row-wise, or reductions over every token. They then run
on the rank's shard, and the float8 data and its rowwise scales are gathered instead, fused with
the scaled matmuls (half the bytes of a bf16 gather). A tensorwise scale's amax over the gathered
tensor becomes each shard's amax, all-reduced with max: exactly the same value. The gathered rows
of an all-gather along a later dim (DTensor's split/cat) are not the token order's blocks, so
such a region reads no row-shaped operand from outside.

This module holds what a region is (Region, Layout) and what finding, judging and rewriting one
all read of the matmuls around it. split_walk.py finds the regions and decides each
(split_cost.py: whether it pays; split_records.py: its decisions.json records); split_apply.py
rewrites the accepted ones onto the shard.
"""

import dataclasses

import torch
from torch.fx import Node

from ..graph.nodes import SCALED_MM, VIEWS, is_transpose
from ..graph.sizes import same
from . import rows

aten = torch.ops.aten
ENTRY = "entry"  # a region's rule for the node holding an all-reduced value
_MATMULS = (aten.mm.default, aten.addmm.default)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which rows a rank's shard holds. ``dim`` None: the r-th 1/W of the flattened tokens (a
    reduce-scatter's, an all-gather's along dim 0); else the r-th 1/W along ``dim`` of the
    gathered ``shape`` (an all-gather along a later dim)."""

    dim: int | None = None
    shape: tuple = ()


FLAT = Layout()


@dataclasses.dataclass
class Region:
    """Row-wise ops reached from one or more all-reduces or all-gathers, all in one group, on one
    token count and row layout."""

    group_name: str
    world_size: int
    rank: int
    tokens: int
    layout: Layout = FLAT
    split_from: int | None = None  # on a symbolic count: the fewest tokens at which it splits
    split_elsewhere: bool = False  # whole here, split in the graph of another range of counts
    entries: dict = dataclasses.field(default_factory=dict)  # entry node -> its all-reduces
    gathers: dict = dataclasses.field(default_factory=dict)  # entry node -> its all-gather
    absorbed: set = dataclasses.field(default_factory=set)  # the collectives, waits and adds
    nodes: dict = dataclasses.field(default_factory=dict)  # region node -> rows.* rule
    token_reductions: list = dataclasses.field(default_factory=list)
    exits: dict = dataclasses.field(default_factory=dict)  # region node -> its outside users
    sliced: set = dataclasses.field(default_factory=set)  # outside operands cut to the shard
    split: bool = False
    reason: str = ""


def matmul_readers(node: Node) -> list[Node]:
    """The matmuls that read ``node`` (through reshapes and a transpose), and the scaled
    matmuls that read it as their rows or their scales: its all-gather will be fused there."""
    found = []
    for user in node.users:
        if user.target in _MATMULS or (user.target is SCALED_MM and node in (user.args[0], user.args[2])):
            found.append(user)
        elif user.target in VIEWS or is_transpose(user):
            found += matmul_readers(user)
    return found


def feeds_matmul(node: Node) -> bool:
    return bool(matmul_readers(node))


def feeds_scaled_mm(node: Node) -> bool:
    """Whether a scaled matmul reads ``node`` (through reshapes) as its rows or their scales."""
    return any(
        (user.target is SCALED_MM and node in (user.args[0], user.args[2]))
        or (user.target in VIEWS and feeds_scaled_mm(user))
        for user in node.users
    )


def feeds_from_matmul(node: Node) -> bool:
    """Whether ``node`` is a matmul's (or scaled matmul's) result seen through reshapes and adds
    (the reduce-scatter will be fused with it)."""
    while node.target in VIEWS:
        node = node.args[0]
    if node.target is aten.add.Tensor:
        return all(isinstance(a, Node) and feeds_from_matmul(a) for a in node.args[:2])
    return node.target in _MATMULS or node.target is SCALED_MM


ROWS_OPERAND = {aten.mm.default: 0, aten.addmm.default: 1}  # which argument holds a matmul's rows


def padded_producer(reduced: Node, tokens) -> tuple[list[Node], Node] | None:
    """(the views on the way, the matmul) where ``reduced`` is a matmul's result whose [T, k]
    rows a padded split can pad and multiply again, so that its reduce-scatter still fuses."""
    views, producer = [], reduced
    while producer.target in VIEWS:
        views.append(producer)
        producer = producer.args[0]
    if producer.target not in ROWS_OPERAND:
        return None
    shape = rows.tensor_shape(producer.args[ROWS_OPERAND[producer.target]])
    return (views, producer) if len(shape) == 2 and same(shape[0], tokens) else None


def padded_readers(user: Node, node: Node, tokens) -> tuple[Node, list[Node]] | None:
    """(what they read, the matmuls) where ``user`` is a matmul reading ``node`` ([T, n]) as
    its rows, or a reshape of it to [T, n] read only so: a padded split runs them on the padded
    gathered rows and slices their results, so that its all-gather fuses with them."""
    source = user if user.target in VIEWS else node
    matmuls = list(user.users) if user.target in VIEWS else [user]
    shape = rows.tensor_shape(source)
    if shape is None or len(shape) != 2 or not same(shape[0], tokens) or not matmuls:
        return None
    if not all(m.target in ROWS_OPERAND and m.args[ROWS_OPERAND[m.target]] is source for m in matmuls):
        return None
    return source, matmuls


def random(target) -> bool:
    """Whether ``target`` draws random values (two calls, two values; each rank its own)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
