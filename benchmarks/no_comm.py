"""A lower bound for the benchmarks, not a model: Inductor with every collective of the post-grad
graphs replaced by a local op of the same output shape, so the compiled step does all its
arithmetic and memory traffic and no communication. What overlap could reach if it hid every
byte it moves; its results are wrong by design (benchmarks/bench_model.py names it
``no_communication`` and does not check its numerics).

- all_gather_into_tensor(x) -> x repeated world-size times along dim 0 (the gathered tensor is
  still written once, as the all-gather writes it);
- reduce_scatter_tensor(x) -> the first 1/world-size of x's rows (a view);
- all_reduce(x) -> a copy of x;
- wait_tensor of any of these -> nothing.

Other collectives (coalesced ones, all-to-all) stay, with their waits and their traffic; a
warning names them.
"""

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

log = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _stand_in(graph: Graph, node: Node) -> Node | None:
    """The local node that takes collective ``node``'s place, or None to leave it."""
    if node.target is _c10d.all_gather_into_tensor.default:
        x, world = node.args[0], node.args[1]
        repeats = [world] + [1] * (len(x.meta["val"].shape) - 1)
        return graph.call_function(aten.repeat.default, (x, repeats))
    if node.target is _c10d.reduce_scatter_tensor.default:
        x, world = node.args[0], node.args[2]
        rows = x.meta["val"].shape[0] // world
        return graph.call_function(aten.slice.Tensor, (x, 0, 0, rows))
    if node.target is _c10d.all_reduce.default:
        return graph.call_function(aten.clone.default, (node.args[0],))
    return None


def drop_communication(graph: Graph) -> int:
    """Replace the collectives of ``graph`` as the module says; returns how many."""
    stand_ins = set()
    for node in list(graph.nodes):
        if node.target is _c10d.wait_tensor.default and node.args[0] in stand_ins:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        with graph.inserting_before(node):
            local = _stand_in(graph, node)
        if local is None:
            continue
        local.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(local)
        graph.erase_node(node)
        stand_ins.add(local)
    kept = sorted({str(n.target) for n in graph.nodes if "c10d" in str(n.target)})
    if kept:
        log.warning("no_communication: %s stay in the graph, and their communication with them", kept)
    graph.lint()
    return len(stand_ins)


class NoCommunication(CustomGraphPass):
    """drop_communication as Inductor's post_grad_custom_pre_pass."""

    def __call__(self, graph: Graph) -> None:
        drop_communication(graph)

    def uuid(self):
        return None  # never cached: a cached graph must not stand in for a real one


if __name__ == "__main__":  # a module the tools import, not a tool: --help says what it is
    print(__doc__)
