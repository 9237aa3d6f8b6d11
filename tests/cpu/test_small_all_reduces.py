"""Small all-reduces become overlap::all_reduce ops (regions/small_all_reduces.py), on real gloo
ranks: sums and maxima of float32, bfloat16 and float64 tensors, each rank its own values. The
rewritten graph computes what it did before (maxima bit for bit); an all-reduce over
config.small_all_reduce_bytes stays NCCL's with its reason, and so does every one with the
config at 0. Through torch.compile, forward and backward, the compiled function matches eager."""

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_pass import config
from overlap_pass.graph.nodes import ALL_REDUCE
from overlap_pass.regions import small_all_reduces

c10d = torch.ops._c10d_functional
LIMIT = 4096  # bytes, for the test's shapes


def _all_reduce(t, op, group):
    return c10d.wait_tensor(c10d.all_reduce(t, op, group))


def reductions(x, w, big, group):
    m = _all_reduce(w.abs().amax(-1), "max", group)  # float32, 8 elements
    h = torch.relu(x @ w.t())
    s = _all_reduce(h.to(torch.bfloat16), "sum", group)  # bf16, 5 x 8
    d = _all_reduce(x.double().sum(0), "sum", group)  # float64
    b = _all_reduce(big * 2, "sum", group)  # over LIMIT: stays
    return m, s, d, b


SHAPES = [(5, 6), (8, 6), (LIMIT // 4 + 1,)]


def _ops(gm) -> tuple[int, int]:
    mine = gm.graph.find_nodes(op="call_function", target=torch.ops.overlap.all_reduce.default)
    return len(mine), len(gm.graph.find_nodes(op="call_function", target=ALL_REDUCE))


def run(limit: int) -> dict:
    group = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    inputs = [torch.randn(shape) for shape in SHAPES]
    gm = make_fx(lambda *args: reductions(*args, group), tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    with config.patch(small_all_reduce_bytes=limit):
        records = small_all_reduces.rewrite_all(gm.graph)
    gm.graph.lint()
    gm.recompile()
    got = gm(*inputs)
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    for g, e in zip(got[1:], expected[1:]):
        torch.testing.assert_close(g, e, atol=1e-2 if g.dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    return {"ops": _ops(gm), "records": [(r["rewritten"], r.get("reason", "")) for r in records]}


def test_small_all_reduces_become_ops_and_compute_the_same(gloo_world):
    for result in gloo_world(2).run(run, LIMIT):
        assert result["ops"] == (3, 1), result
        kept = [reason for rewritten, reason in result["records"] if not rewritten]
        assert len(kept) == 1 and "over config.small_all_reduce_bytes" in kept[0], result


def test_config_zero_keeps_every_all_reduce(gloo_world):
    for result in gloo_world(2).run(run, 0):
        assert result["ops"] == (0, 4), result
        assert {reason for _, reason in result["records"]} == {"config.small_all_reduce_bytes is 0"}, result


def compiled() -> list:
    """A replicated weight's gradient all-reduced (as a sequence-parallel norm's is) and an amax
    all-reduced with max, compiled with backend="overlap", forward and backward."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    class ReplicatedScale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 0 + grad, funcol.all_reduce((grad * x).sum(0), "sum", group)

    def step(x, w):
        y = ReplicatedScale.apply(x, w)
        amax = funcol.all_reduce(y.detach().abs().amax(), "max", group)  # (as torchao: no grad)
        return y / amax

    torch.manual_seed(dist.get_rank())
    x, w = torch.randn(6, 16), torch.randn(16, requires_grad=True)
    counters["overlap_pass"].clear()
    # (a cached graph would not run the pass, and so not count)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(step, backend="overlap", fullgraph=True)(x, w)
        out.sum().backward()
    got = (out.detach(), w.grad.clone())
    w.grad = None
    torch._dynamo.reset()
    out = step(x, w)
    out.sum().backward()
    torch.testing.assert_close(got[0], out.detach())
    torch.testing.assert_close(got[1], w.grad)
    return [counters["overlap_pass"]["small_all_reduces_rewritten"]]


def test_compiled_forward_and_backward_match_eager(gloo_world):
    for rewritten in gloo_world(2).run(compiled):
        assert rewritten == [2], rewritten  # the amax in the forward, the weight grad in the backward


def why_kept(reduce_op: str) -> str | None:
    group = dist.group.WORLD.group_name
    gm = make_fx(lambda t: _all_reduce(t, "sum", group), tracing_mode="fake")(torch.randn(4))
    node = gm.graph.find_nodes(op="call_function", target=ALL_REDUCE)[0]
    node.args = (node.args[0], reduce_op, node.args[2])
    return small_all_reduces._why_not(node, LIMIT)


@pytest.mark.parametrize("reduce_op", ["product", "premul_sum"])
def test_a_reduce_op_the_kernel_lacks_stays(gloo_world, reduce_op):
    for reason in gloo_world(2).run(why_kept, reduce_op):
        assert reason == f"reduce op {reduce_op!r}", reason


def symbolic_sizes() -> list:
    """An all-reduce of a tensor of symbolic length (a per-token amax under shapes that change):
    judged at its traced size, rewritten, and right at other sizes; one traced over the limit
    stays."""
    group = dist.group.WORLD.group_name
    records = []
    for traced in (10, LIMIT // 4 + 1):
        gm = make_fx(lambda t: _all_reduce(t * 2, "max", group), tracing_mode="symbolic")(torch.randn(traced))
        with config.patch(small_all_reduce_bytes=LIMIT):
            records += [(r["rewritten"], r.get("reason", "")) for r in small_all_reduces.rewrite_all(gm.graph)]
        gm.recompile()
        for size in (7, 13):
            torch.manual_seed(dist.get_rank() + size)
            x = torch.randn(size)
            want = x * 2
            dist.all_reduce(want, op=dist.ReduceOp.MAX)
            torch.testing.assert_close(gm(x), want, atol=0, rtol=0)
    return records


def test_symbolic_sizes_are_judged_at_their_traced_value(gloo_world):
    for records in gloo_world(2).run(symbolic_sizes):
        assert records[0] == (True, "") and not records[1][0], records
        assert "over config.small_all_reduce_bytes" in records[1][1], records
