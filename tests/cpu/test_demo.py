"""The README's first command runs the demo: on a CPU machine, two gloo ranks. Run here as a user
runs it (its own processes), smaller and with one timed round, so that CI keeps it working."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_demo_rewrites_every_pair_and_matches_eager_on_cpu():
    run = subprocess.run(
        [
            sys.executable, "-m", "tools.demo", "--device", "cpu", "--world-size", "2",
            "--dim", "64", "--hidden", "128", "--warmup", "0", "--rounds", "1", "--calls", "1",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("model__")]
    # forward: 2 all-gathers + 2 reduce-scatters; backward: as many again
    assert len(rows) == 8 and all(" yes " in row for row in rows), run.stdout
    verdicts = [line.split()[-1] for line in run.stdout.splitlines() if line.strip().startswith(("output", "input grad", "weight grads"))]
    assert verdicts == ["ok", "ok", "ok"], run.stdout
    assert "backend=\"overlap\"" in run.stdout
