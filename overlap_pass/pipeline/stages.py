"""OverlapPass: move casts -> find -> decide -> rewrite, on each post-grad graph (forward and
backward).

The pass sits in Inductor's post_grad_custom_pre_pass slot: it runs before Inductor's own
post-grad pattern passes and before ``_micro_pipeline_tp``, so neither can take or reshape the
collective -> matmul patterns first.
"""

import collections
import functools
import glob
import os

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph

from . import config, debug, direct_calls, size_ranges
from .debug import log
from .fusion import decide, rewrite
from .fusion.find_all_gathers import find_all_gather_matmuls
from .fusion.find_reduce_scatters import find_matmul_reduce_scatters
from .fusion.matches import ALL_GATHER_MATMUL, AllGatherMatmulMatch, Candidate
from .graph.nodes import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SCALED_MM, describe_node, next_to_matmul
from .normalize import casts, float8, permutes, waits
from .regions import (
    early_all_reduces, passengers, small_all_reduces, split_apply, split_records, split_walk, tail_matmuls,
)


class OverlapPass(CustomGraphPass):
    """Rewrites all_gather -> matmul and matmul -> reduce_scatter into overlap's ops.

    ``always=True`` (backend="overlap") runs on every graph; ``always=False`` is the hook that
    ``import overlap_pass`` installs into the default Inductor compile, active only while
    ``overlap_pass.config.enabled`` is set.
    """

    def __init__(self, always: bool = True, ranges: size_ranges.Ranges | None = None) -> None:
        self.always = always
        self.ranges = ranges  # backend="overlap": the token counts this compile runs

    def active(self) -> bool:
        return self.always or config.enabled

    def __call__(self, graph: Graph) -> None:
        if not self.active():
            return
        if not self.always:
            _tell_if_ranks_may_differ()
        try:
            direct_calls.install_lowerings()  # before Inductor lowers the ops the pass inserts
            with size_ranges.active(self.ranges):
                overlap_graph_pass(graph)
        except OverlapNotApplied:  # config.strict: the user asked for this to fail the compile
            raise
        except Exception as error:  # the graph is whole (see _rewrite_all); compile goes on
            log.warning("overlap_pass failed on %s: %r", debug.graph_name(), error)

    def uuid(self):
        if not self.active():
            return "overlap_pass:off"
        if debug.dumping():
            return None  # no FX graph cache, so every compile writes its dump
        if self.ranges is not None and not self.ranges.forced:
            return None  # a cached graph would not tell where its regions split (size_ranges.py)
        # the all-reduce split slices each rank's rows into its graph
        ranges = self.ranges.key() if self.ranges is not None else None
        return (_source_hash(), config.get_hash(), _rank() if config.split_all_reduce else None, ranges)


@functools.cache
def _tell_if_ranks_may_differ() -> None:
    """Inside the default compile (config.enabled), Inductor's settings are the user's: say
    once where they can give ranks different graphs (backend.SAME_GRAPH_ON_EVERY_RANK)."""
    from .backend import SAME_GRAPH_ON_EVERY_RANK

    differing = {k: v for k, v in SAME_GRAPH_ON_EVERY_RANK.items() if getattr(torch._inductor.config, k) != v}
    if differing:
        log.warning(
            "overlap: Inductor's %s can give ranks different graphs (shape padding benchmarks each rank on "
            "its own), and overlap's ops are collective: set %s in torch._inductor.config "
            "(TORCHINDUCTOR_SHAPE_PADDING=0), as backend=\"overlap\" and overlap_pass.launch do",
            ", ".join(differing), ", ".join(f"{k} = {v!r}" for k, v in differing.items()),
        )


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


@functools.cache
def _source_hash() -> bytes:
    here = os.path.dirname(os.path.abspath(__file__))
    return get_hash_for_files(tuple(sorted(glob.glob(os.path.join(here, "**", "*.py"), recursive=True))))


