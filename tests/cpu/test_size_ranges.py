"""size_ranges.py: a graph compiled once per range of token counts, each call running its
range's graph, a range whose compile fails running the traced count's, and the record that lets
the traced compile be loaded from Inductor's caches."""

import json
import os
import subprocess
import sys

import pytest
import sympy
from torch._dynamo.source import ConstantSource
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.functions import CeilDiv, FloorDiv

from overlap_pass import config
from overlap_pass.graph import sizes
from overlap_pass.shapes import size_ranges


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
    """_compiler's stand-in, whose traced compile (``ranges`` unforced, under a record's key)
    can be a cache hit: the compiled function comes back, counted as Inductor counts a hit,
    without the pass having run."""
    compile_with, compiles = _compiler(symbol, threshold, traced)
    hit = [False]

    def maybe_cached(ranges):
        if hit[0] and not ranges.forced and ranges.record is not None:
            counters["inductor"]["fxgraph_cache_hit"] += 1
            compiles.append("cached")
            return lambda tokens: "split" if traced >= threshold else "whole"
        return compile_with(ranges)

    return maybe_cached, compiles, hit


def test_a_traced_compile_loaded_from_the_caches_keeps_its_ranges(tmp_path, monkeypatch):
    """The traced count's compile, cached under its record's key, keeps what its pass found in
    the record: a later compile of the same graph that hits the caches (its pass does not run)
    reads the thresholds back and compiles, or loads, the same ranges."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    symbol, count = _token_count(80)
    compile_with, compiles, hit = _cached_compiler(symbol, 100, 80)
    traced = size_ranges.Ranges(record="graph")
    assert traced.cacheable() and traced.key() == ("traced", "graph") and not size_ranges.Ranges().cacheable()
    size_ranges.compile_per_range(compile_with, [count], record="graph")
    assert compiles == [False, True] and list((tmp_path / "overlap_ranges").iterdir())
    hit[0] = True
    fn = size_ranges.compile_per_range(compile_with, [count], record="graph")
    assert compiles[2:] == ["cached", True]  # the traced graph from the cache, then its range
    assert [fn(t) for t in (64, 99, 100, 4096)] == ["whole", "whole", "split", "split"]


def test_a_graph_loaded_without_its_record_is_compiled_again(tmp_path, monkeypatch):
    """A traced graph loaded from the caches whose record is missing, or does not read back in
    full, is compiled again outside the caches, its pass deciding the ranges as on any rank that
    compiled it afresh."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    symbol, count = _token_count(80)
    (tmp_path / "overlap_ranges").mkdir()
    rows = [[sympy.srepr(symbol), 100, False], ["Symbol('unknown', integer=True)", 200, True]]
    (tmp_path / "overlap_ranges" / "unreadable.json").write_text(json.dumps(rows))
    for record in ("missing", "unreadable"):
        compile_with, compiles, hit = _cached_compiler(symbol, 100, 80)
        hit[0] = True
        fn = size_ranges.compile_per_range(compile_with, [count], record=record)
        assert compiles == ["cached", False, True] and (fn(99), fn(100)) == ("whole", "split")


def test_a_record_holds_expressions_of_torchs_sympy_functions(tmp_path, monkeypatch):
    """Token counts such as FloorDiv(s0, 2) read back as themselves."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    symbol, _ = _token_count(80)
    found = {(FloorDiv(symbol, 2), 100): False, (8 * CeilDiv(symbol, 8), 300): True}
    size_ranges._keep("graph", found)
    assert size_ranges._kept("graph", {symbol}) == found


def test_a_second_run_loads_every_graph_and_keeps_its_ranges(tmp_path):
    """A job's second run on the first one's caches (a process of its own each): backend="overlap"
    loads every graph on symbolic token counts from Inductor's FX graph cache, the traced count's
    too, and compiles the same ranges of counts from the record its first run kept."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "tests.cpu.ranges_run"], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first == {"fx": {"hit": 0, "miss": 2, "bypass": 0}, "returned": "ByTokenCount", "thresholds": [100]}
    assert second == {"fx": {"hit": 2, "miss": 0, "bypass": 0}, "returned": "ByTokenCount", "thresholds": [100]}
