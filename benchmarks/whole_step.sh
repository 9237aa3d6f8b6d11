#!/usr/bin/env bash
# docs/benchmarks.md, "Whole training steps" and "Host time of an op call": torchtitan's Llama 3
# (4 layers of 8B width, embedding and output) trained under TP alone and FSDP2 x TP, the three
# compilers interleaved in one process (timing); then each compiler alone in a process of its
# own with a fresh choice cache (device memory); then the per-call host time of the ops.
# Measured on 4xH100 (W=2 on two of its GPUs); each command under 5 minutes.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 4 -m tools.bench_step --tp 4 --out "$OUT/step_tp4_w4.json"
torchrun --nproc-per-node 4 -m tools.bench_step --tp 2 --out "$OUT/step_dp2_tp2_w4.json"
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m tools.bench_step --out "$OUT/step_tp2_w2.json"
for compiler in inductor async_tp overlap; do
    CUDA_VISIBLE_DEVICES=0,1 OVERLAP_PASS_CHOICE_CACHE=$(mktemp -d)/choices.json \
        torchrun --nproc-per-node 2 -m tools.bench_step --compilers "$compiler" --rounds 0 \
        --out "$OUT/memory_tp2_w2_$compiler.json"
done
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 -m tools.host_cost --implementation fused --out "$OUT/host_cost_w2.json"
