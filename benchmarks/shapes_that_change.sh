#!/usr/bin/env bash
# docs/rewrites.md, "Shapes that change": random token counts, every call checked against eager
# (W=2: GPUs 0 and 1), and Hugging Face's Llama prefill at changing prompt lengths (W=4).
# Measured on 2×H200, 2×H100 and 4×H200; under 10 minutes each. Results: printed (random_lengths), and
# $OUT/prefill_w4.json (bench_prefill).
source "$(dirname "$0")/_common.sh"
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m benchmarks.random_lengths --size small --calls 1000 --no-inductor
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m benchmarks.random_lengths --calls 60 --repeat 2
torchrun --nproc-per-node 4 -m benchmarks.bench_prefill --lengths 1001,2048,4095,8192 --decode-batch 8 --rounds 6 --out "$OUT/prefill_w4.json"
