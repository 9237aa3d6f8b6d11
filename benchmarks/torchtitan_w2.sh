#!/usr/bin/env bash
# docs/benchmarks.md, "torchtitan's Llama 3 8B layers, W=2": two layers of torchtitan's block and
# TP/SP plan (benchmarks/titan_llama3.py) under plain Inductor, torchtitan's async TP, its dist_gemm
# backend and overlap, batch 1 and 4 of 8192-token sequences (--batches 2,8 for more). Measured
# on 2×H200 (NVLink); under 10 minutes. Results: $OUT/titan_8b_b14_w2.json.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 2 -m benchmarks.bench_torchtitan --sizes llama3-8b --batches 1,4 --out "$OUT/titan_8b_b14_w2.json"
