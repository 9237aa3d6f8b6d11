"""Small all-reduces computed from the graph's inputs alone run as one collective per reduce op
(regions/early_all_reduces.py), on real gloo ranks: float8's pattern of weights' amaxes
all-reduced with max, in float64 and bf16, between other work. The merged graph computes what
the graph did before, bit for bit; an all-reduce of what another collective returned, a large
one, one of another reduce op, one whose input moved up would keep a large tensor alive longer,
and one of a matmul's result stay on their own."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_pass import config
from overlap_pass.graph.nodes import ALL_REDUCE
from overlap_pass.pipeline.stages import run as overlap_graph_pass
from overlap_pass.regions import early_all_reduces

c10d = torch.ops._c10d_functional


def _all_reduce(t, op, group):
    return c10d.wait_tensor(c10d.all_reduce(t, op, group))


def amaxes(x, w1, w2, w3, big, group):
    """Three weights' amaxes (two in float64, one in bf16) and two sums over ranks, all from the
    inputs; an amax of an all-reduced tensor (it waits on a collective); a large all-reduce.
    Returns what the maxima give, what the sums give, and the large one."""
    a1 = _all_reduce(w1.abs().amax(-1, keepdim=True).double(), "max", group)
    h = torch.relu(x @ w1.t())
    a2 = _all_reduce(w2.abs().amax(0).to(torch.bfloat16), "max", group)
    s = _all_reduce(h, "sum", group)
    a3 = _all_reduce(s.abs().amax(0), "max", group)  # its input waited on a collective
    a4 = _all_reduce(w3.abs().amax(-1).double(), "max", group)
    total = _all_reduce(w3.sum(0), "sum", group)
    b = _all_reduce(big * 2, "max", group)  # over SMALL_BYTES
    maxima = a1.float().sum() * a2.float() + a4.float().sum()
    return maxima, s * a3 + total.sum(), b


SHAPES = [(6, 8), (8, 8), (8, 5), (7, 8), (early_all_reduces.SMALL_BYTES // 4 + 1,)]


def run(merge: bool) -> dict:
    group = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())  # each rank its own values: the max comes from some rank
    inputs = [torch.randn(shape) for shape in SHAPES]
    gm = make_fx(lambda *args: amaxes(*args, group), tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    before = len(gm.graph.find_nodes(op="call_function", target=ALL_REDUCE))
    # (the merge alone: small_all_reduces.py would make each all-reduce left an overlap op)
    with config.patch(merge_small_all_reduces=merge, small_all_reduce_bytes=0):
        overlap_graph_pass(gm.graph)
    gm.recompile()
    got = gm(*inputs)
    maxima, sums, big = got
    torch.testing.assert_close(maxima, expected[0], atol=0, rtol=0)  # a max is a max, merged or not
    torch.testing.assert_close(big, expected[2], atol=0, rtol=0)
    torch.testing.assert_close(sums, expected[1], atol=1e-5, rtol=1e-6)  # gloo may add in another order
    return {"before": before, "after": len(gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)), "merged": _merged(gm)}


def _merged(gm) -> list[dict]:
    """The graph's all-reduces of a concatenation (the merged ones): reduce op, elements, parts."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=ALL_REDUCE):
        source = node.args[0]
        if source.target is torch.ops.aten.cat.default:
            found.append({"reduce_op": node.args[1], "elements": source.meta["val"].numel(), "parts": len(source.args[0])})
    return found


@pytest.mark.parametrize("world_size", [2, 3])
def test_amaxes_of_inputs_run_as_one_all_reduce_and_compute_the_same(gloo_world, world_size):
    for result in gloo_world(world_size).run(run, True):
        assert result["before"] == 7 and result["after"] == 4, result  # 3 maxima became 1, 2 sums 1
        maxima, sums = sorted(result["merged"], key=lambda m: m["reduce_op"])
        assert maxima["reduce_op"] == "max" and maxima["parts"] == 3, maxima
        assert maxima["elements"] == 8 + 5 + 7, maxima
        assert sums["reduce_op"] == "sum" and sums["elements"] == 6 * 8 + 8, sums


def test_config_keeps_every_all_reduce_apart(gloo_world):
    for result in gloo_world(2).run(run, False):
        assert result["before"] == result["after"] == 7 and result["merged"] == [], result


def large_read_later(x, w, group):
    """An amax of a large tensor that a later op reads too: moved up with its all-reduce, that
    tensor would stay alive from there to that op."""
    m0 = _all_reduce(w.abs().amax(), "max", group)
    y = torch.sin(x * 2)
    m1 = _all_reduce(y.abs().amax(), "max", group)
    return y.sum(1) * m0 * m1


def after_a_matmul(x, w, group):
    """An amax of a matmul's result: a matmul keeps its place in the schedule."""
    m0 = _all_reduce(w.abs().amax(), "max", group)
    y = torch.sin(x[:8])
    m1 = _all_reduce((x[:8] @ w).abs().amax(), "max", group)
    return y * m0 * m1


KEPT_APART = {"large_read_later": large_read_later, "after_a_matmul": after_a_matmul}


def run_kept_apart(name: str) -> tuple[int, list]:
    group = dist.group.WORLD.group_name
    inputs = [torch.randn(early_all_reduces.SMALL_BYTES // (4 * 64) + 1, 64), torch.randn(64, 64)]
    gm = make_fx(lambda *args: KEPT_APART[name](*args, group), tracing_mode="fake")(*inputs)
    with config.patch(small_all_reduce_bytes=0):
        overlap_graph_pass(gm.graph)
    return len(gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)), _merged(gm)


@pytest.mark.parametrize("name", list(KEPT_APART))
def test_what_should_keep_its_place_is_not_moved_up(gloo_world, name):
    for count, merged in gloo_world(2).run(run_kept_apart, name):
        assert count == 2 and merged == [], (count, merged)
