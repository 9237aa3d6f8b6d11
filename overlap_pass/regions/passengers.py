"""Passengers: plain all-gathers that ride along in a fused all-gather op of the same rows.

torchao's rowwise recipe quantizes a gathered tensor twice: once per row, for the matmul (which
all_gather_scaled_matmul fuses), and once per column across the tokens, for the weight gradient.
The all-reduce split (split_*.py) moves that second cast before the gather too (its column amax
all-reduced from the shards'), but nothing fuses the gather: in the forward its result is saved
for the backward, in the backward the weight gradient's _scaled_mm reads it as its mat2. Left
alone it is an NCCL collective of its own, on the critical path after the op. As a passenger it
moves in the op's call instead, with the copy engine after the op's own chunks, behind its
matmul (scaled_ops.py). Plain tensor parallelism leaves such gathers in bf16 graphs too: the
split all-reduce (split_apply.py) regathers what the forward saves for the backward (the
residual stream, a norm's rsqrt) where AOTAutograd saved it whole; they ride in the next
all_gather_matmul of the same rows (ops/matmul_ops.py) the same way.

A plain all-gather rides in the earliest op of the graph that gathers the same rows (same
group, gather dim and leading dims) and whose inputs it does not need: the nodes that compute
its shard move up before that op (rewrite.attach_passenger), nothing else moves. Every plain
all-gather left in a graph that has such ops gets a record: which op it rides in, or why none.
"""

import dataclasses

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from .. import config
from ..fusion import rewrite
from ..fusion.layouts import gathered_layout
from ..fusion.matches import NoMatch
from ..graph.nodes import ALL_GATHER, WAIT, depends_on, describe_node, graph_order, meta_val
from ..graph.records import Decision
from ..ops import registry  # noqa: F401  (registers torch.ops.overlap)

KIND = "all_gather_passenger"


@dataclasses.dataclass(frozen=True)
class HostArgs:
    """Where a host op's arguments sit: gather_dim, world_size and group_name from ``gather_dim``
    on, the passengers at ``passengers``, right after optional arguments with ``defaults``."""

    gather_dim: int
    passengers: int
    defaults: tuple


HOSTS = {
    # ..., use_fast_accum=False, return_gathered=False, passengers
    torch.ops.overlap.all_gather_scaled_matmul.default: HostArgs(5, 11, (False, False)),
    # ..., return_gathered=False, contract_with=None, gathered_left=None, passengers
    torch.ops.overlap.all_gather_matmul.default: HostArgs(3, 9, (False, None, None)),
}


def host_nodes(graph: Graph) -> list[Node]:
    return [n for target in HOSTS for n in graph.find_nodes(op="call_function", target=target)]


@dataclasses.dataclass(frozen=True)
class Rider:
    """shard -> all_gather -> wait [-> split/cat for gather_dim > 0] = gathered."""

    gather: Node
    gathered: Node
    shard: Node
    gather_dim: int
    world_size: int
    group_name: str


def _rider(gather: Node) -> Rider:
    shard, world_size, group_name = gather.args[:3]
    users = list(gather.users)
    if len(users) != 1 or users[0].target is not WAIT:
        raise NoMatch("the all-gather result is not read through exactly one wait_tensor")
    gathered, gather_dim = gathered_layout(users[0], shard, world_size)
    if not isinstance(meta_val(shard), torch.Tensor) or meta_val(shard).dim() < 2:
        raise NoMatch("the shard is not a tensor of rows")
    return Rider(gather, gathered, shard, gather_dim, world_size, group_name)


def _rows(shard: Node) -> tuple:
    return tuple(meta_val(shard).shape[:-1])


def _same_rows(host: Node, rider: Rider) -> bool:
    at = HOSTS[host.target].gather_dim
    shard, gather_dim, world_size, group_name = host.args[0], *host.args[at : at + 3]
    ndim = len(_rows(shard)) + 1
    return (gather_dim % ndim, world_size, group_name) == (
        rider.gather_dim % ndim,
        rider.world_size,
        rider.group_name,
    ) and _rows(shard) == _rows(rider.shard)


def _host_for(graph: Graph, rider: Rider) -> tuple[Node | None, str | None]:
    """(the earliest op the rider can ride in, None), or (None, why none)."""
    hosts = [h for h in host_nodes(graph) if _same_rows(h, rider)]
    if not hosts:
        return None, "no fused all-gather op in the graph gathers the same rows over the same group"
    order = graph_order(graph)
    causes = set()
    for host in sorted(hosts, key=order.__getitem__):
        # the shard must be computable before the op, and the op must not need the gathered rows
        if depends_on(rider.shard, host, order):
            causes.add("its shard is computed from the results of")
        elif depends_on(host, rider.gather, order):
            causes.add("its gathered tensor is read by")
        else:
            return host, None
    return None, " or ".join(sorted(causes)) + " every fused all-gather op of the same rows"


def attach_all(graph: Graph, all_gathers: list[Node]) -> tuple[list[Decision], dict[str, Node]]:
    """Makes each plain all-gather of ``all_gathers`` still in the graph a passenger where it
    can (in graph order, on the live graph: a rider attached changes what the next may ride
    in); returns a record per all-gather considered, and the op each host that took riders
    ended up as, by the host's name. Nothing is considered where the graph has no fused
    all-gather op."""
    if not config.gather_passengers or not host_nodes(graph):
        return [], {}
    alive = set(graph.find_nodes(op="call_function", target=ALL_GATHER))
    order = graph_order(graph)
    records = []
    replaced = {}  # host op name -> the op that took its place with one more rider
    for gather in sorted((g for g in all_gathers if g in alive), key=order.__getitem__):
        record = Decision.of(KIND, gather, group={"name": gather.args[2], "size": gather.args[1]})
        host_op = None
        try:
            rider = _rider(gather)
            host, reason = _host_for(graph, rider)
        except NoMatch as why:
            host, reason = None, str(why)
        if host is not None:
            host_name = host.name
            op = rewrite.attach_passenger(graph, host, rider, HOSTS[host.target])
            replaced[host_name] = op
            stable_topological_sort(graph)  # the next rider's dependencies are read from the order
            record.rewritten, host_op = True, op
        else:
            record.reason = reason
        records.append((record, host_op))

    def final(op: Node) -> Node:
        while op.name in replaced:
            op = replaced[op.name]
        return op

    for record, op in records:  # each rider named with the op it rides in at the end
        if op is not None:
            op = final(op)
            record.implementation, record.op = f"rides in {op.name}", op.name
            record.notes["rides_in"] = describe_node(op)
    return [record for record, _ in records], {name: final(op) for name, op in replaced.items()}
