"""What the matchers (find_all_gathers.py, find_reduce_scatters.py) return.

Every all_gather_into_tensor and reduce_scatter_tensor node is a candidate. Each comes back as a
Candidate holding either a frozen match record or the reason it does not match; a matcher
raises NoMatch to give that reason, naming the nodes it stopped at (node_names).
"""

import dataclasses

import torch
from torch.fx import Node

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


def candidate(kind: str, node: Node, matcher) -> Candidate:
    try:
        return Candidate(kind, node, match=matcher(node))
    except NoMatch as why:
        return Candidate(kind, node, reason=str(why))
    except Exception as error:  # a graph shape the matcher did not foresee: skip, never crash
        return Candidate(kind, node, reason=f"not understood ({type(error).__name__}: {error})")


def node_names(nodes) -> str:
    return ", ".join(sorted({f"{n.name} ({_describe_target(n)})" for n in nodes}))


def _describe_target(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)
