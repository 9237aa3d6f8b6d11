"""lowering/choose.py without GPUs: forced implementations, the cache file, the key."""

import json

import torch

from overlap_pass import config
from overlap_pass.lowering import choose

VARIANTS = {"fused:tma128x256x64w8s3": None, "fused:ptr64x128x64w4s4": None, "copy_engine_cublas": None, "nccl_cublas": None}


def test_a_forced_implementation_needs_no_measurement(monkeypatch):
    """Its first call runs once on every rank (here the one), before calls depend on it; then
    the key is decided."""
    calls = []

    class Group:
        group_name = "g"

    def measure(*args, **kwargs):
        raise AssertionError("a forced implementation is not measured")

    variants = {name: lambda *args, name=name: calls.append(name) or torch.ones(2) for name in VARIANTS}
    monkeypatch.setattr(choose, "_measure", measure)
    monkeypatch.setattr(choose, "_on_every_rank", lambda ok, group, device: dict(ok))  # a world of one
    monkeypatch.setattr(choose, "_in_step", lambda group, device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(choose, "_DECIDED", {})
    for forced, name in (("fused", "fused:tma128x256x64w8s3"), ("copy_engine_cublas", "copy_engine_cublas")):
        with config.patch(implementation=forced):
            for _ in range(2):
                assert choose.choose("k", variants, (), group=Group(), device=None) == name
        assert calls == [name], calls
        calls.clear()



def test_a_forced_implementation_the_op_lacks_falls_back_to_the_choice(caplog, monkeypatch):
    """cublas_push exists for the reduce-scatter only: an all-gather takes its decided choice."""

    class Group:
        group_name = "g"

    monkeypatch.setitem(choose._DECIDED, ("g", "k"), "copy_engine_cublas")
    with config.patch(implementation="cublas_push"):
        assert choose.choose("k", VARIANTS, (), group=Group(), device=None) == "copy_engine_cublas"
    assert "'cublas_push' is not one of" in caplog.text


def test_choices_are_cached_on_disk(tmp_path):
    path = tmp_path / "sub" / "choices.json"
    with config.patch(choice_cache=str(path)):
        names = ["copy_engine_cublas", "nccl_cublas"]
        assert choose.cached_choice("shape A", names) is None
        times = {"nccl_cublas": 10.0, "copy_engine_cublas": 8.0}
        choose._store("shape A", {"choice": "copy_engine_cublas", "times_us": times})
        choose._store("shape B", {"choice": "nccl_cublas", "times_us": {}})
        assert choose.cached_choice("shape A", names) == "copy_engine_cublas"
        assert choose.cached_choice("shape B", names) is None  # measured among other variants
        assert set(json.loads(path.read_text())) == {"shape A", "shape B"}
    path.write_text("not json")
    with config.patch(choice_cache=str(path)):
        assert choose.load_cache() == {}  # a broken cache is ignored, not fatal


def test_a_choice_made_among_other_variants_is_made_again(tmp_path, monkeypatch):
    """A cache written by an overlap with other variants (one added or dropped since) is not
    trusted: the first call measures the shape again, and the new choice replaces the old."""
    names = list(VARIANTS)
    times = {n: 10.0 + i for i, n in enumerate(names)}  # the first variant fastest
    measured = []

    def measure(variants, args, group, device, graphs):
        measured.append(list(variants))
        return dict(times)

    class Group:
        group_name = "g"

        def rank(self):
            return 0

    monkeypatch.setattr(choose, "_measure", measure)
    monkeypatch.setattr(choose, "_broadcast_name", lambda name, names, group, device: name)
    monkeypatch.setattr(choose, "CHOICES", {})  # this process's choices, apart from other tests'
    monkeypatch.setattr(choose, "_DECIDED", {})
    with config.patch(choice_cache=str(tmp_path / "choices.json"), measure_over_calls=False):
        for cached, remeasured in (
            ({"copy_engine_cublas": 1.0}, True),  # fewer variants then
            ({**times, "fused:gone": 1.0}, True),  # one dropped since
            ({n: 20.0 for n in names}, False),  # the same variants: taken as it is
        ):
            choose._DECIDED.clear()
            choose._store("k", {"choice": "nccl_cublas", "times_us": cached})
            chosen = choose._choose_collectively("k", VARIANTS, (), Group(), None, graphs=False)
            assert bool(measured) == remeasured
            assert chosen == (names[0] if remeasured else "nccl_cublas")
            if remeasured:
                assert choose.load_cache()["k"]["choice"] == names[0]
            measured.clear()
    assert choose._chosen_among({"choice": "nccl_cublas"}, names) is None  # no times: hand-written
    assert choose._chosen_among({"choice": "x", "times_us": None}, names) is None


def test_the_key_names_everything_the_choice_depends_on():
    shapes = {"shard": [2048, 4096], "gather_dim": 0, "mat2s": [[4096, 1536, "t"]], "bias": [False]}
    key = choose.shape_key("all_gather_matmul", 4, shapes, torch.bfloat16)
    for part in ("all_gather_matmul", "W4", "shard=[2048, 4096]", "mat2s=[[4096, 1536, 't']]", "bfloat16", "torch "):
        assert part in key
    assert key != choose.shape_key("all_gather_matmul", 2, shapes, torch.bfloat16)


def test_the_warm_up_of_cuda_graph_trees_is_told_apart(monkeypatch):
    """Choices made while CUDA graph trees warm a model up are timed as replays (no host time)."""
    from types import SimpleNamespace

    from torch._inductor import cudagraph_trees

    device = torch.device("cuda", 0)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: None)
    assert not choose.replays_graphs(device)  # no graph trees on this device
    manager = SimpleNamespace(in_warmup=True)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: manager)
    assert choose.replays_graphs(device)
    manager.in_warmup = False  # recording or replaying: not a first call the choice sees
    assert not choose.replays_graphs(device)

    def moved(index, create_if_none_exists):
        raise AttributeError("internals moved")

    monkeypatch.setattr(cudagraph_trees, "get_manager", moved)
    assert not choose.replays_graphs(device)  # eager timing, as without graphs


