"""One compiled graph per range of token counts, where a plain-TP split pays only from some count
on (backend="overlap", graphs with symbolic token counts).

The all-reduce split (regions/split_regions.py) is a choice of graph, not of kernel: a split
region runs its row-wise ops on 1/W of the tokens between a reduce-scatter and an all-gather,
which pays at a long prompt and costs a short one its extra op calls. A graph traced at 2048
tokens and run at 1 to 8192 cannot be judged at one count. So the pass reports, for each region
on a symbolic count, the fewest tokens at which it splits (``threshold``); the backend compiles
the graph once more per range between those counts, each range's regions split or not as they
pay there, and each call runs the graph of the range its token count falls in (a lookup on
the host per call).

What crosses from the backend to the pass (whose compile of the backward may come later, from
autograd) rides on the OverlapPass object: a Ranges, whose ``forced`` decisions the pass takes and
whose ``found`` thresholds it fills.

A graph loaded from Inductor's caches runs no pass, so it would fill no thresholds. So the
traced count's compile is cached under ``record`` (a key of the graph, its traced sizes and the
settings that decide what the pass finds), and a compile whose pass ran on every graph keeps
what it found in a record of that key beside Inductor's caches. A compile that loaded any of
its graphs from the caches takes the thresholds from the record; where the record is missing
or unreadable (a remote cache, a write that failed), it compiles again without the caches, so
that every rank decides its ranges from a pass that ran.
"""

import bisect
import contextlib
import dataclasses
import json
import logging
import os
import tempfile

import sympy
import torch
import torch.utils._sympy.functions as torch_sympy
from torch._dynamo.utils import counters

from .. import config, torch_compat

log = logging.getLogger("overlap_pass")

# A region that splits from fewer tokens than this splits at every count: a range below it
# (a few decode tokens) is not worth a compile of its own.
FEWEST_TOKENS = 64


@dataclasses.dataclass
class Ranges:
    """``forced``: (token count expression, threshold) -> whether regions with that threshold
    split in this compile; ``found``: each such pair the pass met -> whether it split it;
    ``record``: the key under which the traced count's compile is cached and keeps ``found``
    (None: it is not cached)."""

    forced: dict = dataclasses.field(default_factory=dict)
    found: dict = dataclasses.field(default_factory=dict)
    record: str | None = None

    def cacheable(self) -> bool:
        return bool(self.forced) or self.record is not None

    def key(self) -> tuple:
        if not self.forced:
            return ("traced", self.record)
        return tuple(sorted((str(expr), threshold, split) for (expr, threshold), split in self.forced.items()))


_ACTIVE: list[Ranges] = []


@contextlib.contextmanager
def active(ranges: Ranges | None):
    """The pass runs with ``ranges`` (None: each region judged at its traced count)."""
    _ACTIVE.append(ranges)
    try:
        yield
    finally:
        _ACTIVE.pop()


def compiling_per_range() -> bool:
    """Whether this compile is one of backend="overlap"'s per range of counts (a region left
    whole here for its count is split in the graph of the counts where it pays)."""
    return bool(_ACTIVE) and _ACTIVE[-1] is not None


def decide(tokens: sympy.Expr, threshold: int, traced: bool) -> bool:
    """Whether a region on ``tokens`` that splits from ``threshold`` tokens on splits in this
    compile: as forced for its range, else as judged at the traced count (``traced``)."""
    ranges = _ACTIVE[-1] if _ACTIVE else None
    if ranges is None:
        return traced
    split = ranges.forced.get((tokens, threshold), traced)
    ranges.found.setdefault((tokens, threshold), split)
    return split


def compile_per_range(compile_with, example_inputs, record: str | None = None):
    """``compile_with(ranges)`` compiles the graph with the pass taking ``ranges``; once, or (where
    the pass met regions whose split depends on the token count) once per range of counts,
    behind a function that picks the range's graph per call. ``record``: the key under which
    the traced count's thresholds are kept for a compile that hits Inductor's caches."""
    first = Ranges(record=record)
    loaded_before = _loaded_from_caches()
    compiled = compile_with(first)
    if record is not None and _loaded_from_caches() == loaded_before:
        _keep(record, first.found)  # the pass ran on every graph: what it found is whole
    elif record is not None:
        kept = _kept(record, input_symbols(example_inputs))
        if kept is None:
            log.warning("overlap: a graph loaded from the caches has no record of its token-count ranges: "
                        "compiled again")
            first = Ranges()
            compiled = compile_with(first)
        else:
            first.found = kept
    thresholds = sorted({threshold for _, threshold in first.found if threshold >= FEWEST_TOKENS})
    counts = {expr for expr, threshold in first.found if threshold >= FEWEST_TOKENS}
    if not thresholds and all(first.found.values()):
        return compiled
    # (told as warnings: the regions' splits then hold only at counts like the traced one)
    if len(counts) > 1:
        log.warning("overlap: regions on %d token counts (%s): each judged at its traced count", len(counts), counts)
        return compiled
    count = next(iter(counts), None)
    readers = symbol_readers(example_inputs, count.free_symbols) if count is not None else []
    if readers is None:
        log.warning("overlap: no graph input holds the token count %s: its regions judged at its traced count", count)
        return compiled
    per_range = []
    for low in [0, *thresholds]:
        forced = {pair: pair[1] < FEWEST_TOKENS or low >= pair[1] for pair in first.found}
        per_range.append(compiled if forced == first.found else _compiled_or(compiled, compile_with, forced, low))
    if len(per_range) == 1:
        return per_range[0]
    log.info("overlap: %d graphs for token counts %s split at %s", len(per_range), count, thresholds)
    return ByTokenCount(count, readers, thresholds, per_range)


