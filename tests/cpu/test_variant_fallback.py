"""A variant that cannot run on this stack (a Gluon kernel this triton cannot compile, one that
cannot be captured in a CUDA graph, a triton whose Gluon the kernels cannot import) drops out of
the per-shape choice with its reason logged once, on every rank alike, and the op's call runs
the fastest remaining variant: measured, forced by config, or read from the cache file alike.
The ranks run the float8 all-gather's CUDA dispatch on CPU (fallback_cases.py)."""

import json
import math
import os
import subprocess
import sys

import pytest

from overlap_pass.lowering import choose

from . import fallback_cases as cases

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPILE_FAILED = f"overlap: variant {cases.GLUON} failed: CompilationError: {cases.COMPILE_ERROR}"
# per scenario and rank: the log lines about the Gluon variant (the choices' summaries aside),
# each once although two shapes are chosen
TOLD = {
    "measured": [[COMPILE_FAILED]] * 2,
    "one_rank": [[f"overlap: variant {cases.GLUON} is out: it failed on another rank"], [COMPILE_FAILED]],
    "forced": [
        [COMPILE_FAILED, f"overlap: forced variant {cases.GLUON} is out: it does not run here; choosing by measurement"]
    ] * 2,
    "cached": [[COMPILE_FAILED, "does not run here; measuring again"]] * 2,
    "captured": [
        [f"overlap: variant {cases.GLUON} cannot be captured in a CUDA graph: RuntimeError: operation not permitted "
         "when stream is capturing"]
    ] * 2,
}  # fmt: skip


@pytest.mark.parametrize("scenario", list(TOLD))
def test_a_variant_that_cannot_run_drops_out_of_the_choice(gloo_world, tmp_path, scenario):
    ranks = gloo_world(2).run(cases.fallback, scenario, str(tmp_path / "choices.json"))
    for rank, result in enumerate(ranks):
        # the Gluon stand-in would have been fastest: the next fastest runs, for both shapes
        assert result["chosen"] == [cases.COPY_ENGINE], (rank, result)
        assert result["error"] <= 1e-2, (rank, result)  # every call equals the op's reference
        told = [m for m in result["log"] if cases.GLUON in m and " -> " not in m]
        expected = TOLD[scenario][rank]
        assert len(told) == len(expected) and all(e in m for e, m in zip(expected, told)), (rank, told)
    (cache,) = {json.dumps(r["cache"], sort_keys=True) for r in ranks}  # one file, rank 0's
    entries = json.loads(cache).values()
    assert len(entries) == 2 and all(e["choice"] == cases.COPY_ENGINE for e in entries), cache
    assert all(math.isinf(e["times_us"][cases.GLUON]) for e in entries), cache  # measured as out


def test_token_counts_that_change_are_measured_once_per_bucket(gloo_world, tmp_path):
    """Dynamic shapes: 32 rows are measured (the Gluon stand-in fastest); 24 (the same bucket)
    runs that choice, and so does 40 (the bucket next to it: predicted), neither measured; 56
    rows (40's bucket) the choice refuses, so NCCL + cuBLAS runs them, told once; 200 rows (far
    from every measured bucket) are measured; 32 again, dropped meanwhile (two signatures
    kept), runs its bucket's choice again without measuring."""
    rows = [32, 24, 40, 56, 200, 200, 32]
    ranks = gloo_world(2).run(cases.changing_rows, str(tmp_path / "choices.json"), rows, 56, 2)
    for rank, result in enumerate(ranks):
        assert result["error"] <= 1e-2, (rank, result)
        assert result["measured"] == [32, 200], (rank, result)
        assert result["ran"] == [cases.GLUON] * 3 + [choose.BASELINE] + [cases.GLUON] * 3, (rank, result)
        assert result["chosen"] == {32: cases.GLUON, 256: cases.GLUON}, (rank, result)
        assert result["predicted"] == {64: cases.GLUON}, (rank, result)
        told = [m for m in result["log"] if "does not take this token count" in m]
        assert len(told) == 1 and "56 rows (stand-in)" in told[0], (rank, result["log"])
        assert result["kept"] == 2, (rank, result)


def test_a_far_bucket_runs_the_nearest_choice_until_it_recurs(gloo_world, tmp_path):
    """config.measure_bucket_after=3: 200 and 210 rows (a bucket far from 32's, the one
    measured) run 32's choice with no measurement; the bucket's third distinct count, 220, is
    measured; 200 and 210 again (still resolved) measure nothing more."""
    rows = [32, 200, 210, 220, 200, 210]
    ranks = gloo_world(2).run(cases.changing_rows, str(tmp_path / "choices.json"), rows, -1, 8, 3)
    for rank, result in enumerate(ranks):
        assert result["error"] <= 1e-2, (rank, result)
        assert result["measured"] == [32, 220], (rank, result)
        assert result["ran"] == [cases.GLUON] * len(rows), (rank, result)
        assert result["chosen"] == {32: cases.GLUON, 256: cases.GLUON}, (rank, result)


