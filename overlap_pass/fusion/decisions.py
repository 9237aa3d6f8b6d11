"""A decision per candidate: what was matched, whether it is fused, why not, and what the fused
op will run (decide.py judges one match; this module records them all).
"""

from ..graph.nodes import describe_node
from ..graph.records import Decision
from . import decide
from .matches import ALL_GATHER_MATMUL, AllGatherMatmulMatch, Candidate

TAKEN = "the matmul is already fused with its all-gather"


def decide_all(candidates: list[Candidate]) -> list[tuple[Candidate, Decision]]:
    """A decision per candidate, in the candidates' order. All-gathers are decided first: a
    matmul they take is no longer free for a reduce-scatter."""
    decided = {}
    taken_by_all_gather = set()
    for candidate in sorted(candidates, key=lambda c: c.kind != ALL_GATHER_MATMUL):
        decision = describe(candidate)
        match = candidate.match
        if match is None:
            ok, reason = False, candidate.reason
        elif any(term.mm in taken_by_all_gather for term in getattr(match, "terms", ())):
            ok, reason = False, TAKEN
        else:
            ok, reason = decide.should_fuse(match)
        if ok:
            if isinstance(match, AllGatherMatmulMatch):
                taken_by_all_gather |= {use.mm for use in match.matmuls + match.contractions}
            decision.accept(decide.choose_implementation(match))
        else:
            decision.reason = reason or None
        decided[id(candidate)] = decision
    return [(c, decided[id(c)]) for c in candidates]


def describe(candidate: Candidate) -> Decision:
    """The candidate's record before any judgement: its collective, group and matched nodes."""
    node = candidate.collective
    world_size, group_name = node.args[-2], node.args[-1]
    facts = {"group": {"name": group_name, "size": world_size, "ranks": decide.group_ranks(group_name)}}
    match = candidate.match
    if getattr(match, "scaled", None) is not None:  # float8: _scaled_mm, the rows' scales
        rowwise = match.scaled.rowwise or any(
            t.input_scale.meta["val"].numel() > 1 for t in getattr(match, "terms", ())
        )
        facts["scaled"] = {
            "scales": "rowwise" if rowwise else "tensorwise",
            "out_dtype": str(match.scaled.out_dtype).replace("torch.", ""),
            "use_fast_accum": match.scaled.use_fast_accum,
        }
    if isinstance(match, AllGatherMatmulMatch):
        facts["dim"] = match.gather_dim
        facts["nodes"] = {
            "shard": describe_node(match.shard),
            "gathered": describe_node(match.gathered),
            "matmuls": [
                {k: describe_node(v) for k, v in (("mm", u.mm), ("mat2", u.mat2), ("bias", u.bias))}
                for u in match.matmuls
            ],
            "contractions": [
                {"mm": describe_node(u.mm), "other": describe_node(u.other), "gathered_left": u.gathered_left}
                for u in match.contractions
            ],
            "other_users": [n.name for n in match.other_users],
        }
        facts["return_gathered"] = bool(match.other_users)
    elif match is not None:
        facts["dim"] = match.scatter_dim
        facts["reduce_op"] = match.reduce_op
        if match.out_dtype is not None:  # the terms widened before the collective (autocast)
            facts["out_dtype"] = str(match.out_dtype).replace("torch.", "")
        facts["nodes"] = {
            "matmuls": [
                {k: describe_node(v) for k, v in (("mm", t.mm), ("input", t.input), ("mat2", t.mat2), ("bias", t.bias))}
                for t in match.terms
            ],
            "scattered": describe_node(match.scattered),
        }
    return Decision.of(candidate.kind, node, **facts)
