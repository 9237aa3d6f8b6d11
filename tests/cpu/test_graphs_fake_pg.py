"""Graph tests on the fake process group: what the pass finds, rewrites and skips, and why."""

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from overlap_pass import config
from overlap_pass.fusion import matmul_checks
from benchmarks.tp_models import MLP, TransformerBlock, parallelize_block, parallelize_mlp

from .fake_world import Dump, compile_and_dump, fake_world, rewritten

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"
WORLD_SIZES = [2, 4, 8]
gather = funcol.all_gather_tensor_autograd


def scatter(x, reduce_op, dim, group):
    """reduce_scatter; the differentiable variant where a gradient is needed (it only takes
    "sum" on torch 2.11)."""
    if x.requires_grad:
        return funcol.reduce_scatter_tensor_autograd(x, reduce_op, dim, group)
    return funcol.reduce_scatter_tensor(x, reduce_op, dim, group)


def _only(candidates: list[dict], kind: str) -> dict:
    (found,) = [c for c in candidates if c["kind"] == kind]
    return found


# ---------------------------------------------------------------------------------------------
# all_gather -> matmul


def gathered_linears(x, weights, biases, dim, group, other_use):
    g = gather(x, dim, group)
    outs = [F.linear(g, w, b) for w, b in zip(weights, biases)]
    return tuple(outs) + ((g.sin(),) if other_use else ())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape, dim", [((3, 8), 0), ((2, 3, 8), 0), ((2, 3, 8), 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("consumers", [1, 3])
@pytest.mark.parametrize("other_use", [False, True])
def test_all_gather_matmul(tmp_path, world_size, shape, dim, bias, consumers, other_use):
    with fake_world(world_size) as group:
        x = torch.randn(shape)
        weights = [torch.randn(5 + i, shape[-1]) for i in range(consumers)]
        biases = [torch.randn(5 + i) if bias else None for i in range(consumers)]
        outs, dump = compile_and_dump(
            gathered_linears, (x, weights, biases, dim, group, other_use), tmp_path
        )
    decision = _only(dump.candidates("inference"), AGM)
    assert decision["rewritten"], decision["reason"]
    assert decision["dim"] == dim
    assert decision["implementation"] == "reference"
    assert decision["return_gathered"] == other_use
    assert decision["group"]["size"] == world_size
    assert len(decision["nodes"]["matmuls"]) == consumers
    assert all((m["bias"] is not None) == bias for m in decision["nodes"]["matmuls"])
    after = dump.after("inference")
    assert "overlap.all_gather_matmul" in after and "all_gather_into_tensor" not in after
    gathered_shape = list(shape)
    gathered_shape[dim] *= world_size
    for out, w in zip(outs, weights):
        assert list(out.shape) == gathered_shape[:-1] + [w.shape[0]]
        assert out.is_contiguous()


# ---------------------------------------------------------------------------------------------
# matmul -> reduce_scatter


