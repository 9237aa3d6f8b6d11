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
# EMULATE=1: each run on this machine's one GPU, rank 0 of an emulated world of the size it names
# (benchmarks/emulated; every number "emulated"), written under the same names for the check
# against the measured runs: EMULATE=1 OUT=DIR bash benchmarks/SCRIPT.sh, then
# python3 -m benchmarks.emulated.compare benchmarks/results DIR
if [[ ${EMULATE:-0} == 1 ]]; then
    torchrun() {
        if [[ $1 != --nproc-per-node ]]; then
            echo "EMULATE=1: torchrun must name --nproc-per-node N first" >&2
            return 2
        fi
        local world=$2
        shift 2
        case "$2" in
            benchmarks.bench_ops | benchmarks.bench_model | benchmarks.bench_step | benchmarks.bench_torchtitan | benchmarks.exposed_time)
                OVERLAP_EMULATE_WORLD=$world python3 "$@" ;;
            *) echo "EMULATE=1: $2 has no emulated world; skipped" ;;
        esac
    }
fi
