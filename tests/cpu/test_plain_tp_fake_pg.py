"""Plain tensor parallelism (no sequence parallel) on the fake process group: each all-reduce is
split into a reduce-scatter and an all-gather around the row-wise ops after it
(regions/split_*.py), and those fuse with their matmuls. Graphs and decisions only; the gloo
tests check the numbers."""

import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from overlap_pass.regions import passengers, split_apply, split_cost, split_records
from tests.plain_tp_cases import (
    max_reduced,
    mean_over_tokens,
    rank_local_operand,
    row_then_column,
)
from tools import inspect_dump
from benchmarks.tp_models import TransformerBlock, parallelize_block_plain

from .fake_world import compile_and_dump, fake_world

AGM, MRS, SPLIT = "all_gather_matmul", "matmul_reduce_scatter", split_records.KIND
DIM, SEQ = 32, 8

_COLLECTIVE = re.compile(r'"(\w+)\[([\d, ]*)\][^"]*" = torch\.ops\.(?:_c10d_functional|overlap)\.(\w+)\.default')
_TUPLE_OP = re.compile(r"= torch\.ops\.overlap\.(\w+)\.default")


def collectives(graph_text: str) -> list[tuple]:
    """Every collective of a graph as (op, dtype, shape); the overlap ops that return tuples
    as (op,)."""
    found = [(op, dtype, shape) for dtype, shape, op in _COLLECTIVE.findall(graph_text) if op != "wait_tensor"]
    typed = {op for op, _, _ in found}
    found += [(op,) for op in _TUPLE_OP.findall(graph_text) if op not in typed]
    return sorted(found, key=str)


@pytest.fixture
def latency_free():
    """The cost model with a collective's latency counted as nothing, as it is next to the bytes
    of a real model's activations; the test models are far smaller."""
    with split_cost.sizes_ignored():
        yield


def _plain_block(world_size: int, bias: bool):
    block = TransformerBlock(dim=DIM, heads=world_size, hidden=16 * world_size, bias=bias)
    return parallelize_block_plain(block, init_device_mesh("cpu", (world_size,)))


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_plain_tp_block(tmp_path, latency_free, world_size, bias, batch):
    """Forward: the O and down all-reduces become reduce-scatters fused with O and down; the
    FFN's gather is fused with gate and up; two saved activations (the attention output and the
    norm's rsqrt, as AOTAutograd's partitioner chose to save them whole) ride in that op as its
    passengers (passengers.py); the block output is gathered plainly. Backward: the five all-reduced input grads of Q, K, V, gate and
    up become two reduce-scatters of sums; the block output's grad after the FFN norm's backward
    is gathered once for O's input and weight grads; the input grad is gathered plainly; each
    norm weight's grad (a sum over tokens) and a bias grad are all-reduced from the shards'
    sums."""
    tokens, rows = batch * SEQ, batch * SEQ // world_size
    with fake_world(world_size):
        x = torch.randn(batch, SEQ, DIM, requires_grad=True)
        _, dump = compile_and_dump(_plain_block(world_size, bias), (x,), tmp_path, backward=True)

    full = ("all_reduce", "f32", f"{batch}, {SEQ}, {DIM}")
    assert collectives(dump.graphs["forward"]["before"]) == [full] * 2
    assert collectives(dump.after("forward")) == sorted(
        [("all_gather_into_tensor", "f32", f"{tokens}, {DIM}"), (AGM,)] + [(MRS, "f32", f"{rows}, {DIM}")] * 2,
        key=str,
    )
    riders = [c for c in dump.candidates("forward") if c["kind"] == passengers.KIND]
    assert [c["rewritten"] for c in riders] == [True, True, False], riders
    # both in the one op of the graph (the record names the op as it ends up)
    assert riders[0]["op"] == riders[1]["op"] and f'{riders[0]["op"]} = torch.ops.overlap' in dump.after("forward")
    assert riders[2]["reason"].startswith("its shard is computed from")  # the block output
    (host,) = [c for c in dump.candidates("forward") if c["kind"] == AGM and c["rewritten"]]
    assert (host["op"], host["passengers"]) == (riders[0]["op"], 2), host
    shown = [row for row in inspect_dump.rows(str(tmp_path)) if row[2] == host["collective"]["name"]]
    assert any(row[4].endswith("(+2 passengers)") for row in shown), shown
    assert collectives(dump.graphs["backward"]["before"]) == [full] * 5
    norm_weight_grads = [("all_reduce", "f32", f"{DIM}")] * (3 if bias else 2)  # + O's bias grad
    assert collectives(dump.after("backward")) == sorted(
        [("all_gather_into_tensor", "f32", f"{tokens}, {DIM}"), (AGM,)]
        + [(MRS, "f32", f"{rows}, {DIM}")] * 2
        + norm_weight_grads,
        key=str,
    )
    forward, backward = dump.candidates("forward"), dump.candidates("backward")
    assert [c["rewritten"] for c in forward + backward if c["kind"] == SPLIT] == [True] * 7
    assert sum(c["rewritten"] for c in forward + backward if c["kind"] == MRS) == 4
    fused_gathers = [c for c in forward + backward if c["kind"] == AGM and c["rewritten"]]
    assert sorted(len(c["nodes"]["matmuls"]) for c in fused_gathers) == [1, 2]  # O; gate and up
    split = next(c for c in backward if c["kind"] == SPLIT)["split"]
    assert len(split["all_reduces"]) == 5 and len(split["reduced_over_tokens"]) == (3 if bias else 2)
    assert split["sliced_operands"], "the residual and saved activations are cut to the shard"


