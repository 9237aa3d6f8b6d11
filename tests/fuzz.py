"""Randomized-model checker: tensor-parallel blocks drawn from a seed, each compiled with
backend="overlap" and run end to end on CPU processes (gloo), against eager.

    python3 -m tests.fuzz --cases 50 --seed 0                # W drawn from 2, 3, 4
    python3 -m tests.fuzz --seed 17 --cases 1 --world 2,3    # rerun one case
    python3 -m tests.fuzz --replay '{"seed": 17, "world": 3, ...}'

Case i of a run is drawn from random.Random(seed + i) (tests/fuzz_models.draw): model dim, heads
and KV heads (GQA), FFN size, bias per linear, batch, tokens, world size, layout (DTensor
sequence parallel, DTensor plain TP, functional collectives Megatron style, DTensor and
functional mixed), fp32 or bf16 autocast, activation checkpointing, and odd patterns (a residual
added before the reduce-scatter, a second non-matmul reader of a gathered tensor, a
reduce-scatter along a moved dim). Each case runs forward and backward twice, compiled and eager,
on fresh seeded inputs, and fails when an output or gradient differs, compilation raises, a
candidate in the pass's decisions.json is neither rewritten nor skipped with a reason, or the
ranks decide differently. Cases are grouped by world size: one pool of W gloo ranks runs all of
a W's cases. The end of the run shows the coverage: per layout, candidates rewritten of found,
and every distinct skip reason with its count.
"""

import argparse
import collections
import json
import re
import sys
import time

from tests.fuzz_models import LAYOUTS, WORLDS, draw, run_case

# ---------------------------------------------------------------------------------------------
# Checking one case's per-rank results


def problems(case: dict, results: list[dict]) -> list[str]:
    """What went wrong in one case, given run_case's result from every rank; empty if nothing."""
    found = []
    for rank, result in enumerate(results):
        if result["error"]:
            found.append(f"rank {rank} raised:\n{result['error']}")
        found += [f"rank {rank}: {m}" for m in result["mismatches"]]
        for record in result["decisions"]:
            if not record["rewritten"] and not (isinstance(record["reason"], str) and record["reason"].strip()):
                found.append(f"rank {rank}: {record['graph']} {record['kind']} skipped without a reason")
    decided = [sorted(json.dumps(d, sort_keys=True) for d in r["decisions"]) for r in results]
    if any(d != decided[0] for d in decided):
        found.append("ranks decided differently:\n" + "\n".join(f"rank {r}: {d}" for r, d in enumerate(decided)))
    return found


def reason_key(reason: str) -> str:
    """A skip reason without its node names and sizes, so that reasons group across cases:
    "users: permute_3 (permute.default)" -> "users: permute"."""
    reason = re.sub(r"\b\w+ \((\w+)(?:\.\w+)?\)", r"\1", reason)
    return re.sub(r"\d+(\.\d+)?", "#", reason)


def rerun_command(case: dict, worlds: tuple) -> str:
    world = "" if tuple(worlds) == WORLDS else f" --world {','.join(map(str, worlds))}"
    return f"python3 -m tests.fuzz --seed {case['seed']} --cases 1{world}"


# ---------------------------------------------------------------------------------------------
# Coverage over many cases


class Coverage:
    """Per layout and kind: candidates found and rewritten; per skip reason: how often."""

    def __init__(self) -> None:
        self.found = collections.Counter()
        self.rewritten = collections.Counter()
        self.reasons = collections.Counter()
        self.cases = collections.Counter()
        self.tail_matmuls = collections.Counter()  # per layout, with config.tail_matmuls on

    def add(self, case: dict, decisions: list[dict]) -> None:
        layout = case["layout"]
        self.cases[layout] += 1
        for record in decisions:
            self.found[layout, record["kind"]] += 1
            self.tail_matmuls[layout] += record.get("tail_matmuls", 0)
            if record["rewritten"]:
                self.rewritten[layout, record["kind"]] += 1
            else:
                self.reasons[layout, record["graph"], record["kind"], reason_key(record["reason"] or "")] += 1

    def table(self) -> str:
        kinds = sorted({kind for _, kind in self.found})
        lines = ["layout         cases  " + "  ".join(f"{k:>24}" for k in kinds) + "     all"]
        for layout in LAYOUTS:
            if not self.cases[layout]:
                continue
            cells = [f"{self.rewritten[layout, k]:>11} / {self.found[layout, k]:<10}" for k in kinds]
            done = sum(self.rewritten[layout, k] for k in kinds)
            total = sum(self.found[layout, k] for k in kinds)
            lines.append(f"{layout:<14} {self.cases[layout]:>5}  " + "  ".join(cells) + f"  {done} / {total}")
        if any(self.tail_matmuls.values()):
            taken = ", ".join(f"{layout} {n}" for layout, n in self.tail_matmuls.items() if n)
            lines.append(f"weight gradients in reduce-scatter tails: {taken}")
        lines.append("")
        lines.append("skip reasons (count  layout  graph  kind: reason):")
        for (layout, graph, kind, reason), count in sorted(self.reasons.items(), key=lambda kv: (kv[0][0], -kv[1])):
            lines.append(f"{count:>6}  {layout:<13} {graph:<9} {kind}: {reason}")
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {
            "cases": dict(self.cases),
            "candidates": {f"{layout}/{kind}": n for (layout, kind), n in self.found.items()},
            "rewritten": {f"{layout}/{kind}": n for (layout, kind), n in self.rewritten.items()},
            "tail_matmuls": {layout: n for layout, n in self.tail_matmuls.items() if n},
            "skip_reasons": [
                {"layout": layout, "graph": graph, "kind": kind, "reason": reason, "count": n}
                for (layout, graph, kind, reason), n in self.reasons.most_common()
            ],
        }


