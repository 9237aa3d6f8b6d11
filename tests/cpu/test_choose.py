"""lowering/choose.py without GPUs: forced implementations, the cache file, the key."""

import json

import torch

from overlap_pass import config
from overlap_pass.lowering import choose

VARIANTS = {"fused:tma128x256x64w8s3": None, "fused:ptr64x128x64w4s4": None, "copy_engine_cublas": None, "nccl_cublas": None}


def test_a_forced_implementation_needs_no_measurement():
    with config.patch(implementation="fused"):
        assert choose.choose("k", VARIANTS, (), group=None, device=None) == "fused:tma128x256x64w8s3"
    with config.patch(implementation="copy_engine_cublas"):
        assert choose.choose("k", VARIANTS, (), group=None, device=None) == "copy_engine_cublas"



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
        assert choose.cached_choice("shape A") is None
        choose._store("shape A", {"choice": "copy_engine_cublas", "times_us": {"nccl_cublas": 10.0}})
        choose._store("shape B", {"choice": "nccl_cublas", "times_us": {}})
        assert choose.cached_choice("shape A") == "copy_engine_cublas"
        assert set(json.loads(path.read_text())) == {"shape A", "shape B"}
    path.write_text("not json")
    with config.patch(choice_cache=str(path)):
        assert choose.load_cache() == {}  # a broken cache is ignored, not fatal


def test_a_choice_made_among_other_variants_is_made_again():
    """A cache written by an overlap with other variants (one added or dropped since) is not
    trusted: the shape is measured again."""
    names = list(VARIANTS)
    entry = {"choice": "copy_engine_cublas", "variants": list(reversed(names))}
    assert choose._chosen_among(entry, names) == "copy_engine_cublas"
    assert choose._chosen_among({**entry, "variants": names[:-1]}, names) is None
    assert choose._chosen_among({**entry, "variants": names + ["fused:new"]}, names) is None
    assert choose._chosen_among({"choice": "copy_engine_cublas"}, names) is None  # before variants were recorded
    assert choose._chosen_among(None, names) is None


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
