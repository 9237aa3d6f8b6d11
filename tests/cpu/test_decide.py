import pytest

from overlap_pass.fusion import decide


@pytest.mark.parametrize(
    "local_world_size, ranks, spans",
    [("", [0, 1, 2, 3], False), ("4", [0, 1, 2, 3], False), ("4", [2, 3, 4, 5], True), ("8", [0, 8], True)],
)
def test_groups_that_span_hosts(monkeypatch, local_world_size, ranks, spans):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert decide.spans_hosts(ranks) == spans


def test_decisions_show_the_choice_of_the_mode_compiled_for(monkeypatch, tmp_path):
    """Under reduce-overhead the op will run the choice timed as graph replays, cached apart."""
    from types import SimpleNamespace

    import torch
    from torch._inductor import config as inductor_config

    from overlap_pass import config
    from overlap_pass.lowering import choose

    monkeypatch.setattr(decide, "meta_val", lambda node: SimpleNamespace(device=torch.device("cuda", 0), shape=(8, 16)))
    monkeypatch.setattr(decide, "_choice_key", lambda match: "shape")
    names = ["copy_engine_cublas", "nccl_cublas"]
    monkeypatch.setattr(decide, "_variant_names", lambda match: names)
    times = {n: 1.0 for n in names}
    match = SimpleNamespace(scattered=None)
    with config.patch(choice_cache=str(tmp_path / "choices.json")):
        choose._store("shape", {"choice": "nccl_cublas", "times_us": times})
        choose._store("shape" + choose.GRAPHS_KEY, {"choice": "copy_engine_cublas", "times_us": times})
        assert decide.choose_implementation(match) == "auto: nccl_cublas (cached)"
        with inductor_config.patch({"triton.cudagraphs": True}):
            assert decide.choose_implementation(match) == "auto: copy_engine_cublas (cached)"
        # chosen by an overlap with other variants: the first call will measure again
        choose._store("shape", {"choice": "nccl_cublas", "times_us": {"nccl_cublas": 1.0}})
        assert decide.choose_implementation(match) == "auto: measured at the first call"


def test_a_symbolic_match_is_chosen_per_shape_at_run_time(monkeypatch):
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(decide, "meta_val", lambda node: SimpleNamespace(device=torch.device("cuda", 0), shape=("s0", 16)))
    assert decide.choose_implementation(SimpleNamespace(scattered=None)) == decide.PER_SHAPE