def test_a_host_with_riders_is_measured_at_its_first_call(tmp_path, latency_free, monkeypatch):
    """A choice cached for the op without its passengers is not the one that runs (the key of
    its calls holds them): the host's record says the first call measures."""
    from overlap_pass.fusion import decide

    monkeypatch.setattr(decide, "choose_implementation", lambda match: "auto: fused (cached)")
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        _, dump = compile_and_dump(_plain_block(2, False), (x,), tmp_path, backward=True)
    hosts = [c for c in dump.all_candidates() if c["kind"] == AGM and c["rewritten"]]
    assert {c["implementation"] for c in hosts if c.get("passengers")} == {decide.FIRST_CALL}, hosts
    assert {c["implementation"] for c in hosts if not c.get("passengers")} == {"auto: fused (cached)"}, hosts


@pytest.mark.parametrize("riders", [True, False])
def test_gathers_that_ride_in_a_fused_one_cost_no_latency(tmp_path, riders, monkeypatch):
    """A collective's latency counted as 512 B, as much as a rank sends of each all-reduce at
    the test block's size (more would make every collective latency-bound: the test below).
    The forward's split leaves three gathers for two all-reduces; two of them (the saved
    activations) ride in the FFN's fused gather, and the cost in the record counts no latency
    for them. The backward, five all-reduces for one plain gather and two small all-reduces,
    is split either way."""
    monkeypatch.setattr(split_cost, "LATENCY_BYTES", 512)
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        # a fused one needs one latency's worth
        patches = {"gather_passengers": riders, "split_min_bytes": 512}
        _, dump = compile_and_dump(_plain_block(2, False), (x,), tmp_path, backward=True, **patches)
    forward = [c for c in dump.candidates("forward") if c["kind"] == SPLIT]
    assert [c["rewritten"] for c in forward] == [True] * 2
    after = "1.5 KiB" if riders else "2.5 KiB"  # (2 latencies more)
    expected = f"2 all-reduce(s) move 3.0 KiB in the open, on the shards {after} "
    cost = [c["split"]["cost"] for c in forward]
    assert all(c.startswith(expected) and (("ride in a fused one" in c) == riders) for c in cost), cost
    assert "all_reduce" not in dump.after("forward")
    assert [c["rewritten"] for c in dump.candidates("backward") if c["kind"] == SPLIT] == [True] * 5


def test_all_reduces_of_fewer_bytes_than_a_collective_latency_are_kept(tmp_path):
    """At the test block's size (a decode step's few tokens, say) each all-reduce moves fewer
    bytes than a fused op's call is worth (16 MiB a rank): a fused op cannot hide its collective
    behind so short a matmul, and the split's two collectives would cost more than the one
    all-reduce, so every all-reduce stays, forward and backward, with the costs in the reason."""
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        _, dump = compile_and_dump(_plain_block(2, False), (x,), tmp_path, backward=True)
    records = [c for c in dump.all_candidates() if c["kind"] == SPLIT]
    assert len(records) == 7 and not any(c["rewritten"] for c in records), records
    assert all(c["reason"].startswith("does not pay: ") for c in records), records
    # the forward's two regions would fuse every collective, but each is too short to pay
    told = "under 16.0 MiB a rank count as plain: too short to pay for a fused op's call"
    assert sum(told in c["reason"] for c in records) >= 2, records


def test_split_min_bytes_sets_where_a_fused_collective_counts(tmp_path):
    """config.split_min_bytes = 0: the same block's forward regions, whose every collective
    fuses, split (a collective's latency still counted: the split leaves fewer of them)."""
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        _, dump = compile_and_dump(_plain_block(2, False), (x,), tmp_path, split_min_bytes=0)
    forward = [c for c in dump.candidates("forward") if c["kind"] == SPLIT]
    assert [c["rewritten"] for c in forward] == [True] * 2, forward
    assert "all_reduce" not in dump.after("forward")


