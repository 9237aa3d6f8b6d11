#!/usr/bin/env bash
# docs/benchmarks.md, "W=8": the rows the W=2 and W=4 tables have, at TP 8. The SP block and MLP
# at Llama 3 8B and 70B sizes; plain TP 8B and 70B; the 8B block with torchao's Float8 linears
# (needs torchao), rowwise and tensorwise; torchtitan's 8B and 70B layers, batch 1 and 4; the
# whole torchtitan step at TP 8 and at FSDP2 2 x TP 4. On 8 GPUs of one host it measures; on one
# GPU, EMULATE=1 runs each as rank 0 of an emulated world of 8 (benchmarks/emulated: every number
# "emulated"). Results: $OUT/*_w8.json.
source "$(dirname "$0")/_common.sh"
compilers=inductor,inductor_micro_pipeline_tp,overlap,no_communication
model="torchrun --nproc-per-node 8 -m benchmarks.bench_model"
$model --model block --compilers $compilers --out "$OUT/block_w8.json"
$model --model mlp --compilers $compilers --out "$OUT/mlp_w8.json"
$model --layout plain --batch 1 --compilers $compilers --out "$OUT/plain_b1_w8.json"
for recipe in rowwise tensorwise; do
    $model --float8 $recipe --settle 2 --sizes llama3-8b --compilers inductor,overlap_nccl_all_reduces,overlap \
        --rounds 3 --calls 10 --out "$OUT/float8_${recipe}_8b_w8.json"
done
torchrun --nproc-per-node 8 -m benchmarks.bench_torchtitan --batches 1,4 --out "$OUT/titan_b14_w8.json"
torchrun --nproc-per-node 8 -m benchmarks.bench_step --tp 8 --out "$OUT/step_tp8_w8.json"
torchrun --nproc-per-node 8 -m benchmarks.bench_step --tp 4 --out "$OUT/step_dp2_tp4_w8.json"
