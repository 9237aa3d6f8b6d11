#!/usr/bin/env bash
# docs/benchmarks.md, "The TP/SP block and MLP, W=2": the block and MLP (bf16) with the floor, and
# the fp32 block under autocast. Measured on 2×H200 (NVLink); about 10 minutes.
# Results: results/block_mlp_w2/.
source "$(dirname "$0")/_common.sh"
compilers=inductor,inductor_micro_pipeline_tp,overlap,no_communication
torchrun --nproc-per-node 2 -m benchmarks.bench_model --model block --compilers $compilers --out "$OUT/block_w2_floor.json"
torchrun --nproc-per-node 2 -m benchmarks.bench_model --model mlp --compilers $compilers --out "$OUT/mlp_w2_floor.json"
torchrun --nproc-per-node 2 -m benchmarks.bench_model --model block --autocast --out "$OUT/block_autocast_w2.json"
