#!/usr/bin/env bash
# One H100 call: the Gluon float8 consumer with several weights a launch (tests, then the GEMM
# alone against cuBLAS per weight, as CUDA graph replays and eager).
set -uo pipefail
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache OVERLAP_PASS_SPIN_LIMIT=2000000
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python3 -m pytest -q tests/gpu/test_consumer_pingpong_gpu.py > "$OUT/pingpong_tests.log" 2>&1
echo "== pingpong tests (rc $?)"; tail -n 3 "$OUT/pingpong_tests.log"
for mode in ${MODES:-"--split --graphs" "--graphs" "--split"}; do
    name=gemm_fp8r_ag$(echo "$mode" | tr -d ' -')
    timeout 150 python3 -m tools.bench_gemm --float8 rowwise --op all_gather_matmul --rounds 10 $mode --out "$OUT/$name.json" > "$OUT/$name.out.txt" 2>&1
    echo "== bench_gemm $mode (rc $?)"; tail -n 8 "$OUT/$name.out.txt"
done
