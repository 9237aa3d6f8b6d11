#!/usr/bin/env bash
# The no-communication floor at W=2 on one H200 (tools.bench_model --fake-world 2: rank 0 of a
# fake process group, W=2's shapes and none of its traffic): how far issue 22's plain-TP block
# can get at all, and the float8 block's host time against its GPU time. One device call on
# nvidia-h200, from the repository root: bash docs/bench/2026-11-25-s18/floor_h200.sh
set -uo pipefail
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.triton_cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-deps .whl/torchao-*.whl >/dev/null 2>&1
floor() {  # name, then bench_model's arguments
    local name=$1; shift
    timeout 170 python3 -m tools.bench_model --fake-world 2 --out "$OUT/$name.json" "$@" > "$OUT/$name.out.txt" 2>&1
    echo "== $name (rc $?)"; grep -A1 '^llama' "$OUT/$name.out.txt" | head -4
}
floor plain_8b_b1 --layout plain --sizes llama3-8b
floor sp_8b_b1 --sizes llama3-8b
floor plain_8b_b4 --layout plain --batch 4 --sizes llama3-8b
floor fp8r_sp_8b_b1 --float8 rowwise --sizes llama3-8b
floor plain_70b_b1 --layout plain --sizes llama3-70b