def test_a_token_count_runs_nccl_until_its_third_call(gloo_world, tmp_path):
    """config.fused_from_call=3: each call signature's first two calls run NCCL + cuBLAS, with
    no measurement; its third is measured (32 rows' bucket) or predicted (40, next to it) and
    runs the choice, as every later one does. 32, dropped meanwhile (three signatures kept),
    runs its choice at once when it comes back: its first calls are over. Every rank alike."""
    rows = [32, 32, 40, 32, 32, 40, 40, 40, 200, 300, 32]
    ranks = gloo_world(2).run(cases.changing_rows, str(tmp_path / "choices.json"), rows, -1, 3, 1, 3)
    nccl, gluon = choose.BASELINE, cases.GLUON
    for rank, result in enumerate(ranks):
        assert result["error"] <= 1e-2, (rank, result)
        assert result["measured"] == [32], (rank, result)
        assert result["ran"] == [nccl, nccl, nccl, gluon, gluon, nccl, gluon, gluon, nccl, nccl, gluon], (rank, result)
        assert result["chosen"] == {32: gluon}, (rank, result)
        assert result["predicted"] == {64: gluon}, (rank, result)


def test_no_op_waits_once_a_graph_waits_on_plain_inductor(gloo_world, tmp_path):
    """With a graph that runs plain Inductor's at a count's first calls (new_counts.py), the
    ops' own first calls no longer run NCCL + cuBLAS (config.fused_from_call=3 as above): 32
    is measured at its first call and 40 predicted at its first, each running the choice."""
    rows = [32, 32, 40, 40]
    ranks = gloo_world(2).run(cases.changing_rows, str(tmp_path / "choices.json"), rows, -1, 3, 1, 3, True)
    for rank, result in enumerate(ranks):
        assert result["error"] <= 1e-2, (rank, result)
        assert result["measured"] == [32], (rank, result)
        assert result["ran"] == [cases.GLUON] * len(rows), (rank, result)


