"""What the pass tells about a graph: each decision counted (torch._dynamo's counters) and
logged (TORCH_LOGS=+overlap_pass), the dump written where dumping is on (dumps.py), and a
warning, or under config.strict an error, where a graph's tensor-parallel collectives all stay
plain.
"""

import collections
import logging

from torch._dynamo.utils import counters

from .. import config
from ..graph.records import Decision
from . import dumps

log = logging.getLogger("overlap_pass")


class OverlapNotApplied(RuntimeError):
    """Raised under config.strict where a graph's tensor-parallel collectives all stay plain."""


def count_and_log(decisions: list[Decision]) -> None:
    for decision in decisions:
        outcome = "rewritten" if decision.rewritten else "skipped"
        counters["overlap_pass"][f"{decision.kind}_{outcome}"] += 1
        if decision.rewritten:
            log.debug("%s at %s: rewritten", decision.kind, decision.name)
        else:
            log.debug("%s at %s: skipped: %s", decision.kind, decision.name, decision.reason)
    if decisions:
        rewritten = sum(d.rewritten for d in decisions)
        log.info("overlap_pass on %s: %d of %d candidates rewritten", dumps.graph_name(), rewritten, len(decisions))


def tell_if_none_rewritten(decisions: list[Decision], small: list[dict], tensor_parallel: set[str]) -> None:
    """A graph with tensor-parallel collectives of which the pass rewrote none runs exactly as
    plain Inductor would: say so once per graph, with the reasons counted (PyTorch's async TP
    is most often reported for doing nothing silently), or raise under config.strict. A
    tensor-parallel all-reduce run as overlap::all_reduce (``small``) counts as rewritten."""
    if any(r["rewritten"] and r["collective"]["name"] in tensor_parallel for r in small):
        return
    skipped = [d for d in decisions if d.name in tensor_parallel]
    # (a split left out of this graph for its range of token counts is in another's: size_ranges)
    elsewhere = any(d.notes.get("split", {}).get("in_another_graph") for d in decisions)
    if not skipped or elsewhere or any(d.rewritten for d in decisions):
        return
    reasons = collections.Counter(f"{d.kind}: {d.reason}" for d in skipped)
    message = (
        f"overlap: graph {dumps.graph_name()} has {len(skipped)} tensor-parallel collective(s) next "
        f"to matmuls and rewrote none of them, so it runs as plain Inductor would: "
        + "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common())
    )
    if config.strict:
        raise OverlapNotApplied(message)
    log.warning("%s (OVERLAP_PASS_STRICT=1 raises instead)", message)


def dump(before: str, after: str, decisions: list[Decision], merged: list[dict], small: list[dict]) -> None:
    """decisions.json and the graph before and after, where dumps.dumping() (never fails the
    compile: a folder that cannot be written is logged)."""
    record = {"graph": dumps.graph_name(), "rank": dumps.rank(), "candidates": [d.as_json() for d in decisions]}
    if merged:
        record["merged_all_reduces"] = merged
    if small:
        record["small_all_reduces"] = small
    try:
        dumps.trace_artifacts(before, after, record)
        for folder in dumps.write_dump(before, after, record):
            log.info("overlap_pass dump: %s", folder)
    except OSError as error:
        log.warning("overlap_pass: could not write the dump: %r", error)
