"""torchao's Float8 linears under DTensor sequence parallel, on the fake process group: every
all-gather's quantization moves onto the shards (regions/split_*.py) and fuses with its scaled
matmuls, every reduce-scatter with the scaled matmuls that produce it (tensorwise and rowwise,
forward and backward). Graphs and decisions only; the gloo tests check the numbers."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from overlap_pass.regions import passengers, split_cost, split_records
from benchmarks.tp_models import TransformerBlock, parallelize_block

from .fake_world import compile_and_dump, fake_world
from .test_plain_tp_fake_pg import collectives

torchao_float8 = pytest.importorskip("torchao.float8")

AGS, SRS = "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"
DIM, HIDDEN, SEQ, BATCH = 64, 128, 32, 2


def _float8_block(world_size: int, recipe: str):
    block = TransformerBlock(dim=DIM, heads=world_size, hidden=HIDDEN).to(torch.bfloat16)
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    torchao_float8.convert_to_float8_training(block, config=config)
    return parallelize_block(block, init_device_mesh("cpu", (world_size,)))


def _compile(tmp_path, world_size: int, recipe: str, **patches):
    with fake_world(world_size):
        x = torch.randn(BATCH, SEQ // world_size, DIM, dtype=torch.bfloat16, requires_grad=True)
        return compile_and_dump(_float8_block(world_size, recipe), (x,), tmp_path, backward=True, **patches)[1]


@pytest.fixture
def latency_free():
    with split_cost.sizes_ignored():
        yield


def _without_amax_all_reduces(found: list[tuple]) -> list[tuple]:
    """The all-reduces of the weights' and hidden-sharded tensors' amaxes (max, tiny) aside."""
    return [c for c in found if c[0] != "all_reduce"]


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_sp_block(tmp_path, latency_free, world_size, recipe):
    """Before: the attention's and the FFN's bf16 gathers, each quantized after the gather, and
    two reduce-scatters of _scaled_mm results, in each graph. After: each gather moves float8
    inside all_gather_scaled_matmul (rowwise: its scales too), each reduce-scatter is a
    scaled_matmul_reduce_scatter. Rowwise quantizes the gathered tensor a second time along
    the tokens for the weight gradient: that float8 copy (its column amax all-reduced from the
    shards') rides in the op of the same rows as a passenger, so no plain gather is left.
    Tensorwise's tensor amax is all-reduced from the shards'.
    Rowwise's backward matmuls (no fast accumulation) are torchao's scale-after form, read as
    rowwise _scaled_mm (config.fold_rowwise_float8, on by default)."""
    dump = _compile(tmp_path, world_size, recipe)
    shard = f"{BATCH}, {SEQ // world_size}, {DIM}"
    gathered = f"{BATCH * world_size}, {SEQ // world_size}, {DIM}"
    for kind in ("forward", "backward"):
        before = _without_amax_all_reduces(collectives(dump.graphs[kind]["before"]))
        assert before == sorted(
            [("all_gather_into_tensor", "bf16", gathered)] * 2 + [("reduce_scatter_tensor", "bf16", shard)] * 2,
            key=str,
        ), kind
        after = _without_amax_all_reduces(collectives(dump.after(kind)))
        assert after == sorted([(AGS,)] * 2 + [(SRS, "bf16", shard)] * 2, key=str), kind
        riders = [c for c in dump.candidates(kind) if c["kind"] == passengers.KIND]
        assert len(riders) == (2 if recipe == "rowwise" else 0) and all(c["rewritten"] for c in riders), riders
        # each rides in an op of its own: the attention's copy in the attention's gather
        assert len({c["op"] for c in riders}) == len(riders), riders
        moved = [c for c in dump.candidates(kind) if c["kind"] == split_records.GATHER_KIND]
        assert len(moved) == 2 and all(c["rewritten"] for c in moved), moved
        fused = [c for c in dump.candidates(kind) if c["kind"] in ("all_gather_matmul", "matmul_reduce_scatter") and c["rewritten"]]
        assert {c["scaled"]["scales"] for c in fused} == {recipe}, fused
        # an amax over every token (tensorwise) or per column (rowwise's second cast), or more
        assert all(c["split"]["reduced_over_tokens"] for c in moved), moved


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_amax_all_reduces_of_weights_run_as_one(tmp_path, latency_free, recipe):
    """The forward's amaxes computed from its inputs alone (the weights', the block input's) are
    all-reduced in one collective (regions/early_all_reduces.py), which decisions.json names;
    the others (of what a matmul computed) stay apart."""
    dump = _compile(tmp_path, 2, recipe)
    merged = dump.graphs["forward"]["record"]["merged_all_reduces"]
    assert len(merged) == 1 and len(merged[0]["all_reduces"]) >= 5 and merged[0]["reduce_op"] == "max", merged
    before, after = (sum(c[0] == "all_reduce" for c in collectives(dump.graphs["forward"][k])) for k in ("before", "after"))
    # the two gathers' quantization moved onto the shards adds an amax all-reduce each
    assert after == before + 2 - (len(merged[0]["all_reduces"]) - 1), (before, after, merged)


def test_rowwise_backward_without_the_fold(tmp_path, latency_free):
    """config.fold_rowwise_float8 off: rowwise's forward fuses as above; its backward's matmuls
    stay torchao's scale-after form, so neither their gathers nor their reduce-scatters fuse,
    each with a reason, and the compiled graphs run (the fake group's reference ops)."""
    dump = _compile(tmp_path, 2, "rowwise", fold_rowwise_float8=False)
    assert collectives(dump.after("forward")).count((AGS,)) == 2
    backward = dump.candidates("backward")
    assert not any(c["rewritten"] for c in backward if c["kind"] != "all_reduce_split")
    scatters = [c["reason"] for c in backward if c["kind"] == "matmul_reduce_scatter"]
    assert len(scatters) == 2 and all(r.startswith("dtype cast between the matmul and the reduce-scatter") for r in scatters)


def test_quantize_before_gather_off(tmp_path, latency_free):
    """config.quantize_before_gather off: the gathers stay bf16 and unfused, with the reason."""
    dump = _compile(tmp_path, 2, "tensorwise", quantize_before_gather=False)
    gathers = [c for c in dump.candidates("forward") if c["kind"] == "all_gather_matmul"]
    assert len(gathers) == 2 and not any(c["rewritten"] for c in gathers)
    assert all(c["reason"].startswith("no matmul reads the gathered rows") for c in gathers)


def test_small_gathers_are_left_alone(tmp_path):
    """With the real latency term, the toy block's gathers are too small to pay for the extra
    amax all-reduce: kept, with both costs in the reason."""
    dump = _compile(tmp_path, 2, "tensorwise")
    moved = [c for c in dump.candidates("forward") if c["kind"] == split_records.GATHER_KIND]
    assert moved and all(c["reason"].startswith("does not pay: 1 all-gather(s) move") for c in moved)


def test_matmuls_written_back_keep_their_strides(tmp_path, monkeypatch):
    """The fold on and nothing rewritten: every rowwise matmul is written back in torchao's form,
    and every _scaled_mm the pass made carries eager_input_vals, without which Inductor leaves
    its operands' layouts free (a fused kernel then stored one column-major on CUDA, and
    cuBLASLt rejected it: tests/gpu/test_float8_compile_gpu.py)."""
    from overlap_pass.normalize import float8
    from overlap_pass.graph.nodes import SCALED_MM

    written_back, unfold = [], float8.unfold

    def unfold_and_look(graph):
        before = set(graph.find_nodes(op="call_function", target=SCALED_MM))
        unfold(graph)
        written_back.extend(n for n in graph.find_nodes(op="call_function", target=SCALED_MM) if n not in before)

    monkeypatch.setattr(float8, "unfold", unfold_and_look)
    off = dict(quantize_before_gather=False, all_gather_matmul=False, matmul_reduce_scatter=False)
    _compile(tmp_path, 2, "rowwise", **off)
    assert written_back, "no rowwise matmul was folded"
    for node in written_back:
        operands = node.meta["eager_input_vals"][0][:2]
        assert [o.stride() for o in operands] == [a.meta["val"].stride() for a in node.args[:2]]


def test_rowwise_without_passengers(tmp_path, latency_free):
    """config.gather_passengers off: each graph keeps its two plain float8 gathers of the
    weight gradients' copies, and no passenger record is written."""
    dump = _compile(tmp_path, 2, "rowwise", gather_passengers=False)
    gathered = f"{BATCH * 2}, {SEQ // 2}, {DIM}"
    for kind in ("forward", "backward"):
        after = _without_amax_all_reduces(collectives(dump.after(kind)))
        assert after.count(("all_gather_into_tensor", "u8", gathered)) == 2, (kind, after)
        assert not [c for c in dump.candidates(kind) if c["kind"] == passengers.KIND]


def _gathers_beside_a_scaled_matmul(x, w, y, z):
    """A float8 gather feeding _scaled_mm (the op that can carry passengers), then three plain
    gathers: y of the same rows, z of other rows, and one of rows computed from the matmul."""
    import torch.distributed._functional_collectives as funcol

    group = torch.distributed.group.WORLD
    fp8 = torch.float8_e4m3fn
    gathered = funcol.all_gather_tensor(x.to(fp8).view(torch.uint8), 0, group).view(fp8)
    one = torch.ones((), dtype=torch.float32)
    out = torch._scaled_mm(gathered, w, one, one, out_dtype=torch.bfloat16)
    same_rows = funcol.all_gather_tensor(y, 0, group)
    other_rows = funcol.all_gather_tensor(z, 0, group)
    from_the_matmul = funcol.all_gather_tensor(out[: x.shape[0]] * 2, 0, group)
    return out, same_rows, other_rows, from_the_matmul


def test_which_plain_gathers_ride(tmp_path):
    """Only the plain gather of the op's rows rides (in bf16, a dtype of its own); the others
    keep their collective, each with its reason."""
    with fake_world(2):
        x, y, z = torch.randn(32, 64), torch.randn(32, 8).bfloat16(), torch.randn(5, 8)
        w = torch.randn(16, 64).to(torch.float8_e4m3fn).t()
        dump = compile_and_dump(_gathers_beside_a_scaled_matmul, (x, w, y, z), tmp_path)[1]
    riders = {tuple(c["collective"]["shape"]): c for c in dump.all_candidates() if c["kind"] == passengers.KIND}
    assert len(riders) == 3, riders
    assert riders[(64, 8)]["rewritten"] and riders[(64, 8)]["implementation"].startswith("rides in all_gather_scaled")
    assert riders[(10, 8)]["reason"] == "no fused all-gather op in the graph gathers the same rows over the same group"
    assert riders[(64, 16)]["reason"] == "its shard is computed from the results of every fused all-gather op of the same rows"
    left = [c for c in collectives(dump.after("inference")) if c[0] == "all_gather_into_tensor"]
    assert sorted(c[1:] for c in left) == [("bf16", "64, 16"), ("f32", "10, 8")], left


def test_ops_pin_their_input_strides(tmp_path, latency_free, monkeypatch):
    """Every overlap op the pass writes (passengers included) is tagged needs_exact_strides and
    carries eager_input_vals in its inputs' strides, so Inductor hands the op each input as the
    pass saw it (a float8 mat2 column-major, as _scaled_mm wants it)."""
    from overlap_pass.pipeline import passes

    seen, run_pass = [], passes.stages.run

    def run_and_look(graph):
        records = run_pass(graph)
        seen.extend(n for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("overlap."))
        return records

    monkeypatch.setattr(passes.stages, "run", run_and_look)
    _compile(tmp_path, 2, "rowwise")
    # (and the small amax all-reduces, regions/small_all_reduces.py)
    assert {str(n.target) for n in seen} == {f"overlap.{AGS}.default", f"overlap.{SRS}.default", "overlap.all_reduce.default"}, seen
    for node in seen:
        assert torch.Tag.needs_exact_strides in node.target.tags
        pinned = torch.utils._pytree.tree_leaves(node.meta["eager_input_vals"][0])
        given = torch.utils._pytree.tree_leaves(torch.fx.node.map_arg(node.args, lambda a: a.meta["val"]))
        tensors = [(p.shape, p.stride()) for p in pinned if isinstance(p, torch.Tensor)]
        assert tensors == [(g.shape, g.stride()) for g in given if isinstance(g, torch.Tensor)], node
