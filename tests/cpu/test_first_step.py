"""benchmarks/first_step.py on gloo ranks: a job of 2 processes per compiler reaches its steady
step, and the row carries the times from the spawn and rank 0's compiles."""

import json

from benchmarks import first_step


def test_a_job_per_compiler_reaches_its_steady_step(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_PASS_FUSED_FROM_CALL", "2")  # (fewer steps: the tool runs fused_from_call + 1)
    out = tmp_path / "rows.json"
    assert first_step.main(["--layouts", "sp", "--shapes", "static", "--cold-only", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["compiler"] for row in rows] == ["inductor", "overlap"]
    for row in rows:
        assert "failed" not in row, row
        assert row["steps"] == 3
        assert 0 < row["startup s"] < row["to first step s"] <= row["to steady s"]
        assert row["first step s"] <= row["to first step s"]
        assert row["graphs"] >= 2 and row["fx"]["hit"] == 0  # forward and backward, from empty caches