# ---------------------------------------------------------------------------------------------
# Running cases on pools of gloo ranks


def run_cases(cases: list[dict], worlds: tuple, timeout_s: float, log=print) -> tuple[list[dict], Coverage]:
    """Runs every case, one pool per world size; returns a report per case and the coverage."""
    from tests import rank_pool

    rank_pool.TASK_TIMEOUT_S = timeout_s
    reports, coverage, done = [], Coverage(), 0
    for world in sorted({c["world"] for c in cases}):
        pool = rank_pool.RankPool(world, "gloo")
        try:
            for case in (c for c in cases if c["world"] == world):
                start = time.perf_counter()
                results, found, pool = _run_on(pool, case, "overlap")
                torch_too = False
                if found:  # the same case without the pass: does torch fail it by itself?
                    _, also, pool = _run_on(pool, case, "inductor")
                    torch_too = bool(also)
                seconds = time.perf_counter() - start
                done += 1
                decisions = results[0]["decisions"] if results else []
                if results:
                    coverage.add(case, decisions)
                rewritten = sum(d["rewritten"] for d in decisions)
                verdict = ("TORCH" if torch_too else "FAIL") if found else "ok"
                log(
                    f"[{done}/{len(cases)}] seed {case['seed']} W={world} {case['layout']:<13} "
                    f"{verdict:<5} {rewritten}/{len(decisions)} rewritten  {seconds:.0f} s"
                )
                if found:
                    log(failure_text(case, found, worlds, torch_too))
                reports.append(
                    {"case": case, "problems": found, "torch_too": torch_too, "decisions": decisions, "seconds": round(seconds, 1)}
                )
        finally:
            pool.close()
    return reports, coverage


def _run_on(pool, case: dict, backend: str) -> tuple:
    """(per-rank results, problems, pool): a pool whose rank hung or died is replaced."""
    from tests import rank_pool

    try:
        results = pool.run(run_case, case, backend)
        return results, problems(case, results), pool
    except rank_pool.RankFailed as failure:
        pool.close(force=True)
        return [], [str(failure)], rank_pool.RankPool(case["world"], "gloo")


def failure_text(case: dict, found: list[str], worlds: tuple, torch_too: bool = False) -> str:
    also = " (fails with backend=\"inductor\" too: torch's, not the pass's)" if torch_too else ""
    return "\n".join(
        [
            f"  FAILED seed {case['seed']}{also}: {json.dumps(case)}",
            f"  rerun: {rerun_command(case, worlds)}",
            f"     or: python3 -m tests.fuzz --replay '{json.dumps(case)}'",
        ]
        + ["  " + line for problem in found for line in problem.splitlines()]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.fuzz",
        description=(
            "Draws tensor-parallel transformer blocks from a seed (sizes, GQA, bias per linear, "
            "batch, tokens, world size, DTensor SP / DTensor plain TP / functional collectives / "
            "mixed, fp32 or bf16 autocast, activation checkpointing, odd collective patterns), "
            "compiles each with backend=\"overlap\" and checks it end to end against eager on "
            "CPU processes (gloo): outputs and gradients, no crash, every candidate in "
            "decisions.json rewritten or skipped with a reason, the same decisions on every "
            "rank. Prints a coverage table (rewritten / candidates per layout, skip reasons)."
        ),
    )
    parser.add_argument("--cases", type=int, default=20, help="how many cases (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="case i is drawn from seed + i (default 0)")
    parser.add_argument("--world", default=",".join(map(str, WORLDS)), help="world sizes to draw from (default 2,3,4)")
    parser.add_argument("--replay", help="run exactly this case (its JSON, as a failure prints it), or a JSON list of cases")
    parser.add_argument("--json", help="write every case's config, problems and decisions, and the coverage, here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a case may take before its ranks count as hung")
    args = parser.parse_args(argv)

    worlds = tuple(int(w) for w in args.world.split(","))
    if args.replay:
        replayed = json.loads(args.replay)
        cases = replayed if isinstance(replayed, list) else [replayed]
    else:
        cases = [draw(args.seed + i, worlds) for i in range(args.cases)]
    start = time.perf_counter()
    reports, coverage = run_cases(cases, worlds, args.timeout)
    wall = time.perf_counter() - start
    failed = [r for r in reports if r["problems"]]

    print()
    print(coverage.table())
    print()
    by_torch = sum(r["torch_too"] for r in failed)
    print(f"{len(reports)} cases, {len(failed)} failed ({by_torch} of them with backend=\"inductor\" too), {wall:.0f} s")
    for report in failed:
        also = "  (inductor too)" if report["torch_too"] else ""
        print(f"  seed {report['case']['seed']}: {rerun_command(report['case'], worlds)}{also}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": reports, "coverage": coverage.as_json(), "wall_s": round(wall, 1)}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
