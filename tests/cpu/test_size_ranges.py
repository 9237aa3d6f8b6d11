"""size_ranges.py on its own: a graph compiled once per range of token counts, each call
running its range's graph, and a range whose compile fails running the traced count's."""

import pytest
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from overlap_pass import config

from overlap_pass.shapes import size_ranges
from overlap_pass.graph import sizes


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
