"""Before matching: a permute that moves a gathered tensor's rank dim moves in front of the gather.

all_gather_into_tensor stacks the ranks' shards along dim 0. A model whose sequence-parallel
reduce-scatter moves seq to the front first (spmd_types, Megatron code on [batch, seq, dim]
activations: `reduce_scatter(x.movedim(1, 0)).movedim(0, 1)`) gets, in its backward, the
gradient's all-gather along that front dim followed by the permute that moves it back:

    g = wait(all_gather(x))            # [W*S/W, B, D]: ranks stacked on dim 0
    p = permute(g, [1, 0, 2])          # [B, S, D]: then clone -> view -> mm

No matmul reads the gathered rows in the order they were gathered. The same values are the
gather along dim 1 of the permuted shard, which is the form the all-gather + matmul rewrite
takes (one chunk per rank along dim 0 -> cat along dim 1):

    x' = clone(permute(x, [1, 0, 2]))  # [B, S/W, D], one rank's share: a copy of 1/W
    g' = wait(all_gather(x'))          # [W*B, S/W, D]
    p  = cat(split(g', B, 0), 1)       # [B, S, D]

Only where the permute is the gathered tensor's one reader and it moves dim 0 to some dim d
while keeping the other dims in their order (a movedim(0, d)).
"""

import dataclasses
import operator

import torch
from torch.fx import Graph, Node

from ..graph.edits import call
from ..graph.nodes import ALL_GATHER, WAIT

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class PermuteMove:
    gather: Node
    wait: Node
    permute: Node
    dim: int  # where the permute puts the rank dim


def _moved_dim(permute: Node, rank: int) -> int | None:
    """d where ``permute`` is movedim(0, d) with d > 0 on a tensor of ``rank`` dims."""
    order = [d % rank for d in permute.args[1]]
    if len(order) != rank or 0 not in order:
        return None
    dim = order.index(0)
    rest = order[:dim] + order[dim + 1 :]
    return dim if dim > 0 and rest == list(range(1, rank)) else None


def _plan_one(gather: Node) -> PermuteMove | None:
    val = gather.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or len(gather.users) != 1:
        return None
    (wait,) = gather.users
    if wait.target is not WAIT or len(wait.users) != 1:
        return None
    (permute,) = wait.users
    if permute.target is not aten.permute.default:
        return None
    dim = _moved_dim(permute, val.dim())
    return None if dim is None else PermuteMove(gather, wait, permute, dim)


def plan(graph: Graph) -> list[PermuteMove]:
    """The permutes to move, one per all-gather (nothing is changed here)."""
    moves = [_plan_one(g) for g in graph.find_nodes(op="call_function", target=ALL_GATHER)]
    return [m for m in moves if m is not None]


def apply(graph: Graph, moves: list[PermuteMove]) -> dict[Node, str]:
    """Moves each permute; returns {the all-gather that replaced the move's: "movedim(0, d)"}."""
    moved = {}
    for move in moves:
        gather, shard = move.gather, move.gather.args[0]
        world_size = gather.args[1]
        with graph.inserting_before(gather):
            permuted = call(graph, aten.permute.default, (shard, list(move.permute.args[1])))
            contiguous = call(graph, aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
            new_gather = call(graph, gather.target, (contiguous, *gather.args[1:]), dict(gather.kwargs))
        with graph.inserting_before(move.wait):
            new_wait = call(graph, WAIT, (new_gather,))
        with graph.inserting_before(move.permute):
            rows = permuted.meta["val"].shape[0]  # one rank's chunk of the new dim 0
            split = call(graph, aten.split.Tensor, (new_wait, rows))
            chunks = [call(graph, operator.getitem, (split, i)) for i in range(world_size)]
            cat = call(graph, aten.cat.default, (chunks, move.dim))
        move.permute.replace_all_uses_with(cat)
        for node in (move.permute, move.wait, gather):
            graph.erase_node(node)
        moved[new_gather] = f"movedim(0, {move.dim})"
    return moved