def linear_scattered(a, w, b, dim, reduce_op, group):
    return scatter(F.linear(a, w, b), reduce_op, dim, group)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("rows, dim", [((16,), 0), ((2, 8), 0), ((2, 8), 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter(tmp_path, world_size, rows, dim, bias, reduce_op):
    with fake_world(world_size) as group:
        a = torch.randn(*[r * world_size // 2 if i == dim else r for i, r in enumerate(rows)], 6)
        w, b = torch.randn(4, 6), torch.randn(4) if bias else None
        out, dump = compile_and_dump(linear_scattered, (a, w, b, dim, reduce_op, group), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert decision["rewritten"], decision["reason"]
    assert (decision["dim"], decision["reduce_op"]) == (dim, reduce_op)
    (term,) = decision["nodes"]["matmuls"]
    assert (term["bias"] is not None) == bias
    after = dump.after("inference")
    assert "overlap.matmul_reduce_scatter" in after and "reduce_scatter_tensor" not in after
    expected = list(a.shape[:-1]) + [4]
    expected[dim] //= world_size
    assert list(out.shape) == expected


def linear_moved_and_scattered(a, w, dim, group, contiguous):
    """spmd_types' reduce-scatter along a later dim (torchtitan's default spmd_backend): the dim
    moved to the front (made contiguous or not), scattered along dim 0, moved back."""
    moved = F.linear(a, w).movedim(dim, 0)
    moved = moved.contiguous() if contiguous else moved
    return funcol.reduce_scatter_tensor(moved, "sum", 0, group).movedim(0, dim)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape, dim", [((1, 4), 1), ((4, 4), 1), ((3, 2, 4), 2)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_matmul_reduce_scatter_of_a_moved_dim(tmp_path, world_size, shape, dim, contiguous):
    with fake_world(world_size) as group:
        a = torch.randn(*[s * world_size if i == dim else s for i, s in enumerate(shape)], 6)
        w = torch.randn(4, 6)
        out, dump = compile_and_dump(linear_moved_and_scattered, (a, w, dim, group, contiguous), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert decision["rewritten"], decision["reason"]
    assert decision["dim"] == dim
    after = dump.after("inference")
    assert "overlap.matmul_reduce_scatter" in after and "_c10d_functional.reduce_scatter" not in after
    expected = list(a.shape[:-1]) + [4]
    expected[dim] //= world_size
    assert list(out.shape) == expected


def moved_but_not_to_the_front(a, w, group):
    return funcol.reduce_scatter_tensor(F.linear(a, w).permute(1, 2, 0).contiguous(), "sum", 0, group)


def test_a_permute_that_is_not_a_movedim_is_skipped(tmp_path):
    with fake_world(2) as group:
        _, dump = compile_and_dump(moved_but_not_to_the_front, (torch.randn(4, 6, 6), torch.randn(4, 6), group), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert not decision["rewritten"] and "not a matmul result" in decision["reason"]


def widened_sum_scattered(a1, a2, w1, w2, group):
    """autocast's input gradient: bf16 matmuls, each widened to fp32, summed, scattered."""
    return scatter((a1 @ w1).view(2, -1, 4).float() + (a2 @ w2).float().view(2, -1, 4), "sum", 1, group)


def twice_cast_sum_scattered(a1, a2, w1, w2, group):
    return scatter((a1 @ w1).float() + (a2 @ w2).float().double().float(), "sum", 0, group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_widened_matmuls_scatter_in_the_wide_dtype(tmp_path, world_size):
    with fake_world(world_size) as group:
        a1, a2 = torch.randn(4 * world_size, 6).bfloat16(), torch.randn(4 * world_size, 5).bfloat16()
        w1, w2 = torch.randn(6, 4).bfloat16(), torch.randn(5, 4).bfloat16()
        out, dump = compile_and_dump(widened_sum_scattered, (a1, a2, w1, w2, group), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert decision["rewritten"], decision["reason"]
    assert decision["out_dtype"] == "float32" and len(decision["nodes"]["matmuls"]) == 2
    assert out.dtype == torch.float32 and list(out.shape) == [2, 2, 4]
    assert "torch.float32)" in dump.after("inference")  # the op's out_dtype argument


def test_a_term_cast_twice_is_skipped(tmp_path):
    with fake_world(2) as group:
        args = [torch.randn(8, 6).bfloat16(), torch.randn(8, 5).bfloat16()]
        args += [torch.randn(6, 4).bfloat16(), torch.randn(5, 4).bfloat16(), group]
        _, dump = compile_and_dump(twice_cast_sum_scattered, tuple(args), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert not decision["rewritten"] and "not one cast from bf16 or fp16 to fp32" in decision["reason"]


# ---------------------------------------------------------------------------------------------
# backward graphs, chains, tensor-parallel models


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1])
def test_backward_of_gathered_linear(tmp_path, world_size, dim):
    """AG -> linear forward; backward: grad of the input is mm -> reduce-scatter."""
    with fake_world(world_size) as group:
        x = torch.randn(2, 3, 8, requires_grad=True)
        w = torch.randn(5, 8, requires_grad=True)
        _, dump = compile_and_dump(
            gathered_linears, (x, [w], [None], dim, group, False), tmp_path, backward=True
        )
    assert rewritten(dump.candidates("forward"), AGM)
    backward = _only(dump.candidates("backward"), MRS)
    assert backward["rewritten"], backward["reason"]
    assert backward["dim"] == dim


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_backward_of_scattered_linear(tmp_path, world_size):
    """linear -> RS forward; backward: AG of the output grad feeds the input-grad matmul (its
    rows) and the weight-grad matmul (contracting its rows): one op takes both, and nothing
    else needs the gathered grad."""
    with fake_world(world_size) as group:
        a = torch.randn(2, 4 * world_size, 6, requires_grad=True)
        w = torch.randn(4, 6, requires_grad=True)
        _, dump = compile_and_dump(
            linear_scattered, (a, w, None, 1, "sum", group), tmp_path, backward=True
        )
    assert rewritten(dump.candidates("forward"), MRS)
    backward = _only(dump.candidates("backward"), AGM)
    assert backward["rewritten"], backward["reason"]
    assert len(backward["nodes"]["matmuls"]) == 1 and not backward["return_gathered"]
    (contraction,) = backward["nodes"]["contractions"]
    assert contraction["gathered_left"] and contraction["mm"]["shape"] == [4, 6]
    assert "all_gather_into_tensor" not in dump.after("backward")


def chain(x, w1, w2, group):
    """all_gather -> mm -> mm -> reduce_scatter, nothing in between."""
    return scatter(gather(x, 0, group) @ w1 @ w2, "sum", 0, group)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_back_to_back_chain_fuses_both_ends(tmp_path, world_size):
    with fake_world(world_size) as group:
        x, w1, w2 = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8)
        out, dump = compile_and_dump(chain, (x, w1, w2, group), tmp_path)
    candidates = dump.candidates("inference")
    assert len(rewritten(candidates, AGM)) == 1 and len(rewritten(candidates, MRS)) == 1
    assert "_c10d_functional" not in dump.after("inference")
    assert list(out.shape) == [4, 8]


def _listing(dump, kind) -> list[tuple]:
    """Every collective of a graph: (kind, rewritten, reason, matmuls (an all-gather's row
    matmuls, a reduce-scatter's summed ones), contractions, returns the gathered tensor)."""
    rows = []
    for c in dump.candidates(kind):
        nodes = c.get("nodes", {})
        counts = len(nodes.get("matmuls", [])), len(nodes.get("contractions", []))
        rows.append((c["kind"], c["rewritten"], c["reason"], *counts, c.get("return_gathered")))
    return sorted(rows, key=str)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias", [False, True])
def test_dtensor_mlp_forward_and_backward(tmp_path, world_size, bias):
    """Backward: the output grad is gathered once for the input grad of down (its rows) and
    the weight grad of down (contracting its rows); with a bias, its grad (a column sum) reads
    the gathered grad too. The input grad of up is one matmul before its reduce-scatter."""
    with fake_world(world_size):
        mlp = parallelize_mlp(MLP(dim=16, hidden=8 * world_size, bias=bias), init_device_mesh("cpu", (world_size,)))
        x = torch.randn(2, 3, 16, requires_grad=True)
        _, dump = compile_and_dump(mlp, (x,), tmp_path, backward=True)
    # forward: the gathered input is saved for up's weight grad, so the op returns it
    assert _listing(dump, "forward") == [(AGM, True, None, 1, 0, True), (MRS, True, None, 1, 0, None)]
    assert _listing(dump, "backward") == [(AGM, True, None, 1, 1, bias), (MRS, True, None, 1, 0, None)]
    assert "_c10d_functional" not in dump.after("backward")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias", [False, True])
def test_dtensor_transformer_block(tmp_path, world_size, bias):
    """Forward: each of attention and MLP gathers once for all its column-parallel linears
    (Q, K, V: three matmuls; gate, up: two) and reduce-scatters once. Backward: the output
    grads of O and down are gathered once each for their input grad and weight grad; the
    input grads of Q + K + V and of gate + up are sums of matmuls, each fused whole with its
    reduce-scatter."""
    with fake_world(world_size):
        block = TransformerBlock(dim=32, heads=world_size, hidden=16 * world_size, bias=bias)
        block = parallelize_block(block, init_device_mesh("cpu", (world_size,)))
        x = torch.randn(2, 3, 32, requires_grad=True)
        _, dump = compile_and_dump(block, (x,), tmp_path, backward=True)
    assert _listing(dump, "forward") == sorted(
        [(AGM, True, None, 3, 0, True), (AGM, True, None, 2, 0, True)]
        + [(MRS, True, None, 1, 0, None)] * 2,
        key=str,
    )
    assert _listing(dump, "backward") == sorted(
        [(AGM, True, None, 1, 1, bias)] * 2
        + [(MRS, True, None, 3, 0, None), (MRS, True, None, 2, 0, None)],
        key=str,
    )
    assert "_c10d_functional" not in dump.after("backward")


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtensor_transformer_block_gathered_again_in_the_backward(tmp_path, world_size):
    """config.regather_in_backward (regather.py): the forward's gathers return no gathered
    rows; the backward gathers Q, K and V's input again for their three weight grads and gate
    and up's for their two, each fused with those contractions."""
    with config.patch(regather_in_backward=True), fake_world(world_size):
        block = TransformerBlock(dim=32, heads=world_size, hidden=16 * world_size)
        block = parallelize_block(block, init_device_mesh("cpu", (world_size,)))
        x = torch.randn(2, 3, 32, requires_grad=True)
        _, dump = compile_and_dump(block, (x,), tmp_path, backward=True)
    assert _listing(dump, "forward") == sorted(
        [(AGM, True, None, 3, 0, False), (AGM, True, None, 2, 0, False)] + [(MRS, True, None, 1, 0, None)] * 2,
        key=str,
    )
    assert _listing(dump, "backward") == sorted(
        [(AGM, True, None, 1, 1, False)] * 2 + [(AGM, True, None, 0, 3, False), (AGM, True, None, 0, 2, False)]
        + [(MRS, True, None, 3, 0, None), (MRS, True, None, 2, 0, None)],
        key=str,
    )


def checkpointed_column_linear(x, w, group):
    """Activation checkpointing: the backward gathers the input again for the weight grad."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(lambda x, w: F.linear(gather(x, 0, group), w), x, w, use_reentrant=False)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_recomputed_gather_feeds_only_the_weight_grad(tmp_path, world_size):
    with fake_world(world_size) as group:
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        _, dump = compile_and_dump(checkpointed_column_linear, (x, w, group), tmp_path, backward=True)
    assert _listing(dump, "backward") == [(AGM, True, None, 0, 1, False), (MRS, True, None, 1, 0, None)]
    (contraction,) = _only(dump.candidates("backward"), AGM)["nodes"]["contractions"]
    assert not contraction["gathered_left"] and contraction["mm"]["shape"] == [6, 8]


def contracted_both_ways(x, y, z, group):
    g = gather(x, 0, group)
    return g.t() @ y, z @ g, g @ y.t()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gathered_rows_contracted_on_either_side(tmp_path, world_size):
    with fake_world(world_size) as group:
        x = torch.randn(3, 5)
        y, z = torch.randn(3 * world_size, 5), torch.randn(7, 3 * world_size)
        outs, dump = compile_and_dump(contracted_both_ways, (x, y, z, group), tmp_path)
    decision = _only(dump.candidates("inference"), AGM)
    assert decision["rewritten"] and not decision["return_gathered"]
    assert [c["gathered_left"] for c in decision["nodes"]["contractions"]] == [True, False]
    assert [list(o.shape) for o in outs] == [[5, 5], [7, 5], [3 * world_size, 3 * world_size]]


def summed_linears(a1, a2, w1, w2, b1, b2, residual, group):
    total = F.linear(a1, w1, b1) + F.linear(a2, w2, b2)
    return scatter(total if residual is None else total + residual, "sum", 0, group)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias", [False, True])
def test_sum_of_matmuls_is_one_reduce_scatter(tmp_path, world_size, bias):
    with fake_world(world_size) as group:
        a1, a2 = torch.randn(2 * world_size, 5), torch.randn(2 * world_size, 3)
        w1, w2 = torch.randn(4, 5), torch.randn(4, 3)
        b1, b2 = (torch.randn(4), torch.randn(4)) if bias else (None, None)
        out, dump = compile_and_dump(summed_linears, (a1, a2, w1, w2, b1, b2, None, group), tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert decision["rewritten"], decision["reason"]
    assert [m["input"]["shape"] for m in decision["nodes"]["matmuls"]] == [[2 * world_size, 5], [2 * world_size, 3]]
    assert "reduce_scatter_tensor" not in dump.after("inference") and list(out.shape) == [2, 4]


def test_a_residual_added_to_the_sum_is_skipped_with_a_reason(tmp_path):
    with fake_world(2) as group:
        args = (torch.randn(4, 5), torch.randn(4, 3), torch.randn(4, 5), torch.randn(4, 3), None, None, torch.randn(4, 4), group)
        out, dump = compile_and_dump(summed_linears, args, tmp_path)
    decision = _only(dump.candidates("inference"), MRS)
    assert not decision["rewritten"] and "not a sum of matmuls" in decision["reason"], decision["reason"]
    assert list(out.shape) == [2, 4]


# ---------------------------------------------------------------------------------------------
# what is skipped, and why


def k_sharded(x, w, group):
    return gather(x, 1, group) @ w


def widening_cast_between(x, w, group):
    return gather(x, 0, group).float() @ w


def cast_and_own_dtype_use(x, w, group):
    g = gather(x, 0, group)
    return g.to(torch.bfloat16) @ w, g.sin()


def no_matmul(x, w, group):
    return gather(x, 0, group).sin()


def matmul_with_other_users(x, w, group):
    y = x @ w
    return scatter(y, "sum", 0, group), y.sum()


def cast_before_scatter(x, w, group):
    return scatter((x @ w).to(torch.bfloat16), "sum", 0, group)


def scatter_along_n(x, w, group):
    return scatter(x @ w, "sum", 1, group)


def not_a_matmul(x, w, group):
    return scatter(x.sin(), "sum", 0, group)


SKIPS = [
    (k_sharded, lambda W: (torch.randn(8, 4), torch.randn(4 * W, 3)), "K-sharded gather"),
    (widening_cast_between, lambda W: (torch.randn(4, 8).bfloat16(), torch.randn(8, 3)), "dtype cast"),
    (cast_and_own_dtype_use, lambda W: (torch.randn(4, 8), torch.randn(8, 3).bfloat16()), "dtype cast"),
    (no_matmul, lambda W: (torch.randn(2, 3), None), "no matmul reads the gathered rows"),
    (
        matmul_with_other_users,
        lambda W: (torch.randn(2 * W, 3), torch.randn(3, 4)),
        "matmul result has other users",
    ),
    (
        cast_before_scatter,
        lambda W: (torch.randn(2 * W, 3), torch.randn(3, 4)),
        "dtype cast between the matmul and the reduce-scatter",
    ),
    (scatter_along_n, lambda W: (torch.randn(4, 3), torch.randn(3, 2 * W)), "N dim"),
    (not_a_matmul, lambda W: (torch.randn(2 * W, 3), None), "not a matmul result"),
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fn, make_args, reason", SKIPS, ids=[s[0].__name__ for s in SKIPS])
def test_skipped_with_reason(tmp_path, world_size, fn, make_args, reason):
    with fake_world(world_size) as group:
        _, dump = compile_and_dump(fn, (*make_args(world_size), group), tmp_path)
    (decision,) = dump.candidates("inference")
    assert not decision["rewritten"]
    assert reason in decision["reason"], decision["reason"]
    assert decision["implementation"] is None


# ---------------------------------------------------------------------------------------------
# a cast that narrows the gathered tensor moves in front of the all-gather (casts.py)


def narrowing_casts_after_gather(x, ws, dim, group):
    """Each linear casts the gathered fp32 tensor to bf16 itself, as autocast does."""
    g = gather(x, dim, group)
    return tuple(g.to(torch.bfloat16) @ w for w in ws)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape, dim, consumers", [((4, 8), 0, 1), ((2, 3, 8), 1, 2), ((2, 3, 8), 0, 3)])
def test_a_narrowing_cast_moves_before_the_gather(tmp_path, world_size, shape, dim, consumers):
    with fake_world(world_size) as group:
        weights = [torch.randn(8, 3 + i).bfloat16() for i in range(consumers)]
        args = (torch.randn(shape), weights, dim, group)
        _, dump = compile_and_dump(narrowing_casts_after_gather, args, tmp_path)
    decision = _only(dump.candidates("inference"), AGM)
    assert decision["rewritten"], decision["reason"]
    assert decision["cast_moved_before_gather"] == "float32 -> bfloat16"
    assert len(decision["nodes"]["matmuls"]) == consumers
    # the op gathers the cast shard: bf16 on the wire, and no cast of a gathered tensor is left
    after = dump.after("inference")
    op_line = next(line for line in after.splitlines() if "overlap.all_gather_matmul" in line)
    shard = op_line.split("all_gather_matmul.default(")[1].split(",")[0]
    assert f"{shard}: \"bf16" in after
    assert after.count("prims.convert_element_type.default(") == 1


def test_a_failed_cast_move_leaves_the_graph_as_it_was(tmp_path, monkeypatch):
    """A move that fails halfway (here: after its first edit) restores the graph; the gather is
    then skipped with the cast's reason, and the compiled function still runs."""
    from overlap_pass.normalize import casts

    real_apply = casts.apply

    def failing_apply(graph, moves):
        real_apply(graph, moves[:1])
        raise RuntimeError("a graph casts.py did not foresee")

    monkeypatch.setattr(casts, "apply", failing_apply)
    with fake_world(2) as group:
        args = (torch.randn(4, 8), [torch.randn(8, 3).bfloat16()], 0, group)
        out, dump = compile_and_dump(narrowing_casts_after_gather, args, tmp_path)
    assert out[0].shape == (8, 3) and out[0].dtype == torch.bfloat16
    decision = _only(dump.candidates("inference"), AGM)
    assert not decision["rewritten"] and "dtype cast" in decision["reason"]
    assert "cast_moved_before_gather" not in decision


def test_autocast_block_gathers_bf16_and_fuses_every_collective(tmp_path):
    """A TP/SP block in fp32 under autocast: forward and backward, every collective fused, the
    forward's moved casts and the backward's fp32 reduce-scatters named in decisions.json."""
    with fake_world(4):
        block = parallelize_block(TransformerBlock(dim=32, heads=4, hidden=64), init_device_mesh("cpu", (4,)))
        x = torch.randn(2, 3, 32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, dump = compile_and_dump(block, (x,), tmp_path, backward=True)
    forward = [c for c in dump.candidates("forward") if c["kind"] == AGM]
    backward = dump.candidates("backward")
    assert len(forward) == 2 and len(backward) == 4, forward + backward
    assert all(c["rewritten"] for c in forward + backward), forward + backward
    assert [c["cast_moved_before_gather"] for c in forward] == ["float32 -> bfloat16"] * 2
    # the input gradients of Q + K + V and of gate + up: bf16 matmuls summed in fp32
    scatters = [c for c in backward if c["kind"] == MRS]
    widened = [(c.get("out_dtype"), len(c["nodes"]["matmuls"])) for c in scatters]
    assert widened == [("float32", 2), ("float32", 3)], widened


@pytest.mark.parametrize(
    "flag, kind", [("all_gather_matmul", AGM), ("matmul_reduce_scatter", MRS)]
)
def test_config_disables_one_kind(tmp_path, flag, kind):
    with fake_world(2) as group:
        args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8), group)
        _, dump = compile_and_dump(chain, args, tmp_path, **{flag: False})
    (off,) = [c for c in dump.candidates("inference") if c["kind"] == kind]
    assert not off["rewritten"] and flag in off["reason"]
    (on,) = [c for c in dump.candidates("inference") if c["kind"] != kind]
    assert on["rewritten"]


def test_symbolic_token_dims_are_rewritten(tmp_path):
    """The rows dynamic (mark_dynamic), the weights static: both collectives fuse (on CUDA
    their variant is chosen per shape at run time; here the reference runs)."""
    with fake_world(2) as group:
        args = (torch.randn(8, 16), torch.randn(16, 8), group)
        torch._dynamo.reset()
        with config.patch(debug_dir=str(tmp_path / "dump")):
            compiled = torch.compile(chain, backend="overlap")
            for rows in (4, 6):
                x = torch.randn(rows, 8)
                torch._dynamo.mark_dynamic(x, 0)
                assert list(compiled(x, *args).shape) == [rows, 8]
        candidates = Dump(str(tmp_path / "dump")).all_candidates()
    assert len(candidates) == 2 and all(c["rewritten"] for c in candidates), candidates
    assert {c["implementation"] for c in candidates} == {"reference"}
    assert all(not isinstance(c["collective"]["shape"][0], int) for c in candidates), candidates


def test_symbolic_feature_dims_are_skipped_with_a_reason(tmp_path):
    """dynamic=True makes every dim of every input symbolic, the weights' too: a matmul's K
    then is, and the pass keeps the collectives."""
    with fake_world(2) as group:
        args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8), group)
        torch._dynamo.reset()
        with config.patch(debug_dir=str(tmp_path / "dump")):
            compiled = torch.compile(chain, backend="overlap", dynamic=True)
            for rows in (4, 6):
                out = compiled(torch.randn(rows, 8), *args[1:])
                assert list(out.shape) == [rows, 8]
        candidates = Dump(str(tmp_path / "dump")).all_candidates()
    assert candidates and all(not c["rewritten"] and c["reason"] == matmul_checks.SYMBOLIC_FEATURES for c in candidates)


def mat2_from_gathered(x, group):
    g = gather(x, 0, group)
    return g @ g.t()[:, : x.shape[0]]


def test_mat2_computed_from_the_gathered_tensor_is_not_taken(tmp_path):
    with fake_world(2) as group:
        out, dump = compile_and_dump(mat2_from_gathered, (torch.randn(4, 4), group), tmp_path)
    (decision,) = dump.candidates("inference")
    assert not decision["rewritten"]
    assert "computed from the gathered tensor" in decision["reason"]
    assert list(out.shape) == [8, 4]


# ---------------------------------------------------------------------------------------------
# candidates that touch each other, and a rewrite that fails halfway


def crossed_mat2s(x1, x2, group):
    """Each gathered tensor is the other matmul's mat2: fusing both would form a cycle."""
    g1, g2 = gather(x1, 0, group), gather(x2, 0, group)
    return g1 @ g2.t(), g2 @ g1.t()


def test_crossed_candidates_fuse_one_and_skip_the_other(tmp_path):
    with fake_world(2) as group:
        _, dump = compile_and_dump(crossed_mat2s, (torch.randn(4, 8), torch.randn(4, 8), group), tmp_path)
    first, second, rider = dump.candidates("inference")
    assert first["rewritten"], first["reason"]
    assert not second["rewritten"] and "read a value computed from its own result" in second["reason"]
    # nor can the second gather ride in the first's op: that op's mat2 is its result
    assert (rider["kind"], rider["rewritten"]) == ("all_gather_passenger", False)
    assert rider["reason"] == "its gathered tensor is read by every fused all-gather op of the same rows"


def broadcast_bias(x, w1, w2, b2, group):
    g = gather(x, 0, group)
    return F.linear(g, w1), F.linear(g, w2.cos(), b2)


def test_broadcast_bias_is_not_taken(tmp_path):
    with fake_world(2) as group:
        args = (torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(1), group)
        _, dump = compile_and_dump(broadcast_bias, args, tmp_path)
    (decision,) = dump.candidates("inference")
    assert decision["rewritten"] and decision["return_gathered"]
    assert len(decision["nodes"]["matmuls"]) == 1


def raw_gather_read_twice(x, w, group):
    g0 = funcol.all_gather_tensor(x, 0, group)
    return torch.cat(torch.chunk(g0, 2, dim=0), dim=1) @ w, g0.sin()


def test_raw_gather_with_other_readers_is_skipped(tmp_path):
    with fake_world(2) as group:
        _, dump = compile_and_dump(raw_gather_read_twice, (torch.randn(2, 3, 8), torch.randn(8, 6), group), tmp_path)
    (decision,) = dump.candidates("inference")
    assert not decision["rewritten"] and "also read outside the split/cat" in decision["reason"]
    assert "overlap." not in dump.after("inference")


def same_matmul(x, w, group):
    return scatter(gather(x, 0, group) @ w, "sum", 0, group)


@pytest.mark.parametrize("all_gather_on", [True, False])
def test_one_matmul_between_two_collectives(tmp_path, all_gather_on):
    with fake_world(2) as group:
        _, dump = compile_and_dump(
            same_matmul, (torch.randn(4, 8), torch.randn(8, 6), group), tmp_path,
            all_gather_matmul=all_gather_on,
        )
    ag, rs = sorted(dump.candidates("inference"), key=lambda c: c["kind"])
    assert ag["rewritten"] == all_gather_on
    if all_gather_on:
        assert not rs["rewritten"] and "already fused with its all-gather" in rs["reason"]
    else:
        assert rs["rewritten"], rs["reason"]


def test_failure_halfway_through_an_unsorted_rewrite_restores_the_graph(tmp_path, monkeypatch):
    from overlap_pass.fusion import rewrite

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    # the op is in the graph and the matmuls are replaced, not yet sorted: then the failure
    monkeypatch.setattr(rewrite, "erase_dead", fail)
    with fake_world(2) as group:
        args = (torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(6), group)
        out, dump = compile_and_dump(broadcast_bias, args, tmp_path)
    (decision,) = dump.candidates("inference")
    assert not decision["rewritten"] and "rewrite failed (RuntimeError: injected)" in decision["reason"]
    assert "overlap." not in dump.after("inference") and len(out) == 2


def test_a_dump_that_cannot_be_written_does_not_stop_compilation(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with fake_world(2) as group, config.patch(debug_dir=str(not_a_dir)):
        torch._dynamo.reset()
        out = torch.compile(same_matmul, backend="overlap")(torch.randn(4, 8), torch.randn(8, 6), group)
    assert list(out.shape) == [4, 6]


def test_decisions_look_up_the_choice_under_the_key_the_op_files_it(tmp_path, monkeypatch):
    """decide.py's key of a widened reduce-scatter is the one lowering/dispatch.py builds from
    the rewritten op's arguments, so decisions.json can show a cached choice."""
    from overlap_pass.fusion import decide
    from overlap_pass.lowering import choose, dispatch

    matches = []
    should_fuse = decide.should_fuse
    monkeypatch.setattr(decide, "should_fuse", lambda match: (matches.append(match), should_fuse(match))[1])
    with fake_world(2) as group:
        a1, a2 = torch.randn(8, 6).bfloat16(), torch.randn(8, 5).bfloat16()
        w1, w2 = torch.randn(6, 4).bfloat16(), torch.randn(5, 4).bfloat16()
        compile_and_dump(widened_sum_scattered, (a1, a2, w1, w2, group), tmp_path)
    (match,) = matches
    inputs = [a1.view(2, 4, 6), a2.view(2, 4, 5)]  # as the rewrite reshapes them: [*scattered[:-1], K]
    shapes = [a.shape for a in inputs]
    shapes = dispatch.matmul_reduce_scatter_shapes(shapes, [w1, w2], False, "sum", 1, torch.float32)
    assert decide._choice_key(match) == choose.shape_key("matmul_reduce_scatter", 2, shapes, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Hand-written sequence parallelism, as the README's "Sequence parallel by hand" writes it


def hand_written_sp_mlp(x, w1, w2, group):
    """[batch, seq / W, dim] -> gather along seq -> up -> gelu -> down -> scatter along seq."""
    hidden = F.gelu(F.linear(funcol.all_gather_tensor(x, gather_dim=1, group=group), w1))
    return funcol.reduce_scatter_tensor(F.linear(hidden, w2), "sum", scatter_dim=1, group=group)


TORCH_2_12 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)


@pytest.mark.parametrize("world_size", [2, 4])
def test_hand_written_sp_gather_along_seq(tmp_path, world_size):
    """funcol.all_gather_tensor(x, gather_dim=1) in one graph with its backward (torch 2.13),
    every collective rewritten. torch 2.11's Dynamo cannot trace it (a function inside is marked
    as skipped), so its gathers would run eagerly outside the graphs: the README's workaround."""
    with fake_world(world_size) as group:
        x = torch.randn(4, 3, 8, requires_grad=True)
        w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
        if not TORCH_2_12:
            with pytest.raises(torch._dynamo.exc.Unsupported, match="marked as skipped"):
                compile_and_dump(hand_written_sp_mlp, (x, w1, w2, group), tmp_path, backward=True)
            return
        _, dump = compile_and_dump(hand_written_sp_mlp, (x, w1, w2, group), tmp_path, backward=True)
    for kind in ("forward", "backward"):
        decisions = sorted((c["kind"], c["rewritten"], c["dim"]) for c in dump.candidates(kind))
        assert decisions == [(AGM, True, 1), (MRS, True, 1)], (kind, dump.candidates(kind))
