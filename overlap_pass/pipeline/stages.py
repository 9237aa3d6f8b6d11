"""The pass's stages, in order, on one post-grad graph (forward or backward): normalize, split
plain TP's all-reduces, find -> decide -> rewrite the collective/matmul pairs, seat the plain
gathers left as passengers, then the small all-reduces.

Each stage plans without touching the graph, then edits it, and what the edit returns is kept
(in the decisions, the counters) once the graph lints; an edit that fails (or leaves a graph
that does not lint) is undone, with a warning, nothing of it kept, and the stages after it go
on: never crash compilation on a graph the pass did not foresee. A stage whose config knob is
off is skipped.
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
    # (graph, what plan found) -> what to keep: makes the edits and nothing else; undone where it fails
    edit: Callable[[Graph, object], object]
    # (state, what edit returned): after the edited graph linted
    keep: Callable[[State, object], None] | None = None
    knob: str | None = None  # the config flag that turns the stage off
    undone: Callable[[State, Exception], None] | None = None  # after a failed edit was undone


# --- normalize: each collective in the form the matchers read ------------------------------------


def _merge_waits(graph: Graph, repeated) -> dict:
    waits.apply(graph, repeated)
    return {value: len(found) - 1 for value, found in repeated.items()}


def _keep_merged_waits(state: State, merged: dict) -> None:
    state.merged_waits = merged


def _keep_folded(state: State, folded: int) -> None:
    state.folded = folded


def _plan_split(graph: Graph, state: State):
    """all-reduces split (config.split_all_reduce), float8 quantization moved before
    all-gathers (config.quantize_before_gather): a decision per collective considered."""
    if not config.split_all_reduce:
        reason = "disabled by overlap_pass.config.split_all_reduce"
        all_reduces = graph.find_nodes(op="call_function", target=ALL_REDUCE)
        state.split = [split_records.record(node, reason) for node in all_reduces]
        if not config.quantize_before_gather:
            return None
    found = split_walk.plan(graph, all_reduces=config.split_all_reduce, gathers=config.quantize_before_gather)
    state.split += list(found.records.values())
    return found if found.accepted() else None


def _split(graph: Graph, found) -> None:
    split_apply.apply(graph, found)
    stable_topological_sort(graph)


def _split_undone(state: State, error: Exception) -> None:
    for decision in state.split:
        if decision.rewritten:
            decision.skip(f"split failed ({type(error).__name__}: {error})")


def _keep_permuted(state: State, permuted: dict) -> None:
    state.permuted = permuted


def _move_casts(graph: Graph, moves) -> dict:
    casts.apply(graph, moves)
    return {m.gather: f"{m.source_dtype} -> {m.dtype}".replace("torch.", "") for m in moves}


def _keep_cast(state: State, cast: dict) -> None:
    state.cast = cast


# --- fusion: find -> decide -> rewrite -------------------------------------------------------------


def _decide(graph: Graph, state: State):
    """A decision per candidate pair, with the moves that made it matchable; returns what to
    rewrite (the accepted ones) or None."""
    candidates = find_all_gather_matmuls(graph) + find_matmul_reduce_scatters(graph)
    decisions = decide_all(candidates)
    for candidate, decision in decisions:
        for moves, note in (
            (state.cast, "cast_moved_before_gather"),
            (state.permuted, "permute_moved_before_gather"),
            (state.merged_waits, "repeated_waits_merged"),
        ):
            if candidate.collective in moves:
                decision.notes[note] = moves[candidate.collective]
    state.decisions = decisions
    return decisions if state.accepted() else None


def _rewrite(graph: Graph, decisions) -> None:
    # (each decision names the op it became, or why it was skipped: undone marks them all)
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


def _keep_passengers(state: State, attached: tuple) -> None:
    """The riders' decisions; a host's decision names the op it became with its riders, and how
    many ride."""
    state.riders, hosts = attached
    for _, decision in state.decisions:
        op = hosts.get(decision.op)
        if op is not None:
            decision.op = op.name
            decision.notes["passengers"] = len(op.args[passengers.HOSTS[op.target].passengers])
            _choice_made_at_first_call(decision)


def _keep_tail_matmuls(state: State, taken: dict) -> None:
    """Each op's decision names the op it became and the matmuls in its tail."""
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


# --- small all-reduces -----------------------------------------------------------------------------


def _keep_merged_all_reduces(state: State, merged: list) -> None:
    state.merged = merged
    for record in merged:
        counters["overlap_pass"]["all_reduces_merged"] += len(record["all_reduces"])
        log.debug("%d all-reduces merged into %s", len(record["all_reduces"]), record["collective"]["name"])


def _keep_small_all_reduces(state: State, small: list) -> None:
    state.small = small
    rewritten = sum(r["rewritten"] for r in small)
    if rewritten:
        counters["overlap_pass"]["small_all_reduces_rewritten"] += rewritten


def _always(graph: Graph, state: State):
    return True


STAGES = (
    Stage("merging repeated waits", lambda g, s: waits.plan(g) or None, _merge_waits, _keep_merged_waits),
    Stage(
        "folding rowwise float8 scales", lambda g, s: g.find_nodes(op="call_function", target=SCALED_MM) or None,
        lambda g, _: float8.fold_rowwise_epilogues(g), _keep_folded, knob="fold_rowwise_float8",
    ),
    Stage("splitting all-reduces", _plan_split, _split, undone=_split_undone),
    Stage(
        "moving permutes before all-gathers", lambda g, s: permutes.plan(g) or None, permutes.apply, _keep_permuted,
        knob="all_gather_matmul",
    ),
    Stage(
        "moving casts before all-gathers", lambda g, s: casts.plan(g) or None, _move_casts, _keep_cast,
        knob="all_gather_matmul",
    ),
    Stage("rewriting collective/matmul pairs", _decide, _rewrite, undone=_rewrite_undone),
    Stage("attaching passengers", _plan_passengers, passengers.attach_all, _keep_passengers, knob="gather_passengers"),
    Stage(
        "taking tail matmuls", lambda g, s: s.accepted() or None, lambda g, _: tail_matmuls.take_all(g),
        _keep_tail_matmuls, knob="tail_matmuls",
    ),
    Stage("unfolding rowwise float8 scales", lambda g, s: s.folded or None, lambda g, _: float8.unfold(g)),
    Stage(
        "merging small all-reduces", lambda g, s: early_all_reduces.plan(g) or None, early_all_reduces.apply,
        _keep_merged_all_reduces, knob="merge_small_all_reduces",
    ),
    Stage(
        "rewriting small all-reduces", _always, lambda g, _: small_all_reduces.rewrite_all(g), _keep_small_all_reduces,
    ),
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
        result = stage.edit(graph, planned)
        graph.lint()
    except Exception as error:
        log.warning("overlap_pass: %s failed, graph left as it was: %r", stage.what, error)
        restore_graph(graph, snapshot)
        if stage.undone is not None:
            stage.undone(state, error)
        return
    if stage.keep is not None:
        stage.keep(state, result)


def _tensor_parallel_collectives(graph: Graph) -> set[str]:
    """Names of the collectives next to matmuls (nodes.next_to_matmul), before any edit."""
    return {
        node.name
        for target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
        for node in graph.find_nodes(op="call_function", target=target)
        if next_to_matmul(node)
    }
