"""Tensor-parallel linears written as bmm (NeMo Automodel's compiled form) and as einsum, on the
fake process group (tests/bmm_linear_cases.py): each is one matmul over the flattened rows, so
every all-gather that feeds one and every reduce-scatter that follows one is rewritten, forward
and backward (where the weight gradient is a bmm summed over the batch); a bmm with a matrix
per batch element is no linear, and its collective keeps a reason saying so. Graphs and
decisions only; test_bmm_linears_gloo.py checks the numbers."""

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from tests import bmm_linear_cases as cases

from .fake_world import compile_and_dump, fake_world

AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _form(form: str) -> str:
    if form == "nemo" and not cases.nemo_installed():
        pytest.skip("NeMo Automodel is not installed (pip install --no-deps nemo-automodel)")
    return form


def _listing(dump, kind) -> list[tuple]:
    """(kind, rewritten, reason, row matmuls, contractions) of every collective of a graph."""
    rows = []
    for c in dump.candidates(kind):
        nodes = c.get("nodes", {})
        counts = len(nodes.get("matmuls", [])), len(nodes.get("contractions", []))
        rows.append((c["kind"], c["rewritten"], c["reason"], *counts))
    return sorted(rows, key=str)


@pytest.mark.parametrize("form", cases.FORMS)
@pytest.mark.parametrize(
    "world_size, batch, bias",
    [(2, 1, False), (2, 3, True), (4, 1, True), (4, 3, False)],
    ids=["W2-b1", "W2-b3-bias", "W4-b1-bias", "W4-b3"],
)
def test_sequence_parallel_block(tmp_path, form, world_size, batch, bias):
    """Forward: attention and MLP each gather once for their column-parallel linears (Q, K, V:
    three bmms; gate, up: two) and reduce-scatter O's and down's bmm, with its bias (DTensor's
    bias / W, added after the bmm) where it has one. Backward: the output grads of O and down
    are gathered once each for their input grad (a bmm against the shared weight) and weight
    grad (a bmm over the batch, summed), and the bias grad reads the gathered grad too; the
    input grads of Q + K + V and gate + up are sums of bmms, each fused whole with its
    reduce-scatter. No collective is left."""
    with fake_world(world_size):
        block = cases.block(_form(form), world_size, bias)
        x = torch.randn(batch, 4, 32, requires_grad=True)
        _, dump = compile_and_dump(block, (x,), tmp_path, backward=True)
    assert _listing(dump, "forward") == sorted(
        [(AGM, True, None, 3, 0), (AGM, True, None, 2, 0)] + [(MRS, True, None, 1, 0)] * 2, key=str
    )
    assert _listing(dump, "backward") == sorted(
        [(AGM, True, None, 1, 1)] * 2 + [(MRS, True, None, 3, 0), (MRS, True, None, 2, 0)], key=str
    )
    scatters = [c for c in dump.candidates("forward") if c["kind"] == MRS]
    assert [m["bias"] is not None for c in scatters for m in c["nodes"]["matmuls"]] == [bias] * 2
    assert {c["return_gathered"] for c in dump.candidates("backward") if c["kind"] == AGM} == {bias}
    for kind in ("forward", "backward"):
        assert "_c10d_functional" not in dump.after(kind), dump.after(kind)
    if form != "einsum" and batch > 1:
        # the weights reach the ops as the 2-D matrices the bmms expanded (at batch 1 the
        # partitioner saves the backward's expanded weights: a batch element of those is taken)
        assert "aten.select" not in dump.after("forward") + dump.after("backward")


