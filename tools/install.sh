#!/usr/bin/env bash
# Installs overlap (editable) without pulling CUDA wheels onto a CPU machine.
#
#   bash tools/install.sh          # the package
#   bash tools/install.sh --test   # and the test dependencies
#
# torch: kept as it is where one is installed (the GPU machines have theirs); otherwise the CPU
# build, torch==2.13.0+cpu. If pip cannot find that build, point it at PyTorch's CPU wheels:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash tools/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0+cpu"
fi
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
"$PYTHON" -c "import torch, overlap_pass; print('overlap installed; torch', torch.__version__)"
