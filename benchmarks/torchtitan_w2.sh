#!/usr/bin/env bash
# docs/benchmarks.md, "torchtitan's Llama 3 8B layers, W=2": two layers of torchtitan's block and
# TP/SP plan (tools/titan_llama3.py) under plain Inductor, torchtitan's async TP, its dist_gemm
# backend and overlap, batch 1 to 8 of 8192-token sequences. Measured on 2×H200 (NVLink); three
# runs of under 10 minutes each. Results: results/torchtitan_w2/.
source "$(dirname "$0")/_common.sh"
run="torchrun --nproc-per-node 2 -m tools.bench_torchtitan --sizes llama3-8b"
$run --batches 1,2 --out "$OUT/titan_8b_b12_w2.json"
$run --batches 4 --out "$OUT/titan_8b_b4_w2.json"
$run --batches 8 --calls 5 --out "$OUT/titan_8b_b8_w2.json"
python3 -m tools.bench_torchtitan --render "$OUT/titan_8b_b12_w2.json,$OUT/titan_8b_b4_w2.json,$OUT/titan_8b_b8_w2.json" \
    --png "$OUT/titan_8b_w2.png"
