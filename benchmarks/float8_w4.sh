#!/usr/bin/env bash
# docs/benchmarks.md, "Float8 (torchao), W=4": the 8B block with torchao's Float8 linears,
# rowwise and tensorwise, under plain Inductor, overlap with every all-reduce NCCL's and overlap,
# side by side in one process (needs torchao). Measured on 4×H200 (NVLink); under 3 minutes
# each. Results: results/float8_w4/.
source "$(dirname "$0")/_common.sh"
for recipe in rowwise tensorwise; do
    torchrun --nproc-per-node 4 -m benchmarks.bench_model --float8 $recipe --settle 2 --sizes llama3-8b \
        --compilers inductor,overlap_nccl_all_reduces,overlap --rounds 3 --calls 10 --out "$OUT/float8_${recipe}_8b_w4.json"
done
