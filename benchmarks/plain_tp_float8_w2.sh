#!/usr/bin/env bash
# docs/benchmarks.md, "Plain TP, W=2" and "Float8, W=2": the Llama 3 8B block without sequence
# parallel (all-reduces split) against plain Inductor, _micro_pipeline_tp and the floor, batch 1
# and batch 4 of 8192-token sequences; the block with torchao's Float8 linears (needs torchao),
# rowwise and tensorwise, under plain Inductor, overlap with every all-reduce NCCL's and overlap
# (overlap_dispatcher: overlap with its ops called through torch's dispatcher). Measured on
# 2×H200 (plain TP) and two GPUs of a 4×H100 host (float8), NVLink; under 5 minutes each.
# Results: results/plain_tp_float8_w2/.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 2 -m benchmarks.bench_model --layout plain --batch 1 --sizes llama3-8b \
    --compilers inductor,inductor_micro_pipeline_tp,overlap_dispatcher,overlap,no_communication --out "$OUT/plain_8b_b1_w2.json"
torchrun --nproc-per-node 2 -m benchmarks.bench_model --layout plain --batch 4 --tokens 32768 --sizes llama3-8b \
    --compilers inductor,overlap_dispatcher,overlap,no_communication --rounds 3 --calls 10 --out "$OUT/plain_8b_b4_w2.json"
for recipe in rowwise tensorwise; do
    torchrun --nproc-per-node 2 -m benchmarks.bench_model --float8 $recipe --settle 2 --sizes llama3-8b \
        --compilers inductor,overlap_nccl_all_reduces,overlap --rounds 3 --calls 10 --out "$OUT/float8_${recipe}_8b_w2.json"
done
