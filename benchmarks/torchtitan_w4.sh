#!/usr/bin/env bash
# docs/benchmarks.md, "torchtitan's Llama 3 8B layers, W=4": batch 1 and 4 on 4 GPUs; about 3
# minutes on 4×H200. Results: $OUT/titan_8b_b14_w4.json.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 4 -m benchmarks.bench_torchtitan --sizes llama3-8b --batches 1,4 --out "$OUT/titan_8b_b14_w4.json"
