#!/usr/bin/env bash
# Session 18 on one Hopper GPU: the Gluon producer's exact accumulation and sums. Checks, then
# timings (graph replays, against cuBLAS). From the repository root:
#   bash docs/bench/2026-11-25-s18/gpu_round.sh [tests|sim|bench]
set -uo pipefail
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache OVERLAP_PASS_SPIN_LIMIT=2000000
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (rc $?)"; tail -n 4 "$OUT/$name.log"
}
case "${1:-tests}" in
tests)
    step kernels 240 python3 -m pytest -q tests/gpu/test_producer_pingpong_gpu.py tests/gpu/test_consumer_pingpong_gpu.py
    step sim_w2 240 python3 -m pytest -q tests/gpu/test_sim_world_gpu.py -k "scaled_reduce_scatter and W2"
    ;;
sim)
    step sim_w34 280 python3 -m pytest -q tests/gpu/test_sim_world_gpu.py -k "scaled_reduce_scatter and (W3 or W4)"
    step sim_replay 200 python3 -m pytest -q tests/gpu/test_sim_world_gpu.py -k "replay or all_gather_scaled"
    ;;
bench)
    step sums_rowwise 150 python3 -m tools.bench_gemm --float8 rowwise --sums --graphs --rounds 10 --out "$OUT/sums_rowwise.json"
    step sums_tensorwise 150 python3 -m tools.bench_gemm --float8 tensorwise --sums --graphs --rounds 10 --out "$OUT/sums_tensorwise.json"
    step rs_rowwise 200 python3 -m tools.bench_gemm --float8 rowwise --op matmul_reduce_scatter --graphs --rounds 10 --out "$OUT/rs_rowwise.json"
    for f in sums_rowwise sums_tensorwise rs_rowwise; do echo "== $f"; grep '^|' "$OUT/$f.log"; done
    ;;
bench2)  # after bench_gemm's exact baseline became scaled_mm_rows (torchao's form)
    step rowwise_split 300 python3 -m tools.bench_gemm --float8 rowwise --split --graphs --rounds 10 --out "$OUT/rowwise_split.json"
    step sums_rowwise2 120 python3 -m tools.bench_gemm --float8 rowwise --sums --graphs --rounds 10 --out "$OUT/sums_rowwise2.json"
    step rs_tensorwise 120 python3 -m tools.bench_gemm --float8 tensorwise --op matmul_reduce_scatter --graphs --rounds 10 --out "$OUT/rs_tensorwise.json"
    for f in rowwise_split sums_rowwise2 rs_tensorwise; do echo "== $f"; grep '^|' "$OUT/$f.log"; done
    ;;
esac
