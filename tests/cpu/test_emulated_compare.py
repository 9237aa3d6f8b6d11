"""benchmarks/emulated/compare.py: the errors and rankings of emulated runs against measured
ones, one pair of files or every pair of two folders."""

import json
import subprocess
import sys

import pytest

from benchmarks.emulated import compare


def model_run(times: dict, world: int = 4) -> dict:
    row = {"model": "block", "layout": "sp", "size": "llama3-8b", "batch": 1, "us": times}
    return {"meta": {"device": "GPU", "world": world}, "rows": [row]}


def ops_run(times: dict) -> dict:
    return {"meta": {"device": "GPU", "world": 4, "op": "all_gather_matmul"}, "rows": [{"shape": "qkv", "us_graph": times}]}


def test_errors_are_relative_to_the_measured_time():
    rows = compare.pairs(model_run({"inductor": 100.0, "overlap": 80.0}), model_run({"inductor": 110.0, "overlap": 76.0}))
    assert rows == [("block sp llama3-8b batch 1", "inductor", 100.0, 110.0), ("block sp llama3-8b batch 1", "overlap", 80.0, 76.0)]
    assert compare.errors_of(rows) == pytest.approx([0.10, 0.05])


def test_a_row_whose_compilers_swap_places_is_not_ranked_as_measured():
    measured = model_run({"inductor": 100.0, "overlap": 90.0, "floor": 70.0})
    kept = compare.pairs(measured, model_run({"inductor": 104.0, "overlap": 95.0, "floor": 71.0}))
    swapped = compare.pairs(measured, model_run({"inductor": 100.0, "overlap": 101.0, "floor": 71.0}))
    assert compare.ranked_alike(kept) == {"block sp llama3-8b batch 1": True}
    assert compare.ranked_alike(swapped) == {"block sp llama3-8b batch 1": False}


def test_timings_of_one_run_only_are_left_out():
    rows = compare.pairs(model_run({"inductor": 100.0, "overlap": 90.0}), model_run({"overlap": 99.0, "extra": 1.0}))
    assert [key for _, key, _, _ in rows] == ["overlap"]


def test_folders_pair_runs_by_name_and_total_model_rows_apart_from_ops(tmp_path):
    measured, emulated = tmp_path / "results", tmp_path / "emulated"
    (measured / "block_mlp_w4").mkdir(parents=True)
    emulated.mkdir()
    runs = {
        "block_w4.json": (model_run({"inductor": 100.0, "overlap": 80.0}), model_run({"inductor": 102.0, "overlap": 88.0})),
        "ops_ag_w4.json": (ops_run({"mm": 50.0, "overlap": 60.0}), ops_run({"mm": 50.0, "overlap": 90.0})),
    }
    for name, (m, e) in runs.items():
        (measured / "block_mlp_w4" / name).write_text(json.dumps(m))
        (emulated / name).write_text(json.dumps(e))
    (emulated / "never_measured.json").write_text(json.dumps(model_run({"inductor": 1.0})))
    assert [name for name, _, _ in compare.run_pairs(str(measured), str(emulated))] == ["block_w4", "ops_ag_w4"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.emulated.compare", str(measured), str(emulated)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "model rows: |error| median 6.0%, largest 10.0% over 2 timings; ranked as measured in 1 of 1 rows" in out
    assert "ops: |error| median 25.0%, largest 50.0% over 2 timings; ranked as measured in 1 of 1 rows" in out
    assert "never_measured" not in out