def _compiled_or(compiled, compile_with, forced: dict, low: int):
    """The graph compiled for a range (``forced`` its splits), or where that compile fails,
    ``compiled`` (the traced count's graph: right at every count, its splits judged there)."""
    try:
        return compile_with(Ranges(forced=forced))
    except Exception as error:  # (e.g. Inductor on a split it has not met before)
        if config.strict:
            raise
        log.warning("overlap: the graph for token counts from %d failed to compile (%r); they run the traced count's", low, error)
        return compiled


def _loaded_from_caches() -> int:
    """How many graphs this process loaded from Inductor's FX graph cache or AOTAutograd's cache
    (a loaded graph's pass did not run)."""
    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def _record_path(record: str) -> str:
    return os.path.join(torch_compat.inductor_cache_dir(), "overlap_ranges", f"{record}.json")


# what a record's expressions are rebuilt from (sympy.srepr's names, torch's sympy functions)
_NAMES = {**vars(sympy), **vars(torch_sympy), "__builtins__": {}}


def _keep(record: str, found: dict) -> None:
    """Writes the record of ``found`` (each expression as sympy.srepr, checked to read back as
    itself); where one does not, removes the record instead, so that a later compile loaded from
    the caches compiles again."""
    path = _record_path(record)
    rows = [[sympy.srepr(expr), threshold, split] for (expr, threshold), split in found.items()]
    try:
        whole = all(_expression(text) == expr for (text, _, _), (expr, _) in zip(rows, found))
    except Exception:  # (an expression torch's sympy functions cannot rebuild)
        whole = False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not whole:
            if os.path.exists(path):
                os.remove(path)
            return
        handle, written = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
        with os.fdopen(handle, "w") as f:
            json.dump(rows, f)
        os.replace(written, path)
    except OSError as error:
        log.warning("overlap: could not keep the record of a graph's token-count ranges (%s): %r", path, error)


def _kept(record: str, symbols: set) -> dict | None:
    """The record's found thresholds, their expressions in the graph's own symbols; None where
    there is no record or any of it does not read back."""
    path = _record_path(record)
    try:
        with open(path) as f:
            rows = json.load(f)
        found = {}
        for text, threshold, split in rows:
            expr = _expression(text)
            if not expr.free_symbols <= symbols:
                return None
            found[(expr, int(threshold))] = bool(split)
        return found
    except FileNotFoundError:
        return None
    except Exception as error:  # (a record from elsewhere, cut short, or of another form)
        log.warning("overlap: the record of a graph's token-count ranges does not read (%s): %r", path, error)
        return None


def _expression(text: str) -> sympy.Expr:
    return eval(text, dict(_NAMES))  # a sympy.srepr string: calls of sympy's and torch's classes


def input_symbols(example_inputs) -> set:
    """Every symbol of the graph's inputs' sizes (SymInt inputs and symbolic dims)."""
    sizes = [x for x in example_inputs if isinstance(x, torch.SymInt)]
    sizes += [s for x in example_inputs if isinstance(x, torch.Tensor) for s in x.shape if isinstance(s, torch.SymInt)]
    return {symbol for size in sizes for symbol in size.node.expr.free_symbols}


class ByTokenCount:
    """Runs the graph of the range a call's token count falls in."""

    def __init__(self, count: sympy.Expr, readers: list, thresholds: list[int], per_range: list) -> None:
        symbols = [symbol for symbol, _ in readers]
        self._count = sympy.lambdify(symbols, count, modules="math")
        self._readers = [where for _, where in readers]
        self._thresholds = thresholds
        self._per_range = per_range

    def tokens(self, args) -> int:
        return int(self._count(*symbol_values(args, self._readers)))

    def __call__(self, *args):
        return self._per_range[bisect.bisect_right(self._thresholds, self.tokens(args))](*args)


def symbol_values(args, readers: list) -> tuple:
    """The values of a call's symbols: ``readers`` as (input index, dim or None) each."""
    return tuple(args[i] if dim is None else args[i].shape[dim] for i, dim in readers)


def symbol_readers(example_inputs, symbols) -> list | None:
    """(symbol, (input index, dim or None)) for each of ``symbols``: a SymInt input holding it,
    else a tensor input's dim; None where one is held by neither."""
    where = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt) and x.node.expr.is_Symbol:
            where.setdefault(x.node.expr, (i, None))
    for i, x in enumerate(example_inputs):
        for dim, size in enumerate(x.shape if isinstance(x, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                where.setdefault(size.node.expr, (i, dim))
    if not all(s in where for s in symbols):
        return None
    return [(s, where[s]) for s in sorted(symbols, key=str)]
