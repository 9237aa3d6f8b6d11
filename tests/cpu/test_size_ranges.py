"""size_ranges.py on its own: a graph compiled once per range of token counts, each call
running its range's graph, and a range whose compile fails running the traced count's."""

import json

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch._dynamo.source import ConstantSource
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from overlap_pass import config

from overlap_pass.shapes import size_ranges
from overlap_pass.graph import sizes

from .fake_world import fake_world


def _token_count(traced: int):
    env = ShapeEnv()
    symbol = env.create_symbol(traced, ConstantSource("tokens"))
    return symbol, env.create_symintnode(symbol, hint=traced)


def _compiler(symbol, threshold: int, traced: int, fail_forced: bool = False):
    """A stand-in for compile_fx: its 'pass' meets one region on ``symbol`` that splits from
    ``threshold`` tokens, judged at ``traced``; the compiled function says what it holds."""
    compiles = []

    def compile_with(ranges):
        if fail_forced and ranges.forced:
            raise RuntimeError("a compile that fails")
        with size_ranges.active(ranges):
            split = size_ranges.decide(symbol, threshold, traced >= threshold)
        compiles.append(split)
        return lambda tokens: "split" if split else "whole"

    return compile_with, compiles


def test_each_call_runs_the_graph_of_its_range():
    symbol, count = _token_count(80)
    compile_with, compiles = _compiler(symbol, 100, 80)
    fn = size_ranges.compile_per_range(compile_with, [count])
    assert compiles == [False, True]  # traced at 80 (whole), then the range from 100 on
    assert [fn(t) for t in (1, 64, 99, 100, 4096, 80)] == ["whole"] * 3 + ["split"] * 2 + ["whole"]


def test_a_split_from_few_tokens_holds_at_every_count():
    symbol, count = _token_count(80)
    compile_with, compiles = _compiler(symbol, size_ranges.FEWEST_TOKENS - 1, 80)
    fn = size_ranges.compile_per_range(compile_with, [count])
    assert compiles == [True] and fn(1) == "split"  # no second compile, no lookup


def test_a_split_from_exactly_the_fewest_tokens_has_a_range_below_it():
    symbol, count = _token_count(32)
    compile_with, compiles = _compiler(symbol, size_ranges.FEWEST_TOKENS, 32)
    fn = size_ranges.compile_per_range(compile_with, [count])
    assert compiles == [False, True] and (fn(size_ranges.FEWEST_TOKENS - 1), fn(size_ranges.FEWEST_TOKENS)) == ("whole", "split")


@pytest.mark.parametrize("strict", [False, True])
def test_a_range_whose_compile_fails_runs_the_traced_graph(strict):
    symbol, count = _token_count(80)
    compile_with, _ = _compiler(symbol, 100, 80, fail_forced=True)
    with config.patch(strict=strict):
        if strict:
            with pytest.raises(RuntimeError, match="a compile that fails"):
                size_ranges.compile_per_range(compile_with, [count])
            return
        fn = size_ranges.compile_per_range(compile_with, [count])
    assert fn(4096) == "whole" and fn(64) == "whole"


def test_a_bare_token_count_is_read_at_the_count_it_is_judged_at():
    """A size that is the token count itself (a [1, tokens, 1] statistic's numel, a batch of
    one) read by a cost model judging other counts (sizes.judged_at): xreplace hands such a
    size back as the int put in, not as a sympy number (once, every all-reduce split of a
    symbolic plain-TP training forward failed to plan on CUDA)."""
    symbol, count = _token_count(80)
    with sizes.judged_at({symbol: 130}):
        assert (sizes.hint(count), sizes.hint(count * 3)) == (130, 390)
    assert sizes.hint(count) == 80


def test_traced_values_put_in_as_ints_give_a_sympy_expression():
    """Values put in as ints (judged_at's are) give a sympy expression, the bare symbol too."""
    symbol, _ = _token_count(80)
    assert sizes.substituted(symbol, {symbol: 80}).is_number
    assert sizes.substituted(2 * symbol, {symbol: 80}) == 160


def _cached_compiler(symbol, threshold: int, traced: int):
    """_compiler's stand-in, whose traced compile (``ranges`` unforced) can be a cache hit: the
    compiled function comes back without the pass having run."""
    compile_with, compiles = _compiler(symbol, threshold, traced)
    hit = [False]

    def maybe_cached(ranges):
        if hit[0] and not ranges.forced:
            compiles.append("cached")
            return lambda tokens: "split" if traced >= threshold else "whole"
        return compile_with(ranges)

    return maybe_cached, compiles, hit


def test_a_traced_compile_loaded_from_the_caches_keeps_its_ranges(tmp_path, monkeypatch):
    """The traced count's compile keeps what its pass found in a record beside Inductor's
    caches: a later compile of the same graph that hits the caches (its pass does not run) reads
    the thresholds back and compiles, or loads, the same ranges."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    symbol, count = _token_count(80)
    compile_with, compiles, hit = _cached_compiler(symbol, 100, 80)
    assert size_ranges.Ranges(record="graph").cacheable() and not size_ranges.Ranges().cacheable()
    size_ranges.compile_per_range(compile_with, [count], record="graph")
    assert compiles == [False, True] and list((tmp_path / "overlap_ranges").iterdir())
    hit[0] = True
    fn = size_ranges.compile_per_range(compile_with, [count], record="graph")
    assert compiles[2:] == ["cached", True]  # the traced graph from the cache, then its range
    assert [fn(t) for t in (64, 99, 100, 4096)] == ["whole", "whole", "split", "split"]
    # another graph's key has no record: its cached compile is judged at its traced count
    other = size_ranges.compile_per_range(compile_with, [count], record="another graph")
    assert compiles[4:] == ["cached"] and other(4096) == "whole"


def test_a_record_that_does_not_read_back_is_left_out(tmp_path, monkeypatch):
    """A record's row whose expression is not the graph's (another symbol, text that does not
    parse) is left out; the rows that read back count."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    symbol, count = _token_count(80)
    (tmp_path / "overlap_ranges").mkdir()
    rows = [["2*unknown", 100, True], [str(symbol), 100, False], ["not an expression (", 1, True]]
    (tmp_path / "overlap_ranges" / "graph.json").write_text(json.dumps(rows))
    compile_with, compiles, hit = _cached_compiler(symbol, 100, 80)
    hit[0] = True
    fn = size_ranges.compile_per_range(compile_with, [count], record="graph")
    assert compiles == ["cached", True] and (fn(99), fn(100)) == ("whole", "split")


def test_a_graph_on_symbolic_counts_hits_the_caches_when_compiled_again(tmp_path, monkeypatch):
    """backend="overlap" on a graph on symbolic token counts, compiled again in the same caches
    (as a second run of a job): every graph is loaded from Inductor's FX graph cache, none is
    compiled or left out of it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    x, w_up, w_down = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    torch._dynamo.mark_dynamic(x, 0)
    counts = []
    with fake_world(2, kernels=True) as group:

        def sp_mlp(x, w_up, w_down):
            gathered = funcol.all_gather_tensor(x, 0, group)
            return funcol.reduce_scatter_tensor(torch.relu(gathered @ w_up) @ w_down, "sum", 0, group)

        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(sp_mlp, backend="overlap")(x, w_up, w_down)
            counts.append({k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")})
            assert counters["overlap_pass"]["all_gather_matmul_rewritten"] == (1 if len(counts) == 1 else 0)
    assert counts[0] == {"hit": 0, "miss": 1, "bypass": 0}
    assert counts[1] == {"hit": 1, "miss": 0, "bypass": 0}
