"""Both ways to turn the pass on, its cache identity, the entry point, and failure handling."""

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode

import overlap_pass
from overlap_pass import config
from overlap_pass.backend import overlap_config_patches
from overlap_pass.fusion import rewrite
from overlap_pass.pipeline import install, passes
from overlap_pass.pipeline.install import ChainedGraphPass
from overlap_pass.pipeline.passes import OverlapPass
from overlap_pass.shapes import new_counts

from .fake_world import compile_and_dump, fake_world


class RecordTargets(CustomGraphPass):
    """Records the call targets of the graphs Inductor lowers (runs after every other pass)."""

    def __init__(self) -> None:
        self.targets = set()

    def __call__(self, graph) -> None:
        self.targets |= {str(n.target) for n in graph.nodes if n.op == "call_function"}

    def uuid(self):
        return None


def chain(x, w1, w2, group):
    hidden = funcol.all_gather_tensor(x, 0, group) @ w1
    return funcol.reduce_scatter_tensor(hidden @ w2, "sum", 0, group)


def _compiled_targets(enabled: bool, **inductor_patches) -> set:
    recorder = RecordTargets()
    with fake_world(2) as group, config.patch(enabled=enabled), torch._inductor.config.patch(
        post_grad_custom_post_pass=recorder, **inductor_patches
    ):
        torch.compile(chain)(torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), group)
    return recorder.targets


def test_config_enabled_applies_the_pass_to_the_default_compile():
    assert "overlap.all_gather_matmul.default" in _compiled_targets(enabled=True)
    off = _compiled_targets(enabled=False)
    assert not any(t.startswith("overlap.") for t in off)
    assert "_c10d_functional.all_gather_into_tensor.default" in off


def test_inside_the_default_compile_shape_padding_is_told_once(caplog):
    passes._tell_if_ranks_may_differ.cache_clear()
    with caplog.at_level("WARNING", logger="overlap_pass"):
        _compiled_targets(enabled=True, shape_padding=True)
        _compiled_targets(enabled=True, shape_padding=True)
    told = [r.getMessage() for r in caplog.records if "different graphs" in r.getMessage()]
    assert len(told) == 1 and "TORCHINDUCTOR_SHAPE_PADDING=0" in told[0], told
    passes._tell_if_ranks_may_differ.cache_clear()


def test_micro_pipeline_tp_does_not_take_the_patterns():
    targets = _compiled_targets(enabled=True, _micro_pipeline_tp=True)
    assert {"overlap.all_gather_matmul.default", "overlap.matmul_reduce_scatter.default"} <= targets
    assert not any("symm_mem" in t for t in targets)


def test_backend_turns_micro_pipeline_tp_off_and_keeps_user_passes():
    class UserPass(RecordTargets):
        pass

    user = UserPass()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=user):
        patches = overlap_config_patches(mode="max-autotune-no-cudagraphs")
    assert patches["_micro_pipeline_tp"] is False
    assert patches["shape_padding"] is False  # it can give ranks different graphs
    assert patches["max_autotune"] is True
    chained = patches["post_grad_custom_pre_pass"]
    assert isinstance(chained, ChainedGraphPass)
    assert chained.passes[0] is user and chained.passes[1].always


def test_plain_graph_for_new_counts_keeps_user_passes_and_drops_overlaps():
    class UserPass(RecordTargets):
        pass

    user = UserPass()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=user):
        patches = overlap_config_patches()
    plain = new_counts.plain_patches(patches)
    assert plain["post_grad_custom_pre_pass"] is user
    assert plain["joint_custom_pre_pass"] is None
    assert "shape_padding" not in plain and plain["_micro_pipeline_tp"] is False
    with FakeTensorMode():  # (a CUDA tensor without a GPU)
        on_cuda = [torch.empty(2, 3, device="cuda")]
    assert new_counts.applies(on_cuda, patches)
    # the ops wait on NCCL + cuBLAS on CUDA alone; under CUDA graph trees they choose at once
    assert not new_counts.applies([torch.empty(2, 3)], patches)
    assert not new_counts.applies(on_cuda, {**patches, "triton.cudagraphs": True})
    with config.patch(plain_graph_at_new_counts=False):
        assert not new_counts.applies(on_cuda, patches)


