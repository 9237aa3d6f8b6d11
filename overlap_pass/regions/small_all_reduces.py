"""Last: each small all-reduce left in the graph as one overlap::all_reduce op.

    y = wait_tensor(all_reduce(x, op, group))   becomes   y = overlap.all_reduce(x, op, W, group)

at the wait's place. A functional all-reduce of a few KiB (float8's amaxes, merged or not, a
replicated weight's gradient, a decode step's activations) costs a collective's host steps and
an NCCL kernel on another stream that the next kernel waits for: all latency. The op runs it
through symmetric memory in two kernels that a per-call CUDA graph replays in one launch, on
the compute stream (all_reduce_op.py, lowering/all_reduce.py); which of that and NCCL runs is
chosen per size at the first call, as for the fused ops. Large all-reduces stay as they are:
the one-shot kernel moves W - 1 copies of the tensor into every rank, where NCCL's ring moves
about two.

Taken: at most config.small_all_reduce_bytes (a symbolic size at its value when traced: a call
over the limit at run time goes to NCCL), a float dtype and reduce op the kernel has
(all_reduce_op.py), read through one wait, on a group of more than one rank within one host.
Each all-reduce left in the graph gets a record (decisions.json's "small_all_reduces"), with
the reason where it stays.
"""

import torch
from torch.fx import Graph, Node

from .. import config

from ..fusion import decide
from ..graph import sizes
from ..graph.edits import call
from ..graph.nodes import ALL_REDUCE, WAIT, describe_node, meta_val
from ..ops import all_reduce_op, registry  # noqa: F401  (registry: registers torch.ops.overlap)

OP = torch.ops.overlap.all_reduce.default


def _why_not(node: Node, limit: int) -> str | None:
    source, reduce_op, group_name = node.args[:3]
    users = list(node.users)
    if len(users) != 1 or users[0].target is not WAIT:
        return "its result is not read through exactly one wait_tensor"
    val = meta_val(source)
    if not isinstance(val, torch.Tensor):
        return "unknown shape"
    if val.dtype not in all_reduce_op.DTYPES:
        return f"dtype {val.dtype}"
    if reduce_op not in all_reduce_op.REDUCE_OPS:
        return f"reduce op {reduce_op!r}"
    # a symbolic size is judged at its value when traced; at run time the op hands a larger
    # call to NCCL (lowering/dispatch.py)
    size = sizes.hint(sizes.prod(val.shape)) * val.element_size()
    if size > limit:
        return f"{size} bytes, over config.small_all_reduce_bytes ({limit}): NCCL's ring moves less"
    ranks = decide.group_ranks(group_name)
    if ranks is None:
        return f"group {group_name} cannot be resolved here"
    if len(ranks) < 2:
        return "group of size 1"
    if val.device.type == "cuda" and decide.spans_hosts(ranks):
        return "group spans hosts: symmetric memory needs every rank on one host"
    return None


def rewrite_all(graph: Graph) -> list[dict]:
    """Rewrites every small all-reduce (module docstring); returns a record per all-reduce."""
    limit = config.small_all_reduce_bytes
    records = []
    for node in list(graph.find_nodes(op="call_function", target=ALL_REDUCE)):
        source, reduce_op, group_name = node.args[:3]
        record = {"collective": describe_node(node), "reduce_op": reduce_op, "group": {"name": group_name}}
        reason = _why_not(node, limit) if limit > 0 else "config.small_all_reduce_bytes is 0"
        if reason is not None:
            records.append({**record, "rewritten": False, "reason": reason})
            continue
        wait = next(iter(node.users))
        with graph.inserting_before(wait):
            op = call(graph, OP, (source, reduce_op, len(decide.group_ranks(group_name)), group_name))
        wait.replace_all_uses_with(op)
        graph.erase_node(wait)
        graph.erase_node(node)
        records.append({**record, "rewritten": True, "op": op.name})
    return records
