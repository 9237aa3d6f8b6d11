# Sourced by the benchmark scripts: the settings every table in docs/benchmarks.md was measured
# with, and where the results go. Run the scripts from the repository root.
set -euo pipefail
# NVLink multicast (NVLS) and symmetric memory's multicast stay off: the tables were measured so
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a lost peer fails a run within seconds instead of the default ten minutes
export OVERLAP_PASS_SPIN_LIMIT=${OVERLAP_PASS_SPIN_LIMIT:-20000000}
# a fresh choice cache per run, as measured: no per-shape choice carried over from another machine
export OVERLAP_PASS_CHOICE_CACHE=${OVERLAP_PASS_CHOICE_CACHE:-$(mktemp -d)/choices.json}
OUT=${OUT:-/tmp/overlap-benchmarks}
mkdir -p "$OUT"
echo "results in $OUT"