def test_float8_choices_tell_weight_scale_kinds_apart():
    """cuBLAS runs other kernels for rowwise weight scales: a choice made for tensorwise weights
    is not reused for rowwise ones, in either float8 op."""
    from overlap_pass.lowering import dispatch, scaled

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    rows, w = torch.empty(64, 32, dtype=fp8), torch.empty(48, 32, dtype=fp8).t()
    row_scales, one, columns = torch.ones(64, 1), torch.ones(()), torch.ones(1, 48)
    ag = {
        choose.shape_key(
            scaled.AG_KIND, 2, dispatch.all_gather_scaled_matmul_shapes(rows, row_scales, [w], [s], [None], 0, bf16, True), fp8
        )
        for s in (one, columns)
    }
    rs = {
        choose.shape_key(
            scaled.RS_KIND, 2,
            dispatch.scaled_matmul_reduce_scatter_shapes([rows], [row_scales], [w], [s], None, "sum", 0, bf16, None, True),
            fp8,
        )  # fmt: skip
        for s in (one, columns)
    }
    assert len(ag) == 2 and len(rs) == 2, (ag, rs)


def test_outputs_are_compared_in_pieces(monkeypatch):
    """A variant's outputs are compared with the baseline's piece by piece (no full fp32 copy
    while a model's activations are live), and the verdict is the whole tensor's: a small error
    everywhere, a large one in one piece, a non-finite value in the last piece."""
    monkeypatch.setattr(choose, "CLOSE_PIECE", 100)
    want = torch.randn(37, 113, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert choose._close(want * 1.01, want)
    assert not choose._close(want * 1.1, want)
    wrong = want.clone()
    wrong[20:30] *= 2  # a few pieces of 42 off: 2% overall is exceeded
    assert not choose._close(wrong, want)
    for bad in (float("nan"), float("inf")):
        last = want.clone()
        last[-1, -1] = bad
        assert not choose._close(last, want)
