"""The pass's stages, in order, on one post-grad graph (forward or backward): normalize, split
plain TP's all-reduces, find -> decide -> rewrite the collective/matmul pairs, seat the plain
gathers left as passengers, then the small all-reduces.

Each stage plans without touching the graph, then edits it; an edit that fails (or leaves a
graph that does not lint) is undone, with a warning, and the stages after it go on: never crash
compilation on a graph the pass did not foresee. A stage whose config knob is off is skipped.
"""

import dataclasses
import logging
from collections.abc import Callable

from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph

from .. import config
from ..fusion import rewrite
from ..fusion.decide import FIRST_CALL, PER_SHAPE
from ..fusion.decisions import decide_all
from ..fusion.find_all_gathers import find_all_gather_matmuls
from ..fusion.find_reduce_scatters import find_matmul_reduce_scatters
from ..fusion.matches import ALL_GATHER_MATMUL
from ..graph.edits import copy_graph, restore_graph
from ..graph.nodes import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SCALED_MM, next_to_matmul
from ..graph.records import Decision
from ..normalize import casts, float8, permutes, waits
from ..regions import early_all_reduces, passengers, small_all_reduces, split_apply, split_records, split_walk
from ..regions import tail_matmuls
from . import dumps, report

log = logging.getLogger("overlap_pass")


@dataclasses.dataclass
class State:
    """What the stages of one graph learn and hand on."""

    tensor_parallel: set  # names of the collectives next to matmuls, before any edit
    merged_waits: dict = dataclasses.field(default_factory=dict)  # collective -> waits merged into its first
    folded: int = 0  # rowwise float8 matmuls read as one rowwise _scaled_mm
    split: list = dataclasses.field(default_factory=list)  # the all-reduce split's decisions
    permuted: dict = dataclasses.field(default_factory=dict)  # new all-gather -> "movedim(0, d)"
    cast: dict = dataclasses.field(default_factory=dict)  # all-gather -> "float32 -> bfloat16"
    decisions: list = dataclasses.field(default_factory=list)  # (Candidate, Decision) per candidate
    riders: list = dataclasses.field(default_factory=list)  # passengers' decisions
    merged: list = dataclasses.field(default_factory=list)  # records of merged small all-reduces
    small: list = dataclasses.field(default_factory=list)  # records of the small all-reduces

    def accepted(self) -> bool:
        return any(d.rewritten for _, d in self.decisions)

    def all_decisions(self) -> list[Decision]:
        return self.split + [d for _, d in self.decisions] + self.riders


@dataclasses.dataclass(frozen=True)
class Stage:
    what: str  # for the log: "merging repeated waits"
    # the graph -> what to do (None: nothing), never editing the graph
    plan: Callable[[Graph, State], object]
    # makes the edits ``plan`` found; undone where it fails
    edit: Callable[[Graph, State, object], None]
    knob: str | None = None  # the config flag that turns the stage off
    undone: Callable[[State, Exception], None] | None = None  # after a failed edit was undone


# --- normalize: each collective in the form the matchers read ------------------------------------


def _merge_waits(graph: Graph, state: State, repeated) -> None:
    waits.apply(graph, repeated)
    state.merged_waits = {value: len(found) - 1 for value, found in repeated.items()}


def _fold_float8(graph: Graph, state: State, _) -> None:
    state.folded = float8.fold_rowwise_epilogues(graph)


def _plan_split(graph: Graph, state: State):
    """all-reduces split (config.split_all_reduce), float8 quantization moved before
    all-gathers (config.quantize_before_gather): a decision per collective considered."""
    if not config.split_all_reduce:
        reason = "disabled by overlap_pass.config.split_all_reduce"
        state.split = [split_records.record(node, reason) for node in graph.find_nodes(op="call_function", target=ALL_REDUCE)]
        if not config.quantize_before_gather:
            return None
    found = split_walk.plan(graph, all_reduces=config.split_all_reduce, gathers=config.quantize_before_gather)
    state.split += list(found.records.values())
    return found if found.accepted() else None


def _split(graph: Graph, state: State, found) -> None:
    split_apply.apply(graph, found)
    stable_topological_sort(graph)


def _split_undone(state: State, error: Exception) -> None:
    for decision in state.split:
        if decision.rewritten:
            decision.skip(f"split failed ({type(error).__name__}: {error})")


def _move_permutes(graph: Graph, state: State, moves) -> None:
    state.permuted = permutes.apply(graph, moves)


def _move_casts(graph: Graph, state: State, moves) -> None:
    casts.apply(graph, moves)
    state.cast = {m.gather: f"{m.source_dtype} -> {m.dtype}".replace("torch.", "") for m in moves}


# --- fusion: find -> decide -> rewrite -------------------------------------------------------------


def _decide(graph: Graph, state: State):
    """A decision per candidate pair, with the moves that made it matchable; returns what to
    rewrite (the accepted ones) or None."""
    candidates = find_all_gather_matmuls(graph) + find_matmul_reduce_scatters(graph)
    state.decisions = decide_all(candidates)
    for candidate, decision in state.decisions:
        for moves, note in (
            (state.cast, "cast_moved_before_gather"),
            (state.permuted, "permute_moved_before_gather"),
            (state.merged_waits, "repeated_waits_merged"),
        ):
            if candidate.collective in moves:
                decision.notes[note] = moves[candidate.collective]
    return state.decisions if state.accepted() else None


def _rewrite(graph: Graph, state: State, decisions) -> None:
    rewrite.rewrite_accepted(graph, decisions)


def _rewrite_undone(state: State, error: Exception) -> None:
    for _, decision in state.decisions:
        if decision.rewritten:
            decision.skip(f"rewrite failed ({type(error).__name__}: {error})")


