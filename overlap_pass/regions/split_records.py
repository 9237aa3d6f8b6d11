"""The all-reduce split's records for decisions.json: one per all-reduce it considered, and
one per all-gather whose quantization it moved before the gather.
"""

from torch.fx import Node

from ..graph.nodes import ALL_REDUCE, describe_node
from ..graph.records import Decision
from ..graph.sizes import divisible
from .split_regions import Region, feeds_matmul

KIND = "all_reduce_split"
GATHER_KIND = "quantize_before_gather"


def record(collective: Node, reason: str | None) -> Decision:
    kind = KIND if collective.target is ALL_REDUCE else GATHER_KIND
    decision = Decision.of(kind, collective, group={"name": collective.args[2]})
    decision.reason = reason
    return decision


def with_region(decision: Decision, region: Region, all_reduces: list[Node]) -> Decision:
    """``decision`` with what the split found for ``region``: split or why not, and how."""
    decision.rewritten = region.split
    decision.reason = None if region.split else region.reason
    decision.facts["group"] = {"name": region.group_name, "size": region.world_size}
    decision.notes["split"] = {
        "cost": region.reason,
        "all_reduces": sorted(ar.name for ar in all_reduces),
        "all_gathers": sorted(g.name for g in region.gathers.values()),
        "row_wise_ops": len(region.nodes) - len(region.entries) - len(region.gathers),
        "sliced_operands": sorted(n.name for n in region.sliced),
        "gathered": [
            {
                **describe_node(n),
                "fused_with_matmul": feeds_matmul(n),
                "read_by": sorted({describe_node(u)["op"] for u in users}),
            }
            for n, users in sorted(region.exits.items(), key=lambda item: item[0].name)
        ],
        "reduced_over_tokens": sorted(n.name for n in region.token_reductions),
        "padded": _padding_note(region),
        "split_from_tokens": region.split_from,
        "in_another_graph": region.split_elsewhere,
    }
    return decision


def _padding_note(region: Region) -> str | None:
    """How the shards are padded where W does not divide the token count (for every value of
    its symbols), else None."""
    if divisible(region.tokens, region.world_size):
        return None
    return (
        f"{region.tokens} tokens padded with zero rows to a multiple of {region.world_size}: each shard "
        "holds ceil(tokens / W) rows; the padding is sliced off the gathered rows, and reductions "
        "over tokens read the real rows alone"
    )