def test_config_off_keeps_every_all_reduce(tmp_path):
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        _, dump = compile_and_dump(
            _plain_block(2, False), (x,), tmp_path, backward=True, split_all_reduce=False
        )
    records = [c for c in dump.all_candidates() if c["kind"] == SPLIT]
    assert len(records) == 7
    assert {c["reason"] for c in records} == {"disabled by overlap_pass.config.split_all_reduce"}
    assert not [c for c in dump.all_candidates() if c["kind"] != SPLIT]


def test_a_failed_split_leaves_the_graph_as_it_was(tmp_path, latency_free, monkeypatch):
    """The rewrite fails halfway (after the region ops exist): the graph is restored, every
    all-reduce says why it was kept, and compilation goes on to fuse nothing else."""
    apply = split_apply.apply

    def fail_halfway(graph, plan):
        apply(graph, plan)
        raise RuntimeError("injected")

    monkeypatch.setattr(split_apply, "apply", fail_halfway)
    with fake_world(2):
        x = torch.randn(1, SEQ, DIM, requires_grad=True)
        # small all-reduces merged apart, so that the collectives left are the graph's own
        _, dump = compile_and_dump(_plain_block(2, False), (x,), tmp_path, backward=True, merge_small_all_reduces=False)
    records = [c for c in dump.all_candidates() if c["kind"] == SPLIT]
    assert len(records) == 7
    assert {(c["rewritten"], c["reason"]) for c in records} == {(False, "split failed (RuntimeError: injected)")}
    assert collectives(dump.after("forward")) == collectives(dump.graphs["forward"]["before"])
    assert collectives(dump.after("backward")) == collectives(dump.graphs["backward"]["before"])


# ---------------------------------------------------------------------------------------------
# hand-written plain TP through functional collectives


def _args(tokens: int):
    return (
        torch.randn(tokens, 48), torch.randn(tokens, DIM), torch.randn(48, DIM),
        torch.randn(DIM, 40), torch.randn(DIM),
    )  # fmt: skip


def _split_record(dump) -> dict:
    return next(c for c in dump.all_candidates() if c["kind"] == SPLIT)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_hand_written_row_then_column(tmp_path, latency_free, world_size):
    """Inference graph: one split; its reduce-scatter fused with x @ w_row, its gather with
    @ w_col; h, also returned, rides in that op as a passenger (no collective of its own);
    residual is cut to the rank's rows."""
    with fake_world(world_size) as group:
        _, dump = compile_and_dump(row_then_column, (*_args(8 * world_size), group), tmp_path)
    record = _split_record(dump)
    assert record["rewritten"], record
    assert len(record["split"]["sliced_operands"]) == 1  # the residual
    assert {g["fused_with_matmul"] for g in record["split"]["gathered"]} == {True, False}
    kinds = sorted((c["kind"], c["rewritten"]) for c in dump.all_candidates())
    assert kinds == [(AGM, False), (AGM, True), (passengers.KIND, True), (SPLIT, True), (MRS, True)]
    assert "all_gather_into_tensor" not in dump.after("inference")


def test_tokens_not_divisible_by_the_world_are_padded(tmp_path, latency_free):
    """10 tokens at W=4: shards of 3 rows, the last ones zero rows; the matmul on each side is
    made again on the padded rows, so both collectives still fuse, and the padding is sliced off
    their results."""
    with fake_world(4) as group:
        _, dump = compile_and_dump(row_then_column, (*_args(10), group), tmp_path)
    record = _split_record(dump)
    assert record["rewritten"], record
    assert record["split"]["padded"].startswith("10 tokens padded with zero rows to a multiple of 4"), record
    kinds = sorted((c["kind"], c["rewritten"]) for c in dump.all_candidates())
    assert (MRS, True) in kinds and (AGM, True) in kinds, kinds
    after = dump.after("inference")
    assert "all_reduce" not in after and "constant_pad_nd" in after, after


@pytest.mark.parametrize(
    "fn, gathered_for",
    [(mean_over_tokens, "aten::mean.dim"), (rank_local_operand, "aten::add.Tensor")],
)
def test_ops_that_are_not_row_wise_read_the_gathered_tensor(tmp_path, latency_free, fn, gathered_for):
    with fake_world(2) as group:
        _, dump = compile_and_dump(fn, (*_args(16), group), tmp_path)
    record = _split_record(dump)
    assert record["rewritten"], record
    readers = {op for g in record["split"]["gathered"] for op in g["read_by"]}
    assert gathered_for in readers, record["split"]["gathered"]


def test_a_max_all_reduce_is_kept_with_its_reason(tmp_path, latency_free):
    with fake_world(2) as group:
        _, dump = compile_and_dump(max_reduced, (*_args(16), group), tmp_path)
    record = _split_record(dump)
    assert (record["rewritten"], record["reason"]) == (False, "reduce op 'max' (only sum)")