def test_graphs_on_symbolic_token_counts_compile_without_guards_on_them(monkeypatch):
    """Inductor's mix-order reductions check sizes by guarding on a symbolic token count (each
    count outside the traced one's window recompiled the frame on CUDA): backend="overlap"
    compiles graphs on symbolic counts, and their plain copy for new counts, without those
    checks; static graphs and a user's own setting keep theirs."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import torch._inductor.compile_fx as compile_fx_module

    setting = "triton.mix_order_reduction_non_strict_mode"
    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches))
    env = ShapeEnv()
    tokens = env.create_symintnode(env.create_symbol(80, ConstantSource("tokens")), hint=80)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    overlap_pass.overlap_backend(gm, [tokens])
    overlap_pass.overlap_backend(gm, [torch.ones(2)])
    overlap_pass.overlap_backend(gm, [tokens], options={setting: False})
    assert [patches.get(setting) for patches in seen] == [True, None, False]
    assert new_counts.plain_patches(seen[0])[setting] is True


def test_install_is_idempotent():
    before = torch._inductor.config.post_grad_custom_pre_pass
    install.install()
    install.install()
    assert torch._inductor.config.post_grad_custom_pre_pass is before
    assert isinstance(before, OverlapPass) and not before.always


def test_uuid_follows_source_and_config(tmp_path):
    always, gate = OverlapPass(always=True), OverlapPass(always=False)
    base = always.uuid()
    assert base is not None and base == OverlapPass().uuid()
    with config.patch(all_gather_matmul=False):
        assert always.uuid() != base
    with config.patch(debug_dir=str(tmp_path)):
        assert always.uuid() is None, "dumping must bypass the FX graph cache"
    assert gate.uuid() == "overlap_pass:off"
    with config.patch(enabled=True):
        assert gate.uuid()[0] == base[0], "the same source hash once the gate is open"


def test_entry_point_in_a_fresh_interpreter():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "overlap_pass.backend:overlap_backend" in [p.value for p in points if p.name == "overlap"]
    script = textwrap.dedent(
        """
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) @ x, backend="overlap")
        x = torch.randn(4, 4)
        torch.testing.assert_close(f(x), torch.sin(x) @ x)
        assert "overlap_pass" in sys.modules
        print("ok")
        """
    )
    assert "import overlap_pass" not in script
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_failed_rewrite_leaves_the_graph_as_it_was(tmp_path, monkeypatch):
    def broken(graph, match):
        with graph.inserting_before(match.wait):  # a half-done, wrong edit, then a failure
            wrong = graph.call_function(torch.ops.aten.relu.default, (match.terms[0].mm,))
        match.wait.replace_all_uses_with(wrong)
        raise RuntimeError("injected")

    monkeypatch.setattr(rewrite, "rewrite_matmul_reduce_scatter", broken)
    with fake_world(2) as group:
        args = (torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), group)
        out, dump = compile_and_dump(chain, args, tmp_path)
    assert list(out.shape) == [4, 8]
    for c in dump.candidates("inference"):
        assert not c["rewritten"] and "rewrite failed (RuntimeError: injected)" in c["reason"]
    after = dump.after("inference")
    assert "reduce_scatter_tensor" in after and "overlap." not in after and "relu" not in after


def test_public_api():
    assert overlap_pass.overlap_backend is overlap_pass.backend.overlap_backend
    assert set(overlap_pass.__all__) >= {"OverlapPass", "config", "overlap_backend"}


@pytest.mark.parametrize("value", ["1", "0"])
@pytest.mark.parametrize("flag", ["enabled", "strict"])
def test_env_var_sets_a_flag(flag, value):
    script = f"import overlap_pass; print(overlap_pass.config.{flag})"
    env = {f"OVERLAP_PASS_{flag.upper()}": value, "PATH": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == str(value == "1"), result.stderr[-2000:]


LAUNCHED = """
import sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore

def chain(x, w1, w2, group):
    hidden = funcol.all_gather_tensor(x, 0, group) @ w1
    return funcol.reduce_scatter_tensor(hidden @ w2, "sum", 0, group)

if __name__ == "__main__":
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    torch.compile(chain)(torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), dist.group.WORLD)
    print(sys.argv[1:], dict(counters["overlap_pass"]))
