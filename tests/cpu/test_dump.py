"""The dump format (expecttest), the summary tool, and the places dumps and logs go."""

import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import expecttest
import torch
import torch.distributed._functional_collectives as funcol

from tools import inspect_dump

from .fake_world import compile_and_dump, fake_world


def gather_then_scatter_with_a_side_use(x, w1, w2, group):
    """all_gather -> mm is rewritten; mm -> reduce_scatter is not: its result is used twice."""
    hidden = funcol.all_gather_tensor(x, 0, group) @ w1
    out = hidden @ w2
    return funcol.reduce_scatter_tensor(out, "sum", 0, group), out.amax()


class DumpFormatTest(expecttest.TestCase):
    def test_decisions_and_summary(self):
        with tempfile.TemporaryDirectory() as tmp, fake_world(2) as group:
            args = (torch.randn(2, 4), torch.randn(4, 6), torch.randn(6, 4), group)
            compile_and_dump(gather_then_scatter_with_a_side_use, args, pathlib.Path(tmp))
            (path,) = glob.glob(os.path.join(tmp, "dump0", "rank0", "*", "decisions.json"))
            with open(path) as f:
                text = f.read()
            rows = [("<graph>", *row[1:]) for row in inspect_dump.rows(os.path.dirname(path))]
        self.assertEqual(json.loads(text)["graph"], os.path.basename(os.path.dirname(path)))
        self.assertExpectedInline(
            text.replace(json.loads(text)["graph"], "<graph>"),
            """\
{
  "graph": "<graph>",
  "rank": 0,
  "candidates": [
    {
      "kind": "all_gather_matmul",
      "collective": {
        "name": "all_gather_into_tensor",
        "op": "_c10d_functional::all_gather_into_tensor",
        "shape": [4, 4],
        "dtype": "float32"
      },
      "group": {
        "name": "0",
        "size": 2,
        "ranks": [0, 1]
      },
      "dim": 0,
      "nodes": {
        "shard": {
          "name": "arg0_1",
          "op": "placeholder",
          "shape": [2, 4],
          "dtype": "float32"
        },
        "gathered": {
          "name": "wait_tensor",
          "op": "_c10d_functional::wait_tensor",
          "shape": [4, 4],
          "dtype": "float32"
        },
        "matmuls": [
          {
            "mm": {
              "name": "mm",
              "op": "aten::mm",
              "shape": [4, 6],
              "dtype": "float32"
            },
            "mat2": {
              "name": "arg1_1",
              "op": "placeholder",
              "shape": [4, 6],
              "dtype": "float32"
            },
            "bias": null
          }
        ],
        "contractions": [],
        "other_users": []
      },
      "return_gathered": false,
      "rewritten": true,
      "reason": null,
      "implementation": "reference",
      "op": "all_gather_matmul_default"
    },
    {
      "kind": "matmul_reduce_scatter",
      "collective": {
        "name": "reduce_scatter_tensor",
        "op": "_c10d_functional::reduce_scatter_tensor",
        "shape": [2, 4],
        "dtype": "float32"
      },
      "group": {
        "name": "0",
        "size": 2,
        "ranks": [0, 1]
      },
      "rewritten": false,
      "reason": "matmul result has other users",
      "implementation": null
    }
  ]
}
""",
        )
        self.assertExpectedInline(inspect_dump.format_table(rows), """\
graph    kind                   collective              dim  shapes      rewritten  impl       reason
-------  ---------------------  ----------------------  ---  ----------  ---------  ---------  -----------------------------
<graph>  all_gather_matmul      all_gather_into_tensor  0    2x4 -> 4x6  yes        reference
<graph>  matmul_reduce_scatter  reduce_scatter_tensor        2x4         no                    matmul result has other users""")


def test_torch_compile_debug_logs_and_trace(tmp_path):
    """TORCH_COMPILE_DEBUG=1 dumps into Inductor's debug folder, TORCH_LOGS=+overlap_pass logs
    each decision, TORCH_TRACE gets tlparse artifacts."""
    script = textwrap.dedent(
        """
        import torch
        import torch.distributed._functional_collectives as funcol
        from tests.cpu.fake_world import fake_world

        def fn(x, w):
            return funcol.all_gather_tensor(x, 0, "0") @ w

        with fake_world(2, kernels=True):  # (the debug folder is Inductor's inner compile's)
            torch.compile(fn, backend="overlap")(torch.randn(2, 4), torch.randn(4, 3))
        """
    )
    env = dict(
        os.environ,
        TORCH_COMPILE_DEBUG="1",
        TORCH_COMPILE_DEBUG_DIR=str(tmp_path / "debug"),
        TORCH_LOGS="+overlap_pass",
        TORCH_TRACE=str(tmp_path / "trace"),
        PYTHONPATH=os.getcwd(),
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all_gather_matmul at all_gather_into_tensor: rewritten" in result.stderr
    dumps = glob.glob(str(tmp_path / "debug" / "**" / "overlap_pass" / "decisions.json"), recursive=True)
    assert dumps, "no dump in Inductor's debug folder"
    traces = "".join(open(p).read() for p in glob.glob(str(tmp_path / "trace" / "*")))
    assert "overlap_pass_decisions" in traces and "overlap_pass_after" in traces


def test_inspect_dump_command(tmp_path):
    with fake_world(2) as group:
        args = (torch.randn(2, 4), torch.randn(4, 6), torch.randn(6, 4), group)
        compile_and_dump(gather_then_scatter_with_a_side_use, args, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "tools.inspect_dump", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "1 of 2 candidates rewritten" in result.stdout
    assert "matmul result has other users" in result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "tools.inspect_dump", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120,
    )
    assert missing.returncode == 1 and "no decisions.json" in missing.stderr


def test_inspect_dump_of_graphs_without_collectives(tmp_path):
    compile_and_dump(lambda x: x.sin() @ x, (torch.randn(4, 4),), tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "tools.inspect_dump", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "1 graph under" in result.stdout and "none with an all-gather or reduce-scatter" in result.stdout
