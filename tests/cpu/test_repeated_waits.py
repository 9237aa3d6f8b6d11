"""A collective waited on more than once, on real gloo ranks: the graph form torch 2.15 leaves in
DeepSeek-V3's MoE backward (one all-gather, a wait_tensor and its own slices and cat for each
reader), built directly with make_fx so that every torch version sees it. The later waits merge
into the first (waits.py), the collective is rewritten, and the rewritten graph computes what
the graph did before the pass."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_pass.regions import passengers, split_cost
from overlap_pass.pipeline.stages import run as overlap_graph_pass
from overlap_pass.graph.nodes import ALL_GATHER, REDUCE_SCATTER, WAIT

c10d = torch.ops._c10d_functional
AGM, MRS, SPLIT = "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_split"
TOL = dict(atol=2e-5, rtol=2e-5)


def _gather(x, world_size, group):
    return c10d.all_gather_into_tensor(x, world_size, group)


def _along(wait, dim, world_size):
    """The gathered tensor along ``dim``: the ranks' chunks of dim 0 (slices), cat on ``dim``
    (how funcol gathers along a later dim)."""
    rows = wait.shape[0] // world_size
    return torch.cat([wait[r * rows : (r + 1) * rows] for r in range(world_size)], dim)


def two_waits(x, w1, w2, world_size, group):
    g = _gather(x, world_size, group)
    return c10d.wait_tensor(g) @ w1, c10d.wait_tensor(g) @ w2


def wait_of_a_wait(x, w1, w2, world_size, group):
    first = c10d.wait_tensor(_gather(x, world_size, group))
    return first @ w1, c10d.wait_tensor(first) @ w2


def two_waits_later_dim(x, w1, other, world_size, group):
    """DeepSeek-V3's backward: the output gradient [B, S/W, D] gathered along the sequence,
    read by a matmul and a weight gradient through one wait's cat, and by an index gather (the
    routed experts' tokens) through another wait's cat."""
    g = _gather(x, world_size, group)
    first = _along(c10d.wait_tensor(g), 1, world_size).reshape(-1, x.shape[-1])
    second = _along(c10d.wait_tensor(g), 1, world_size).reshape(-1, x.shape[-1])
    tokens = torch.arange(second.shape[0] - 1, -1, -1).unsqueeze(1).expand(-1, x.shape[-1])
    return first @ w1, first.t() @ other, torch.gather(second, 0, tokens)


def reduce_scatter_two_waits(a, w, world_size, group):
    r = c10d.reduce_scatter_tensor(a @ w, "sum", world_size, group)
    return c10d.wait_tensor(r).sin(), c10d.wait_tensor(r).cos()


def passenger_two_waits(x, w1, y, world_size, group):
    """A gather a matmul reads, and a plain gather of the same rows read through two waits: the
    plain one rides in the fused op."""
    out = c10d.wait_tensor(_gather(x, world_size, group)) @ w1
    g = _gather(y, world_size, group)
    return out, c10d.wait_tensor(g).sin(), c10d.wait_tensor(g).cos()


def all_reduce_two_waits(a, w, w2, world_size, group):
    """Plain TP: an all-reduced matmul read by the next matmuls through two waits."""
    r = c10d.all_reduce(a @ w, "sum", group)
    return c10d.wait_tensor(r) @ w2, c10d.wait_tensor(r) @ w2.t()


PLAIN = (AGM, False)  # a plain all-gather: no matmul reads it
FORMS = {
    # name: (fn, its inputs' shapes at world size W (the shard or the scattered rows first),
    #        every record's (kind, rewritten))
    "two_waits": (two_waits, lambda W: [(4, 8), (8, 5), (8, 3)], [(AGM, True)]),
    "wait_of_a_wait": (wait_of_a_wait, lambda W: [(2, 3, 8), (8, 5), (8, 3)], [(AGM, True)]),
    "two_waits_later_dim": (two_waits_later_dim, lambda W: [(2, 3, 8), (8, 5), (2 * 3 * W, 4)], [(AGM, True)]),
    "reduce_scatter_two_waits": (reduce_scatter_two_waits, lambda W: [(4 * W, 6), (6, 8)], [(MRS, True)]),
    "passenger_two_waits": (
        passenger_two_waits, lambda W: [(4, 8), (8, 5), (4, 3)], [(AGM, True), PLAIN, (passengers.KIND, True)],
    ),
    "all_reduce_two_waits": (
        all_reduce_two_waits, lambda W: [(4 * W, 6), (6, 8), (8, 8)], [(SPLIT, True), (AGM, True), (MRS, True)],
    ),
}


def run_form(name: str, seed: int) -> dict:
    """On each rank: the form's graph traced, the pass run on it; the outputs of the graph
    before and after the pass on the same inputs, and what the pass did."""
    fn, shapes, _ = FORMS[name]
    world_size, group = dist.get_world_size(), dist.group.WORLD.group_name
    torch.manual_seed(seed + dist.get_rank())  # each rank its own shard and weights
    inputs = [torch.randn(shape) for shape in shapes(world_size)]
    gm = make_fx(lambda *args: fn(*args, world_size, group), tracing_mode="fake")(*inputs)
    waits_before = len(gm.graph.find_nodes(op="call_function", target=WAIT))
    expected = gm(*inputs)
    with split_cost.sizes_ignored():  # tiny shapes
        records = overlap_graph_pass(gm.graph)
    gm.recompile()
    got = gm(*inputs)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, **TOL)
    left = [n.name for n in gm.graph.nodes if n.target in (ALL_GATHER, REDUCE_SCATTER)]
    return {
        "records": [(r["kind"], r["rewritten"], r["reason"], r.get("repeated_waits_merged")) for r in records],
        "waits": (waits_before, len(gm.graph.find_nodes(op="call_function", target=WAIT))),
        "collectives_left": left,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(FORMS))
def test_a_collective_waited_on_twice_is_rewritten_and_computes_the_same(gloo_world, name, world_size):
    results = gloo_world(world_size).run(run_form, name, 0)
    expected = FORMS[name][2]
    for rank, result in enumerate(results):
        records = result["records"]
        assert sorted((kind, ok) for kind, ok, _, _ in records) == sorted(expected), (rank, records)
        # the collective waited on twice says so in its record (an all-reduce's split record
        # does not: its all-gather and reduce-scatter are new)
        merged = [m for _, _, _, m in records if m]
        assert merged == ([] if name == "all_reduce_two_waits" else [1]), (rank, records)
        assert result["collectives_left"] == [], (rank, result)  # a passenger's gather rides in the op
        before, after = result["waits"]
        assert before >= 2 and after < before, (rank, result)
