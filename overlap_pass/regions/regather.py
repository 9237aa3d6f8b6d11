"""Gathered activations recomputed in the backward (``config.regather_in_backward``): a stage
of the joint graph, which pipeline/passes.RegatherPass runs before the partitioner.

A column-parallel linear's weight gradient reads its gathered input. The partitioner saves that
gathered tensor for the backward (it never recomputes a collective on its own): W shards of
activation memory a gather, and overlap's forward op copies the gathered rows out of its
workspace to return them. Megatron-LM's sequence parallelism saves the shard instead and gathers
it again in the backward. With the flag on, this joint-graph pass marks each gather of a forward
activation MUST_RECOMPUTE, as activation checkpointing marks what it recomputes: the collective,
its wait, and the view ops that put the gathered rows in shape (up to the matmuls). The
partitioner then saves the shard, and the backward's gather is fused with the weight-gradient
matmuls it feeds (an all_gather_matmul with contractions, regions the pass already takes under
activation checkpointing), its traffic under their GEMMs. A parameter's gather traced into the
graph (an FSDP that compiles its own collectives) is a gather of the forward too, and is marked
alike.
"""

import operator

import torch
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from .tail_matmuls import reachable

aten, prims = torch.ops.aten, torch.ops.prims
c10d = torch.ops._c10d_functional
GATHERS = (c10d.all_gather_into_tensor.default,)
# what a gather's rows pass through before a matmul reads them (DTensor's gather along a dim
# other than 0 splits the gathered rows and concatenates the pieces; autocast casts them)
RESHAPES = {
    c10d.wait_tensor.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.unsqueeze.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.slice.Tensor,
    aten.clone.default, aten.alias.default, aten._to_copy.default, prims.convert_element_type.default,
}  # fmt: skip
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)  # (their pieces: getitem)


def _depends_on_tangents(graph: Graph) -> set[Node]:
    """The joint graph's backward: every node that reads a tangent, directly or not."""
    backward: set[Node] = set()
    for node in graph.nodes:  # (topological order)
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif any(i in backward for i in node.all_input_nodes):
            backward.add(node)
    return backward


def _reshaped_rows(gather: Node, backward: set[Node]) -> list[Node]:
    """The gather and what its rows pass through in the forward (RESHAPES, and getitem of a
    split) on every path, up to the first node of another kind."""

    def step(node: Node) -> list[Node]:
        return [
            u for u in node.users
            if u not in backward and (u.target in RESHAPES or (u.target is operator.getitem and node.target in SPLITS))
        ]  # fmt: skip

    return [gather, *reachable(gather, step)]


def mark_gathers_recomputed(graph: Graph) -> int:
    """Marks each gather of a forward activation, and its rows' reshapes, MUST_RECOMPUTE (all
    found before any is marked); returns how many gathers. A node the user's activation
    checkpointing marked keeps its mark."""
    backward = _depends_on_tangents(graph)
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target in GATHERS and n not in backward]
    marked = [node for gather in gathers for node in _reshaped_rows(gather, backward)]
    for node in marked:
        node.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)
    return len(gathers)
