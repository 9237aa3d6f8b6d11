#!/usr/bin/env bash
# docs/benchmarks.md, "Plain TP (no sequence parallel), W=4": the Llama 3 8B and 70B plain-TP
# blocks, batch 1, on 4 GPUs; about 2 minutes on 4×H200. Results: $OUT/plain_b1_w4.json.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 4 -m benchmarks.bench_model --layout plain --batch 1 \
    --compilers inductor,inductor_micro_pipeline_tp,overlap,no_communication --out "$OUT/plain_b1_w4.json"