"""


@pytest.mark.parametrize("form", ["script", "module"])
def test_launch_runs_a_program_with_the_pass_in_the_default_compile(tmp_path, form):
    """python3 -m overlap_pass.launch: the program's plain torch.compile rewrites its collectives,
    and the program gets its own arguments (torchtitan.train's way in)."""
    (tmp_path / "launched_program.py").write_text(LAUNCHED)
    target = str(tmp_path / "launched_program.py") if form == "script" else "launched_program"
    # a cache of its own: a graph served from Inductor's caches skips the pass and its counters
    env = {"PATH": "", "PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "overlap_pass.launch", target, "--compile.enable", "x"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "['--compile.enable', 'x'] {'all_gather_matmul_rewritten': 1, 'matmul_reduce_scatter_rewritten': 1}"
    assert result.stdout.strip().splitlines()[-1] == expected, result.stdout + result.stderr[-2000:]


def _compile_chain(group) -> torch.Tensor:
    """A compile of ``chain`` that runs the pass (a graph cache hit would skip it, and its
    warning: the pass speaks where it runs)."""
    caches = {"fx_graph_cache": False, "autotune_local_cache": False}
    with torch._inductor.config.patch(caches), torch._functorch.config.patch(enable_autograd_cache=False):
        return torch.compile(chain, backend="overlap")(torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), group)


def test_a_graph_with_nothing_rewritten_warns_once_with_its_reasons(caplog):
    with fake_world(2) as group, config.patch(all_gather_matmul=False, matmul_reduce_scatter=False):
        with caplog.at_level("WARNING", logger="overlap_pass"):
            _compile_chain(group)
    told = [r.getMessage() for r in caplog.records if "rewrote none" in r.getMessage()]
    assert len(told) == 1, told
    assert "2 tensor-parallel collective(s)" in told[0]
    assert "1x all_gather_matmul: disabled by overlap_pass.config.all_gather_matmul" in told[0]
    assert "1x matmul_reduce_scatter: disabled by overlap_pass.config.matmul_reduce_scatter" in told[0]


def test_a_graph_with_a_rewrite_or_no_tensor_parallel_collective_does_not_warn(caplog):
    def no_matmul(x, group):  # a gather whose result no matmul reads: nothing to overlap
        return funcol.all_gather_tensor(x, 0, group).relu()

    with fake_world(2) as group, caplog.at_level("WARNING", logger="overlap_pass"):
        _compile_chain(group)
        torch.compile(no_matmul, backend="overlap")(torch.randn(4, 8), group)
    assert not [r for r in caplog.records if "rewrote none" in r.getMessage()]


def test_strict_mode_raises_where_nothing_is_rewritten():
    with fake_world(2) as group, config.patch(strict=True, all_gather_matmul=False, matmul_reduce_scatter=False):
        with pytest.raises(Exception) as raised:
            _compile_chain(group)
    chain_of_causes, error = [], raised.value
    while error is not None:
        chain_of_causes.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, overlap_pass.OverlapNotApplied) for e in chain_of_causes), raised.value
    with fake_world(2) as group, config.patch(strict=True):
        _compile_chain(group)  # everything rewritten: strict has nothing to say


def test_the_knobs_every_op_call_reads_follow_each_change():
    """config.hot()'s snapshot is taken anew after any change: patched (as a context and as a
    decorator, and back on exit) and set. (Set and put back by hand: monkeypatch would undo a
    config it finds unset with delattr, which on torch 2.15 removes the config from the module.)"""
    from overlap_pass import config

    def knobs():
        return tuple(config.hot())

    assert knobs() == (config.implementation, config.op_graphs, config.spin_limit)
    with config.patch(implementation="fused", spin_limit=7):
        assert knobs()[::2] == ("fused", 7)
        with config.patch(op_graphs=False):
            assert knobs() == ("fused", False, 7)
        assert knobs() == ("fused", True, 7)
    assert knobs() == ("auto", True, config.spin_limit)

    @config.patch(op_graphs=False)
    def inside():
        return knobs()[1]

    assert inside() is False and knobs()[1] is True
    kept = config.spin_limit, config.implementation
    try:
        config.spin_limit = 11
        assert knobs()[2] == 11
        config.implementation = "reference"
        assert knobs()[0] == "reference"
    finally:
        config.spin_limit, config.implementation = kept
    assert knobs() == ("auto", True, kept[0])