class ChainedGraphPass(CustomGraphPass):
    """Several custom passes in one Inductor slot, for torch versions whose slots take one."""

    def __init__(self, passes: list) -> None:
        self.passes = list(passes)

    def __call__(self, graph: Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(i is None for i in ids) else tuple(ids)


def with_overlap_pass(slot, overlap_pass):
    """The value for an Inductor custom-pass slot: what it held, minus any pass of
    ``overlap_pass``'s class (OverlapPass, RegatherPass), then ``overlap_pass``."""
    if slot is None:
        existing = []
    elif isinstance(slot, ChainedGraphPass):
        existing = slot.passes
    elif isinstance(slot, (list, tuple)):
        existing = list(slot)
    else:
        existing = [slot]
    passes = [p for p in existing if not isinstance(p, type(overlap_pass))] + [overlap_pass]
    return passes[0] if len(passes) == 1 else ChainedGraphPass(passes)


def install() -> None:
    """Hooks the pass (and RegatherPass, in the joint graph's slot) into the default
    torch.compile, gated by config.enabled. Idempotent."""
    from .regather import RegatherPass

    inductor = torch._inductor.config
    for name, graph_pass in (("post_grad_custom_pre_pass", OverlapPass), ("joint_custom_pre_pass", RegatherPass)):
        slot = getattr(inductor, name)
        held = slot.passes if isinstance(slot, ChainedGraphPass) else [slot]
        if not any(isinstance(p, graph_pass) for p in held):
            setattr(inductor, name, with_overlap_pass(slot, graph_pass(always=False)))


class OverlapNotApplied(RuntimeError):
    """Raised under config.strict where a graph's tensor-parallel collectives all stay plain."""


# ---------------------------------------------------------------------------------------------


def overlap_graph_pass(graph: Graph) -> list[dict]:
    """one wait per collective (waits.py) -> split all-reduces (all_reduce_split.py) -> move
    permutes and casts before all-gathers (permutes.py, casts.py) -> find -> decide -> rewrite
    on one graph; returns the decision records."""
    dumping = debug.dumping()
    before = debug.graph_text(graph) if dumping else ""
    tensor_parallel = _tensor_parallel_collectives(graph)
    merged_waits = _merge_repeated_waits(graph)
    folded = _fold_rowwise_epilogues(graph)
    split_records = _split_all_reduces(graph)
    permuted = _move_permutes(graph) if config.all_gather_matmul else {}
    moved = _move_casts(graph, casts.plan(graph)) if config.all_gather_matmul else {}
    candidates = find_all_gather_matmuls(graph) + find_matmul_reduce_scatters(
        graph
    )
    decisions = _decide(candidates)
    for candidate, record in decisions:
        if candidate.collective in moved:
            record["cast_moved_before_gather"] = moved[candidate.collective]
        if candidate.collective in permuted:
            record["permute_moved_before_gather"] = permuted[candidate.collective]
        if candidate.collective in merged_waits:
            record["repeated_waits_merged"] = merged_waits[candidate.collective]
    rider_records = []
    if any(record["rewritten"] for _, record in decisions):
        _rewrite_all(graph, decisions)
        rider_records, hosts = _attach_passengers(graph, [c.collective for c in candidates if c.kind == ALL_GATHER_MATMUL])
        _name_hosts(decisions, hosts)
        if config.tail_matmuls:
            _take_tail_matmuls(graph, decisions)
    if folded:
        _unfold_rowwise_epilogues(graph)
    merged = _merge_small_all_reduces(graph) if config.merge_small_all_reduces else []
    small = _rewrite_small_all_reduces(graph)

    records = split_records + [record for _, record in decisions] + rider_records
    _count_and_log(records)
    if dumping:
        _dump(before, debug.graph_text(graph), records, merged, small)
    # (a tensor-parallel all-reduce run as overlap::all_reduce counts as rewritten; an amax's does not)
    taken = [r for r in small if r["rewritten"] and r["collective"]["name"] in tensor_parallel]
    _tell_if_none_rewritten(records + taken, tensor_parallel)
    return records


def _tensor_parallel_collectives(graph: Graph) -> set[str]:
    """Names of the collectives next to matmuls (patterns.next_to_matmul), before any edit."""
    targets = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
    return {
        node.name
        for target in targets
        for node in graph.find_nodes(op="call_function", target=target)
        if next_to_matmul(node)
    }


def _tell_if_none_rewritten(records: list[dict], tensor_parallel: set[str]) -> None:
    """A graph with tensor-parallel collectives of which the pass rewrote none runs exactly as
    plain Inductor would: say so once per graph, with the reasons counted (PyTorch's async TP
    is most often reported for doing nothing silently), or raise under config.strict."""
    skipped = [r for r in records if r["collective"]["name"] in tensor_parallel]
    # (a split left out of this graph for its range of token counts is in another's: size_ranges)
    if not skipped or any(r["rewritten"] or r.get("split", {}).get("in_another_graph") for r in records):
        return
    reasons = collections.Counter(f"{r['kind']}: {r['reason']}" for r in skipped)
    message = (
        f"overlap: graph {debug.graph_name()} has {len(skipped)} tensor-parallel collective(s) next "
        f"to matmuls and rewrote none of them, so it runs as plain Inductor would: "
        + "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common())
    )
    if config.strict:
        raise OverlapNotApplied(message)
    log.warning("%s (OVERLAP_PASS_STRICT=1 raises instead)", message)


def _rewrite_all(graph: Graph, decisions: list[tuple[Candidate, dict]]) -> None:
    """Rewrites the accepted candidates one by one, keeping the graph sorted after each.

    A candidate whose op would read its own result (through rewrites done before it) is skipped
    with its reason. Should a rewrite still fail, the graph is restored as it was before the
    pass and every candidate records the failure, so compilation goes on with the original."""
    snapshot = _copy_graph(graph)
    # Reduce-scatters first: their ops read a matmul that an all-gather op may replace next,
    # and the replacement then updates them (see rewrite.py).
    ordered = sorted(decisions, key=lambda d: d[0].kind == ALL_GATHER_MATMUL)
    try:
        for candidate, record in ordered:
            if not record["rewritten"]:
                continue
            if rewrite.would_create_cycle(candidate.match):
                record.update(rewritten=False, implementation=None, reason=CYCLE)
                continue
            if isinstance(candidate.match, AllGatherMatmulMatch):
                op = rewrite.rewrite_all_gather_matmul(graph, candidate.match)
            else:
                op = rewrite.rewrite_matmul_reduce_scatter(graph, candidate.match)
            record["op"] = op.name
            stable_topological_sort(graph)
        graph.lint()
    except Exception as error:  # never crash compilation on a graph we did not foresee
        log.warning("overlap_pass: rewrite failed, graph left as it was: %r", error)
        _restore_graph(graph, snapshot)
        for _, record in decisions:
            if record["rewritten"]:
                record.update(
                    rewritten=False,
                    reason=f"rewrite failed ({type(error).__name__}: {error})",
                    implementation=None,
                    op=None,
                )


CYCLE = "its op would read a value computed from its own result (through another rewrite)"


def _attach_passengers(graph: Graph, all_gathers: list) -> tuple[list[dict], dict]:
    """passengers.py's rewrite of the all-gathers left plain: records per all-gather, and the
    op each host became. Should it fail, the graph is restored as it was after the fused
    rewrites, and nothing rides."""
    snapshot = _copy_graph(graph)
    try:
        records, hosts = passengers.attach_all(graph, all_gathers)
        graph.lint()
        return records, hosts
    except Exception as error:  # never crash compilation on a graph we did not foresee
        log.warning("overlap_pass: attaching passengers failed, graph left as it was: %r", error)
        _restore_graph(graph, snapshot)
        return [], {}


def _name_hosts(decisions: list[tuple[Candidate, dict]], hosts: dict) -> None:
    """A host's record names the op it became with its riders, and how many ride."""
    for _, record in decisions:
        op = hosts.get(record.get("op"))
        if op is None:
            continue
        record.update(op=op.name, passengers=len(op.args[passengers.HOSTS[op.target].passengers]))
        _choice_made_at_first_call(record)


def _take_tail_matmuls(graph: Graph, decisions: list[tuple[Candidate, dict]]) -> None:
    """tail_matmuls.py's rewrite; each op's record names the op it became and the matmuls in
    its tail (counted as tail_matmuls_taken). Should it fail, the graph is restored as it was
    after the fused rewrites."""
    taken = {}
    if not _edited_or_restored(graph, "taking tail matmuls", lambda: taken.update(tail_matmuls.take_all(graph))):
        return
    for _, record in decisions:
        found = taken.get(record.get("op"))
        if found is None:
            continue
        record.update(op=found["op"], tail_matmuls=found["tail_matmuls"])
        counters["overlap_pass"]["tail_matmuls_taken"] += len(found["tail_matmuls"])
        _choice_made_at_first_call(record)


def _choice_made_at_first_call(record: dict) -> None:
    """A record whose op gained arguments after the decision (passengers, a tail): a choice
    cached for the op without them is not the one that runs, its calls' key holding them
    (lowering/dispatch.py), so it is measured at its first call; one made per shape at run
    time still is."""
    if (record["implementation"] or "").startswith("auto") and record["implementation"] != decide.PER_SHAPE:
        record["implementation"] = decide.FIRST_CALL


def _merge_small_all_reduces(graph: Graph) -> list[dict]:
    """early_all_reduces.py's coalescing; a record per merged group (decisions.json's
    "merged_all_reduces", apart from the candidates), counted as all_reduces_merged. Should it
    fail, the graph is restored and every all-reduce runs on its own."""
    groups = early_all_reduces.plan(graph)
    records = []
    if not groups or not _edited_or_restored(
        graph, "merging small all-reduces", lambda: records.extend(early_all_reduces.apply(graph, groups))
    ):
        return []
    for record in records:
        counters["overlap_pass"]["all_reduces_merged"] += len(record["all_reduces"])
        log.debug("%d all-reduces merged into %s", len(record["all_reduces"]), record["collective"]["name"])
    return records


def _rewrite_small_all_reduces(graph: Graph) -> list[dict]:
    """small_all_reduces.py's rewrite; a record per all-reduce (decisions.json's
    "small_all_reduces"), counted as small_all_reduces_rewritten. Should it fail, the graph is
    restored and every all-reduce stays as it was."""
    records = []
    if not _edited_or_restored(
        graph, "rewriting small all-reduces", lambda: records.extend(small_all_reduces.rewrite_all(graph))
    ):
        return []
    rewritten = sum(r["rewritten"] for r in records)
    if rewritten:
        counters["overlap_pass"]["small_all_reduces_rewritten"] += rewritten
    return records


def _merge_repeated_waits(graph: Graph) -> dict:
    """waits.py's merge; returns {collective: how many later waits were merged into its first}.
    Should it fail, the graph is restored, and the matchers skip such collectives with their
    reason."""
    repeated = waits.plan(graph)
    if not repeated or not _edited_or_restored(graph, "merging repeated waits", lambda: waits.apply(graph, repeated)):
        return {}
    return {value: len(found) - 1 for value, found in repeated.items()}


def _fold_rowwise_epilogues(graph: Graph) -> int:
    """float8.py's rewrite; returns how many it folded. Should it fail, the graph is restored."""
    if not config.fold_rowwise_float8 or not graph.find_nodes(op="call_function", target=SCALED_MM):
        return 0
    snapshot = _copy_graph(graph)
    try:
        folded = float8.fold_rowwise_epilogues(graph)
        graph.lint()
        return folded
    except Exception as error:  # never crash compilation on a graph we did not foresee
        log.warning("overlap_pass: folding rowwise float8 scales failed, graph left as it was: %r", error)
        _restore_graph(graph, snapshot)
        return 0


def _unfold_rowwise_epilogues(graph: Graph) -> None:
    try:
        float8.unfold(graph)
        graph.lint()
    except Exception as error:  # the folded form computes the same; Inductor may still run it
        log.warning("overlap_pass: unfolding rowwise float8 scales failed: %r", error)


def _split_all_reduces(graph: Graph) -> list[dict]:
    """Plans and applies all_reduce_split.py's regions (all-reduces split, float8 quantization
    moved before all-gathers); returns a record per collective it considered. Should the rewrite
    fail, the graph is restored and no region is applied."""
    disabled = []
    if not config.split_all_reduce:
        disabled = [
            split_records.record(node, "disabled by overlap_pass.config.split_all_reduce")
            for node in graph.find_nodes(op="call_function", target=ALL_REDUCE)
        ]
        if not config.quantize_before_gather:
            return disabled
    try:
        split_plan = split_walk.plan(
            graph, all_reduces=config.split_all_reduce, gathers=config.quantize_before_gather
        )
    except Exception as error:  # never crash compilation on a graph we did not foresee
        log.warning("overlap_pass: planning the all-reduce split failed: %r", error)
        return disabled
    records = disabled + list(split_plan.records.values())
    if not split_plan.accepted():
        return records
    snapshot = _copy_graph(graph)
    try:
        split_apply.apply(graph, split_plan)
        stable_topological_sort(graph)
        graph.lint()
    except Exception as error:  # never crash compilation on a graph we did not foresee
        log.warning("overlap_pass: splitting all-reduces failed, graph left as it was: %r", error)
        _restore_graph(graph, snapshot)
        for record in records:
            if record["rewritten"]:
                record.update(rewritten=False, reason=f"split failed ({type(error).__name__}: {error})")
    return records


def _move_permutes(graph: Graph) -> dict:
    """Applies permutes.py's moves; returns {the new all-gather node: "movedim(0, d)"}. Should
    one fail, the graph is restored and none is kept."""
    moves, moved = permutes.plan(graph), {}
    if not moves:
        return {}
    edit = lambda: moved.update(permutes.apply(graph, moves))  # noqa: E731
    return moved if _edited_or_restored(graph, "moving permutes before all-gathers", edit) else {}


def _move_casts(graph: Graph, moves: list) -> dict:
    """Applies casts.py's moves; returns {all-gather node: "float32 -> bfloat16"}. Should one
    fail, the graph is restored and none is kept."""
    if not moves or not _edited_or_restored(graph, "moving casts before all-gathers", lambda: casts.apply(graph, moves)):
        return {}
    return {m.gather: f"{m.source_dtype} -> {m.dtype}".replace("torch.", "") for m in moves}


def _edited_or_restored(graph: Graph, what: str, edit) -> bool:
    """Runs ``edit()`` on ``graph``; should it fail (or leave a graph that does not lint), the
    graph is restored as it was and False returned: never crash compilation on a graph we did
    not foresee."""
    snapshot = _copy_graph(graph)
    try:
        edit()
        graph.lint()
    except Exception as error:
        log.warning("overlap_pass: %s failed, graph left as it was: %r", what, error)
        _restore_graph(graph, snapshot)
        return False
    return True


def _copy_graph(graph: Graph) -> Graph:
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def _restore_graph(graph: Graph, snapshot: Graph) -> None:
    """Makes ``graph`` hold the nodes of ``snapshot`` again. A failed rewrite can leave the
    graph unsorted, so every node lets go of its inputs before any is erased."""
    nodes = list(graph.nodes)
    for node in nodes:
        node.args, node.kwargs = (), {}
    for node in nodes:
        graph.erase_node(node)
    graph.output(graph.graph_copy(snapshot, {}))


def _decide(candidates: list[Candidate]) -> list[tuple[Candidate, dict]]:
    """A record per candidate: matched or not, accepted or not, why. All-gathers are decided
    first: a matmul they take is no longer free for a reduce-scatter."""
    records = {}
    taken_by_all_gather = set()
    by_kind = sorted(candidates, key=lambda c: c.kind != ALL_GATHER_MATMUL)
    for candidate in by_kind:
        record = _describe(candidate)
        if candidate.match is None:
            ok, reason = False, candidate.reason
        elif any(term.mm in taken_by_all_gather for term in getattr(candidate.match, "terms", ())):
            ok, reason = False, "the matmul is already fused with its all-gather"
        else:
            ok, reason = decide.should_fuse(candidate.match)
        if ok and isinstance(candidate.match, AllGatherMatmulMatch):
            match = candidate.match
            taken_by_all_gather |= {use.mm for use in match.matmuls + match.contractions}
        record["rewritten"] = ok
        record["reason"] = reason or None
        record["implementation"] = decide.choose_implementation(candidate.match) if ok else None
        records[id(candidate)] = record
    return [(c, records[id(c)]) for c in candidates]


def _describe(candidate: Candidate) -> dict:
    node = candidate.collective
    world_size, group_name = node.args[-2], node.args[-1]
    record = {
        "kind": candidate.kind,
        "collective": describe_node(node),
        "group": {"name": group_name, "size": world_size, "ranks": decide.group_ranks(group_name)},
    }
    match = candidate.match
    if getattr(match, "scaled", None) is not None:  # float8: _scaled_mm, the rows' scales
        rowwise = match.scaled.rowwise or any(
            t.input_scale.meta["val"].numel() > 1 for t in getattr(match, "terms", ())
        )
        record["scaled"] = {
            "scales": "rowwise" if rowwise else "tensorwise",
            "out_dtype": str(match.scaled.out_dtype).replace("torch.", ""),
            "use_fast_accum": match.scaled.use_fast_accum,
        }
    if isinstance(match, AllGatherMatmulMatch):
        record["dim"] = match.gather_dim
        record["nodes"] = {
            "shard": describe_node(match.shard),
            "gathered": describe_node(match.gathered),
            "matmuls": [
                {k: describe_node(v) for k, v in (("mm", u.mm), ("mat2", u.mat2), ("bias", u.bias))}
                for u in match.matmuls
            ],
            "contractions": [
                {
                    "mm": describe_node(u.mm),
                    "other": describe_node(u.other),
                    "gathered_left": u.gathered_left,
                }
                for u in match.contractions
            ],
            "other_users": [n.name for n in match.other_users],
        }
        record["return_gathered"] = bool(match.other_users)
    elif match is not None:
        record["dim"] = match.scatter_dim
        record["reduce_op"] = match.reduce_op
        if match.out_dtype is not None:  # the terms widened before the collective (autocast)
            record["out_dtype"] = str(match.out_dtype).replace("torch.", "")
        record["nodes"] = {
            "matmuls": [
                {
                    k: describe_node(v)
                    for k, v in (("mm", t.mm), ("input", t.input), ("mat2", t.mat2), ("bias", t.bias))
                }
                for t in match.terms
            ],
            "scattered": describe_node(match.scattered),
        }
    return record


def _count_and_log(records: list[dict]) -> None:
    for record in records:
        outcome = "rewritten" if record["rewritten"] else "skipped"
        counters["overlap_pass"][f"{record['kind']}_{outcome}"] += 1
        if record["rewritten"]:
            log.debug("%s at %s: rewritten", record["kind"], record["collective"]["name"])
        else:
            log.debug(
                "%s at %s: skipped: %s",
                record["kind"],
                record["collective"]["name"],
                record["reason"],
            )
    if not records:
        return
    rewritten = sum(r["rewritten"] for r in records)
    log.info(
        "overlap_pass on %s: %d of %d candidates rewritten",
        debug.graph_name(),
        rewritten,
        len(records),
    )


def _dump(before: str, after: str, records: list[dict], merged: list[dict], small: list[dict]) -> None:
    record = {"graph": debug.graph_name(), "rank": debug.rank(), "candidates": records}
    if merged:
        record["merged_all_reduces"] = merged
    if small:
        record["small_all_reduces"] = small
    try:
        debug.trace_artifacts(before, after, record)
        for folder in debug.write_dump(before, after, record):
            log.info("overlap_pass dump: %s", folder)
    except OSError as error:
        log.warning("overlap_pass: could not write the dump: %r", error)
