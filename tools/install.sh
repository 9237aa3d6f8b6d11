#!/usr/bin/env bash
# Installs overlap (editable) without pulling CUDA wheels onto a CPU machine.
#
#   bash tools/install.sh          # the package
#   bash tools/install.sh --test   # and the test dependencies, torchtitan among them
#
# torch: kept as it is where one is installed (the GPU machines have theirs); otherwise the CPU
# build, torch==2.13.0+cpu. With --test also triton, for its CPU interpreter, where it is missing,
# torchtitan 0.3.0 (the extra "torchtitan"), whose Llama 3 a test compiles, and Hugging Face
# transformers (the extra "hf"), whose Llama and its tp_plan a test compiles (both Python 3.11+), and
# torchao (the extra "float8"), whose Float8 linears the float8 tests compile, and NeMo
# Automodel's linear (below).
# If pip cannot find the CPU build of torch, point it at PyTorch's CPU wheels:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash tools/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0+cpu"
fi
extras=""
if [ "${1:-}" = "--test" ]; then
  extras="test,float8"
  # torchtitan 0.3.0 and transformers 5.23 need Python 3.11+; their tests skip without them
  if "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
    extras="$extras,hf,torchtitan"
  fi
  extras="[$extras]"
  # The CPU tests run the Triton kernels in its interpreter; 3.6.0 is what the GPU machines
  # have. A triton that came with torch is kept.
  "$PYTHON" -c "import triton" 2>/dev/null || "$PYTHON" -m pip install --quiet "triton==3.6.0"
fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
if [ "${1:-}" = "--test" ] && "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
  # NeMo Automodel's tensor-parallel linear, whose bmm form a test compiles. Without its
  # dependencies: they pin another transformers and bring GPU kernel packages; the linear and
  # its parallel styles need only torch and packaging.
  "$PYTHON" -m pip install --quiet --no-deps "nemo-automodel==0.7.0"
fi
# torch warns at import where numpy is missing ("Failed to initialize NumPy"); overlap needs none
"$PYTHON" -W "ignore:Failed to initialize NumPy" -c "import torch, overlap_pass; print('overlap installed; torch', torch.__version__)"