@pytest.mark.parametrize("form", ["bmm", "einsum"])
@pytest.mark.parametrize(
    "world_size, batch, checkpointed",
    [(2, 1, False), (4, 2, False), (2, 2, True)],
    ids=["W2-b1", "W4-b2", "W2-b2-recomputed"],
)
def test_hand_written_sp_mlp(tmp_path, form, world_size, batch, checkpointed):
    """Functional collectives around the same linears. Recomputed under checkpointing, the
    gathered input feeds up again, fused, but not up's weight grad: that contracts it with
    gelu's grad, computed from up's output (the op cannot read its own result)."""
    with fake_world(world_size) as group:
        x = torch.randn(batch, 3, 8, requires_grad=True)
        w_up, w_down = torch.randn(16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
        _, dump = compile_and_dump(cases.sp_mlp, (x, w_up, w_down, group, form, checkpointed), tmp_path, backward=True)
    assert _listing(dump, "forward") == [(AGM, True, None, 1, 0), (MRS, True, None, 1, 0)]
    backward = [(AGM, True, None, 1, 1), (MRS, True, None, 1, 0)]
    if checkpointed:
        backward.insert(0, (AGM, True, None, 1, 0))
    assert _listing(dump, "backward") == backward
    if checkpointed:
        (recomputed,) = [c for c in dump.candidates("backward") if c["kind"] == AGM and not c["nodes"]["contractions"]]
        assert recomputed["return_gathered"]  # for the weight grad's bmm
    for kind in ("forward", "backward"):
        assert "_c10d_functional" not in dump.after(kind)


@pytest.mark.parametrize("form", ["bmm", "einsum"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_rows_contracted_per_batch_and_summed(tmp_path, form, world_size):
    """bmm(g^T, y).sum(0) and bmm(z, g).sum(0): the gathered rows contracted on either side,
    taken with the linear of g in one op."""
    with fake_world(world_size) as group:
        x, y, z = torch.randn(2, 3, 5), torch.randn(2, 3 * world_size, 4), torch.randn(2, 7, 3 * world_size)
        outs, dump = compile_and_dump(cases.contractions, (x, y, z, torch.randn(6, 5), group, form), tmp_path)
    (decision,) = dump.candidates("inference")
    assert decision["rewritten"], decision["reason"]
    assert len(decision["nodes"]["matmuls"]) == 1 and not decision["return_gathered"]
    assert [c["gathered_left"] for c in decision["nodes"]["contractions"]] == [True, False]
    assert [list(o.shape) for o in outs] == [[5, 4], [7, 5], [2, 3 * world_size, 6]]


def biased_sum_scattered(x1, x2, w1, w2, b, group, form):
    """Two linears' sum and one bias added after it, as a bmm-form linear adds its bias."""
    total = cases._linear(x1, w1, form) + cases._linear(x2, w2, form)
    return funcol.reduce_scatter_tensor(total + b, "sum", 1, group)


@pytest.mark.parametrize("form", ["bmm", "einsum"])
def test_a_bias_added_after_a_sum_of_linears_goes_into_the_op(tmp_path, form):
    with fake_world(2) as group:
        x1, x2 = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
        args = (x1, x2, torch.randn(5, 6), torch.randn(5, 3), torch.randn(5), group, form)
        out, dump = compile_and_dump(biased_sum_scattered, args, tmp_path)
    (decision,) = dump.candidates("inference")
    assert decision["rewritten"], decision["reason"]
    assert [m["bias"] is not None for m in decision["nodes"]["matmuls"]] == [True, False]
    assert list(out.shape) == [2, 2, 5] and "_c10d_functional" not in dump.after("inference")


# ---------------------------------------------------------------------------------------------
# batched matmuls that are not a linear, biases the op cannot take


def per_batch_mat2_after_gather(x, w, group):
    """A bmm with a different matrix per batch element (not a weight shared by every row)."""
    return torch.bmm(funcol.all_gather_tensor(x, 1, group), w)


def per_batch_mat2_before_scatter(x, w, group):
    return funcol.reduce_scatter_tensor(torch.bmm(x, w), "sum", 1, group)


def per_batch_contraction(x, y, group):
    """The gathered rows contracted per batch element, not summed over the batch."""
    return torch.bmm(y, funcol.all_gather_tensor(x, 1, group))


def gathered_mat2_rows_moved(x, y, group):
    """Attention-like: the gathered tensor enters a bmm in another layout than its rows."""
    g = funcol.all_gather_tensor(x, 1, group)
    return torch.bmm(y, g.transpose(1, 2))


def bias_added_after_widening(x, w, b, group):
    """The op adds a bias to each rank's partial in the matmul's dtype, before widening it."""
    return funcol.reduce_scatter_tensor((x @ w).float() + b, "sum", 0, group)


def second_bias(x, w, b1, b2, group):
    return funcol.reduce_scatter_tensor(torch.addmm(b1, x, w) + b2, "sum", 0, group)


SKIPS = [
    (
        per_batch_mat2_after_gather,
        lambda W: (torch.randn(2, 3, 8), torch.randn(2, 8, 5)),
        "a batched matmul with a different mat2 per batch element reads the gathered rows (not a linear)",
    ),
    (
        per_batch_mat2_before_scatter,
        lambda W: (torch.randn(2, 3 * W, 8), torch.randn(2, 8, 5)),
        "reduce-scatter input is a batched matmul with a different mat2 per batch element (not a linear)",
    ),
    (
        per_batch_contraction,
        lambda W: (torch.randn(2, 3, 8), torch.randn(2, 5, 3 * W)),
        "a batched matmul contracts the gathered rows per batch element, not summed over the batch",
    ),
    (
        gathered_mat2_rows_moved,
        lambda W: (torch.randn(2, 3, 8), torch.randn(2, 5, 8)),
        "a batched matmul reads the gathered tensor in another layout than its rows",
    ),
    (
        bias_added_after_widening,
        lambda W: (torch.randn(2 * W, 8).bfloat16(), torch.randn(8, 5).bfloat16(), torch.randn(5)),
        "a bias is added after the widening cast before the reduce-scatter",
    ),
    (
        second_bias,
        lambda W: (torch.randn(2 * W, 8), torch.randn(8, 5), torch.randn(5), torch.randn(5)),
        "a bias is added to a matmul that has its own before the reduce-scatter",
    ),
]


@pytest.mark.parametrize("fn, make_args, reason", SKIPS, ids=[s[0].__name__ for s in SKIPS])
def test_what_cannot_be_taken_is_skipped_with_its_reason(tmp_path, fn, make_args, reason):
    with fake_world(2) as group:
        out, dump = compile_and_dump(fn, (*make_args(2), group), tmp_path)
    (decision,) = dump.candidates("inference")
    assert not decision["rewritten"] and decision["reason"].startswith(reason), decision["reason"]
    assert "overlap." not in dump.after("inference")