def _plan_passengers(graph: Graph, state: State):
    """The all-gathers left plain, where a fused op took its pair."""
    if not state.accepted():
        return None
    return [c.collective for c, _ in state.decisions if c.kind == ALL_GATHER_MATMUL]


def _attach_passengers(graph: Graph, state: State, all_gathers) -> None:
    """A host's decision names the op it became with its riders, and how many ride."""
    state.riders, hosts = passengers.attach_all(graph, all_gathers)
    for _, decision in state.decisions:
        op = hosts.get(decision.op)
        if op is not None:
            decision.op = op.name
            decision.notes["passengers"] = len(op.args[passengers.HOSTS[op.target].passengers])
            _choice_made_at_first_call(decision)


def _take_tail_matmuls(graph: Graph, state: State, _) -> None:
    """Each op's decision names the op it became and the matmuls in its tail."""
    taken = tail_matmuls.take_all(graph)
    for _, decision in state.decisions:
        found = taken.get(decision.op)
        if found is not None:
            decision.op = found["op"]
            decision.notes["tail_matmuls"] = found["tail_matmuls"]
            counters["overlap_pass"]["tail_matmuls_taken"] += len(found["tail_matmuls"])
            _choice_made_at_first_call(decision)


def _choice_made_at_first_call(decision: Decision) -> None:
    """A decision whose op gained arguments after it was made (passengers, a tail): a choice
    cached for the op without them is not the one that runs, its calls' key holding them
    (lowering/dispatch.py), so it is measured at its first call; one made per shape at run
    time still is."""
    if (decision.implementation or "").startswith("auto") and decision.implementation != PER_SHAPE:
        decision.implementation = FIRST_CALL


def _unfold_float8(graph: Graph, state: State, _) -> None:
    float8.unfold(graph)


# --- small all-reduces -----------------------------------------------------------------------------


def _merge_small_all_reduces(graph: Graph, state: State, groups) -> None:
    state.merged = early_all_reduces.apply(graph, groups)
    for record in state.merged:
        counters["overlap_pass"]["all_reduces_merged"] += len(record["all_reduces"])
        log.debug("%d all-reduces merged into %s", len(record["all_reduces"]), record["collective"]["name"])


def _rewrite_small_all_reduces(graph: Graph, state: State, _) -> None:
    state.small = small_all_reduces.rewrite_all(graph)
    rewritten = sum(r["rewritten"] for r in state.small)
    if rewritten:
        counters["overlap_pass"]["small_all_reduces_rewritten"] += rewritten


def _always(graph: Graph, state: State):
    return True


STAGES = (
    Stage("merging repeated waits", lambda g, s: waits.plan(g) or None, _merge_waits),
    Stage(
        "folding rowwise float8 scales", lambda g, s: g.find_nodes(op="call_function", target=SCALED_MM) or None,
        _fold_float8, knob="fold_rowwise_float8",
    ),
    Stage("splitting all-reduces", _plan_split, _split, undone=_split_undone),
    Stage("moving permutes before all-gathers", lambda g, s: permutes.plan(g) or None, _move_permutes, knob="all_gather_matmul"),
    Stage("moving casts before all-gathers", lambda g, s: casts.plan(g) or None, _move_casts, knob="all_gather_matmul"),
    Stage("rewriting collective/matmul pairs", _decide, _rewrite, undone=_rewrite_undone),
    Stage("attaching passengers", _plan_passengers, _attach_passengers),
    Stage("taking tail matmuls", lambda g, s: s.accepted() or None, _take_tail_matmuls, knob="tail_matmuls"),
    Stage("unfolding rowwise float8 scales", lambda g, s: s.folded or None, _unfold_float8),
    Stage(
        "merging small all-reduces", lambda g, s: early_all_reduces.plan(g) or None, _merge_small_all_reduces,
        knob="merge_small_all_reduces",
    ),
    Stage("rewriting small all-reduces", _always, _rewrite_small_all_reduces),
)  # fmt: skip


def run(graph: Graph) -> list[dict]:
    """Every stage on ``graph``; returns the decision records (decisions.json's candidates)."""
    before = dumps.graph_text(graph) if dumps.dumping() else None
    state = State(tensor_parallel=_tensor_parallel_collectives(graph))
    for stage in STAGES:
        if stage.knob is None or getattr(config, stage.knob):
            _run_stage(graph, stage, state)
    decisions = state.all_decisions()
    report.count_and_log(decisions)
    if before is not None:
        report.dump(before, dumps.graph_text(graph), decisions, state.merged, state.small)
    report.tell_if_none_rewritten(decisions, state.small, state.tensor_parallel)
    return [d.as_json() for d in decisions]


def _run_stage(graph: Graph, stage: Stage, state: State) -> None:
    try:
        planned = stage.plan(graph, state)
    except Exception as error:  # planning reads the graph only: nothing to undo
        log.warning("overlap_pass: planning %s failed: %r", stage.what, error)
        return
    if planned is None:
        return
    snapshot = copy_graph(graph)
    try:
        stage.edit(graph, state, planned)
        graph.lint()
    except Exception as error:
        log.warning("overlap_pass: %s failed, graph left as it was: %r", stage.what, error)
        restore_graph(graph, snapshot)
        if stage.undone is not None:
            stage.undone(state, error)


def _tensor_parallel_collectives(graph: Graph) -> set[str]:
    """Names of the collectives next to matmuls (nodes.next_to_matmul), before any edit."""
    return {
        node.name
        for target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
        for node in graph.find_nodes(op="call_function", target=target)
        if next_to_matmul(node)
    }
