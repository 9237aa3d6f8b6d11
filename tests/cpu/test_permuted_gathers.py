"""A gathered tensor whose rank dim a permute moves back (normalize/permutes.py), on real gloo
ranks: the backward of a sequence-parallel reduce-scatter written on seq moved to the front
(`reduce_scatter(x.movedim(1, 0)).movedim(0, 1)`) gathers the gradient along dim 0 and permutes
it back before its matmuls. Built with make_fx; the rewritten graph must compute what the graph
did before the pass, and the fake-group test compiles such a block's backward whole."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_pass.graph.nodes import ALL_GATHER
from overlap_pass.pipeline.stages import run as overlap_graph_pass
from tests.cpu.fake_world import compile_and_dump, fake_world

c10d = torch.ops._c10d_functional
AGM = "all_gather_matmul"
TOL = dict(atol=2e-5, rtol=2e-5)


def _gathered(x, world_size, group):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world_size, group))


def moved_back(x, w, other, world_size, group):
    """The output gradient [S/W, B, D] gathered, moved back to [B, S, D]: the input gradient, the
    weight gradient and the bias gradient read it."""
    g = _gathered(x, world_size, group).permute(1, 0, 2).contiguous().reshape(-1, x.shape[-1])
    return g @ w, g.t() @ other, g.sum(0)


def moved_into_heads(x, w, world_size, group):
    """[S/W, B, H, D] moved to [B, H, S, D] (movedim(0, 2)), read by a matmul of its rows."""
    g = _gathered(x, world_size, group).permute(1, 2, 0, 3)
    return g.reshape(-1, x.shape[-1]) @ w


def not_a_movedim(x, w, world_size, group):
    """[S/W, B, D] -> [D, B, S]: the rank dim moves and the others swap; no gather along one
    dim gives that order."""
    g = _gathered(x, world_size, group).permute(2, 1, 0)
    return g.reshape(-1, g.shape[-1]) @ w


def also_read_unpermuted(x, w, world_size, group):
    g = _gathered(x, world_size, group)
    return g.permute(1, 0, 2).reshape(-1, x.shape[-1]) @ w, g.sin()


PLAIN = (AGM, False)
FORMS = {
    # name: (fn, its inputs' shapes at world size W (the shard first), (kind, rewritten, moved))
    "moved_back": (moved_back, lambda W: [(3, 2, 8), (8, 5), (2 * 3 * W, 4)], [(AGM, True, "movedim(0, 1)")]),
    "moved_into_heads": (moved_into_heads, lambda W: [(3, 2, 2, 8), (8, 5)], [(AGM, True, "movedim(0, 2)")]),
    "not_a_movedim": (not_a_movedim, lambda W: [(3, 2, 8), (3 * W, 5)], [(*PLAIN, None)]),
    "also_read_unpermuted": (also_read_unpermuted, lambda W: [(3, 2, 8), (8, 5)], [(*PLAIN, None)]),
}


def run_form(name: str, seed: int) -> dict:
    """On each rank: the form's graph traced, the pass run on it; the outputs before and after
    the pass on the same inputs, what the pass did, the plain all-gathers left."""
    fn, shapes, _ = FORMS[name]
    world_size, group = dist.get_world_size(), dist.group.WORLD.group_name
    torch.manual_seed(seed + dist.get_rank())  # each rank its own shard and weights
    inputs = [torch.randn(shape) for shape in shapes(world_size)]
    gm = make_fx(lambda *args: fn(*args, world_size, group), tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    records = overlap_graph_pass(gm.graph)
    gm.recompile()
    got = gm(*inputs)
    as_tuple = lambda outs: outs if isinstance(outs, tuple) else (outs,)  # noqa: E731
    for out, ref in zip(as_tuple(got), as_tuple(expected), strict=True):
        torch.testing.assert_close(out, ref, **TOL)
    return {
        "records": [(r["kind"], r["rewritten"], r.get("permute_moved_before_gather")) for r in records],
        "reasons": [r["reason"] for r in records],
        "plain_gathers": len(gm.graph.find_nodes(op="call_function", target=ALL_GATHER)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(FORMS))
def test_a_permuted_gather_is_rewritten_and_computes_the_same(gloo_world, name, world_size):
    results = gloo_world(world_size).run(run_form, name, 0)
    for rank, result in enumerate(results):
        assert result["records"] == FORMS[name][2], (rank, result)
        rewritten = all(ok for _, ok, _ in result["records"])
        assert result["plain_gathers"] == (0 if rewritten else 1), (rank, result)
        if not rewritten:
            assert all(result["reasons"]), (rank, result)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_block_with_moved_reduce_scatters_fuses_its_backward_gathers(tmp_path, world_size):
    """The randomized checker's functional sequence-parallel block with the moved-dim
    reduce-scatter (tests/fuzz_models.py): every collective of its forward and backward is
    rewritten, the backward's gathers after their permute moved."""
    from tests import fuzz_models

    case = {**fuzz_models.draw(1203), "world": world_size, "checkpoint": None, "second_reader": False}
    case.update(heads=2 * world_size, kv_heads=world_size, hidden=4 * world_size, seq=2 * world_size)
    assert case["moved_scatter"] and case["layout"] == "functional_sp"
    with fake_world(world_size):
        torch.manual_seed(0)
        model = fuzz_models.build(case)
        x = torch.randn(*fuzz_models.input_shape(case), requires_grad=True)
        _, dump = compile_and_dump(model, (x,), tmp_path, backward=True)
    gathers = [c for c in dump.candidates("backward") if c["kind"] == AGM]
    assert gathers and all(c["rewritten"] for c in gathers), gathers
    assert all(c.get("permute_moved_before_gather") == "movedim(0, 1)" for c in gathers), gathers
    assert all(c["rewritten"] for c in dump.all_candidates()), dump.all_candidates()
