#!/usr/bin/env bash
# docs/benchmarks.md, "The TP/SP block and MLP, W=4": the compiled block and MLP at Llama 3 8B and
# 70B sizes under plain Inductor, _micro_pipeline_tp, overlap and the no-communication floor.
# Measured on 4×H200, NVLink; about 5 minutes. Results:
# results/block_mlp_w4/.
source "$(dirname "$0")/_common.sh"
compilers=inductor,inductor_micro_pipeline_tp,overlap,no_communication
torchrun --nproc-per-node 4 -m benchmarks.bench_model --model block --compilers $compilers --out "$OUT/block_w4.json"
torchrun --nproc-per-node 4 -m benchmarks.bench_model --model mlp --compilers $compilers --out "$OUT/mlp_w4.json"
