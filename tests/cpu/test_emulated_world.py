"""The emulated world's process group on the CPU, in a process of its own
(tests/cpu/emulated_pg_run.py): what every collective leaves at W = 2, 4, 8 through the classic
API, the functional ops, DTensor and a compiled function."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_emulated_process_group_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.cpu.emulated_pg_run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for world in (2, 4, 8):
        assert f"W={world}: " in run.stdout
