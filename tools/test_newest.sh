#!/usr/bin/env bash
# The CPU tests on the newest torch and triton, in a virtual environment of their own.
#
#   bash tools/test_newest.sh                 # the whole CPU suite
#   bash tools/test_newest.sh -k torchtitan   # arguments go to pytest
#   bash tools/test_newest.sh tests/cpu/test_kernel_ir.py   # only these tests
#   bash tools/test_newest.sh --prepare       # only make the venv: torch, triton, test dependencies
#
# The environment lives outside the checkout (OVERLAP_NEWEST_VENV, default
# ~/.cache/overlap/venv-torch<version>) and is reused by later runs. It takes torch's default
# wheel from the package index, which brings CUDA libraries (about 5 GB) and runs on the CPU:
# that is why it never touches the interpreter tools/install.sh installs into.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${OVERLAP_NEWEST_TORCH:-2.15.0}
TRITON=${OVERLAP_NEWEST_TRITON:-3.9.0}
BASE_PYTHON=${PYTHON:-python3}
VENV=${OVERLAP_NEWEST_VENV:-$HOME/.cache/overlap/venv-torch$TORCH}

if [ ! -x "$VENV/bin/python" ]; then
  "$BASE_PYTHON" -m venv "$VENV"
fi
# A pip-wide constraint file (some machines cap torch below the newest release) must not hold
# this environment back: it exists to run the newest.
if ! "$VENV/bin/python" -c "import torch, triton, sys
sys.exit(torch.__version__.split('+')[0] != '$TORCH' or triton.__version__ != '$TRITON')" 2>/dev/null; then
  PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install --quiet "torch==$TORCH" "triton==$TRITON"
fi
if [ "${1:-}" = "--prepare" ]; then
  # and what tools/install.sh --test adds, read from setup.py, without building the checkout
  # (an install of the checkout running beside this one would write the same egg-info)
  requirements=$("$VENV/bin/python" - <<'EOF'
import ast, sys
setup = next(n for n in ast.walk(ast.parse(open("setup.py").read())) if getattr(getattr(n, "func", None), "id", "") == "setup")
args = {k.arg: ast.literal_eval(k.value) for k in setup.keywords if k.arg in ("install_requires", "extras_require")}
extras = args["extras_require"]
names = ("test", "float8") + (("hf", "torchtitan") if sys.version_info >= (3, 11) else ())  # as install.sh
print("\n".join(args["install_requires"] + [r for name in names for r in extras[name]]))
EOF
  )
  # shellcheck disable=SC2086
  PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install --quiet $requirements
  if "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
    PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install --quiet --no-deps "nemo-automodel==0.7.0"
  fi
  exit 0
fi
PIP_CONSTRAINT=/dev/null PYTHON="$VENV/bin/python" bash tools/install.sh --test
# test files or folders named among the arguments are what runs; otherwise tests/cpu
PYTHON="$VENV/bin/python" exec bash tools/test_cpu.sh "$@"