def test_a_choice_measured_over_calls(gloo_world, tmp_path):
    """config.measure_over_calls: calls at 32, 24 and 20 rows (one bucket) each run a step of
    the measurement and return their own result: the Gluon and copy-engine stand-ins' first
    calls beside NCCL + cuBLAS, then rounds in which each call is a sample of one variant (the
    Gluon stand-in refuses 20 rows: NCCL + cuBLAS runs those calls, untimed), then the choice,
    run from the next call on. No call measures every variant; every rank alike."""
    steps = 2 + 3 * (choose.WARMUP + choose.ROUNDS)  # two first calls, then rounds of three variants
    rows = [32, 24, 20] * (steps // 3 + 2)
    assert len(rows) == steps + 4 and rows[steps] == 20
    ranks = gloo_world(2).run(cases.over_calls, str(tmp_path / "choices.json"), rows, 20, set())
    nccl, gluon, copy = choose.BASELINE, cases.GLUON, cases.COPY_ENGINE
    for rank, result in enumerate(ranks):
        ran = result["ran"]
        assert result["error"] <= 1e-2, (rank, result)
        assert ran == ranks[0]["ran"], rank
        assert ran[:2] == [[nccl, gluon], [nccl, copy]], (rank, ran)
        for start in range(2, steps, 3):  # a round: each variant once, in some order
            turns = ran[start : start + 3]
            assert sorted(r[0] for r in turns) == sorted([nccl, gluon, copy]), (rank, start, ran)
            for call, turn in enumerate(turns, start):
                refused = turn[0] == gluon and rows[call] == 20
                # a sample: SAMPLE_CALLS calls of the variant, the last one's result the call's
                assert turn == ([gluon, nccl] if refused else [turn[0]] * choose.SAMPLE_CALLS), (rank, call, turn)
        timed = ran[2 + 3 * choose.WARMUP : steps]
        gluon_samples = timed.count([gluon] * choose.SAMPLE_CALLS)
        assert result["samples"] == {nccl: choose.ROUNDS, copy: choose.ROUNDS, gluon: gluon_samples}
        # the choice made at the next call; 20 rows, which the Gluon stand-in refuses, run NCCL + cuBLAS
        assert ran[steps:] == [[gluon, nccl], [gluon], [gluon], [nccl]], (rank, ran[steps:])
        assert result["chosen"] == gluon and result["trials_left"] == 0, (rank, result)
        assert result["signatures_of_trials_left"] == 0, (rank, result)  # their graphs dropped at the choice
        (choice,) = result["choices"].values()
        assert choice["source"] == "measured", choice
        assert any(f"measured over {steps} calls" in m for m in result["log"]), result["log"]


def test_one_bucket_of_an_op_on_trial_at_a_time(gloo_world, tmp_path):
    """While 32 rows' bucket is measured over its calls, calls of 200 rows (another bucket of
    the same op) run NCCL + cuBLAS and start no trial of their own; once 32's choice is made,
    200 (far from it) runs that choice, as a far bucket does until it recurs."""
    steps = 2 + 3 * (choose.WARMUP + choose.ROUNDS)
    rows = [32, 200] * (steps + 2)
    ranks = gloo_world(2).run(cases.over_calls, str(tmp_path / "choices.json"), rows, -1, set())
    nccl, gluon = choose.BASELINE, cases.GLUON
    for rank, result in enumerate(ranks):
        ran = result["ran"]
        assert result["error"] <= 1e-2, (rank, result)
        assert ran[1 : 2 * steps : 2] == [[nccl]] * steps, (rank, ran)  # 200 rows while 32 is on trial
        assert ran[2 * steps :] == [[gluon]] * 4, (rank, ran[2 * steps :])  # 32's choice, then 200's too
        assert result["chosen"] == gluon and result["trials_left"] == 0, (rank, result)


def test_a_variant_failing_on_one_rank_is_out_of_the_measurement_over_calls(gloo_world, tmp_path):
    """The Gluon stand-in fails to compile on rank 1 at its first call: out on both ranks, never
    run again; the rounds are the two others', the copy engine chosen."""
    steps = 2 + 2 * (choose.WARMUP + choose.ROUNDS)
    rows = [32] * (steps + 4)
    ranks = gloo_world(2).run(cases.over_calls, str(tmp_path / "choices.json"), rows, -1, {1})
    nccl, gluon, copy = choose.BASELINE, cases.GLUON, cases.COPY_ENGINE
    for rank, result in enumerate(ranks):
        ran = result["ran"]
        assert result["error"] <= 1e-2, (rank, result)
        assert ran[:2] == [[nccl, gluon], [nccl, copy]], (rank, ran)
        assert sorted(r[0] for r in ran[2:steps]) == [copy] * (steps // 2 - 1) + [nccl] * (steps // 2 - 1), ran
        assert ran[steps:] == [[copy]] * (len(rows) - steps), (rank, ran)
        assert result["samples"] == {nccl: choose.ROUNDS, copy: choose.ROUNDS}, (rank, result)
        told = [m for m in result["log"] if cases.GLUON in m and " -> " not in m]
        expected = TOLD["one_rank"][rank]
        assert len(told) == len(expected) and all(e in m for e, m in zip(expected, told)), (rank, told)


def test_a_variant_raising_while_timed_is_out_on_every_rank(gloo_world):
    """A sample that raises on one rank (a ChunkTimeout told at a later call) does not leave
    choose on that rank while its peers wait in the next sample's collective: every rank times
    the variant as out, and runs no sample of it after the one that raised."""
    ranks = gloo_world(2).run(cases.a_variant_raising_while_timed)
    for rank, result in enumerate(ranks):
        times = result["times"]
        assert math.isinf(times["flaky"]) and math.isinf(times["absent"]), (rank, times)
        assert math.isfinite(times[choose.BASELINE]) and math.isfinite(times["steady"]), (rank, times)
        assert result["flaky_samples"] == 3, (rank, result)


def test_a_compile_error_is_told_in_one_line_once(caplog):
    caplog.set_level("INFO", logger="overlap_pass")
    reason = choose.failure(cases.compile_error())
    assert reason == f"CompilationError: {cases.COMPILE_ERROR}"  # not the source excerpt before it
    told = set(choose._TOLD)
    try:
        for _ in range(3):
            choose.tell_once(30, "overlap: variant %s failed: %s", "fused:x", reason)
    finally:
        choose._TOLD.clear()
        choose._TOLD.update(told)
    assert caplog.text.count("variant fused:x failed") == 1


def test_the_lowering_loads_without_gluon():
    """A triton without Gluon: the lowering still imports, every op keeps its other variants,
    and the Gluon ones are out with one log line however often the variants are listed."""
    code = """if True:
        import json, logging, sys
        sys.modules["triton.experimental.gluon"] = None  # as where triton has no Gluon
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from overlap_pass.lowering import dispatch, scaled
        names = [list(scaled.variants(scaled.AG_KIND)), list(scaled.variants(scaled.RS_KIND, 2))]
        names += [list(dispatch._ag_variants(1)), list(dispatch._rs_variants(2))]
        print(json.dumps(names))
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ag, rs, plain_ag, plain_rs = json.loads(done.stdout.splitlines()[-1])
    assert not [n for n in ag + rs if "gluon" in n], (ag, rs)
    assert rs == ["copy_engine_cublas", "nccl_cublas"] and ag[-2:] == rs and ag[0].startswith("fused:tma"), ag
    assert "nccl_cublas" in plain_ag and "nccl_cublas" in plain_rs
    told = [line for line in done.stderr.splitlines() if "gluon" in line]
    assert len(told) == 1 and "the Gluon kernels do not import" in told[0] and "triton.experimental.gluon" in told[0], told
