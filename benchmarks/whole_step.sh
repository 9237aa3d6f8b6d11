#!/usr/bin/env bash
# docs/benchmarks.md, "Whole training steps", "Host time of an op call" and "Exposed
# communication". At W=2: torchtitan's Llama 3 (4 layers of 8B width, embedding and output) and
# Hugging Face's Llama with its tp_plan trained under TP alone, the three compilers interleaved in
# one process (timing; where the torchtitan step's GPU time goes); then each compiler alone in a
# process of its own with a fresh choice cache (device memory); the per-call host time of the
# ops; the exposed communication of the 8B block (the whole step, then each pass). At W=4, where the machine has 4 GPUs: the
# torchtitan step under TP alone and FSDP2 x TP (its memory, and the host time of each phase),
# Hugging Face's step, and the 8B block's exposed communication.
# Measured on 2xH200 (W=2) and 4xH200 (W=4; Hugging Face's step on 4xH100); each command under 5 minutes.
source "$(dirname "$0")/_common.sh"
torchrun --nproc-per-node 2 -m benchmarks.bench_step --profile 2 --out "$OUT/step_tp2_w2.json"
torchrun --nproc-per-node 2 -m benchmarks.bench_step --model hf --out "$OUT/step_hf_w2.json"
for compiler in inductor async_tp overlap; do
    OVERLAP_PASS_CHOICE_CACHE=$(mktemp -d)/choices.json torchrun --nproc-per-node 2 -m benchmarks.bench_step \
        --compilers "$compiler" --rounds 0 --out "$OUT/memory_tp2_w2_$compiler.json"
done
for compiler in inductor overlap; do
    OVERLAP_PASS_CHOICE_CACHE=$(mktemp -d)/choices.json torchrun --nproc-per-node 2 -m benchmarks.bench_step \
        --model hf --compilers "$compiler" --rounds 0 --out "$OUT/memory_hf_w2_$compiler.json"
done
torchrun --nproc-per-node 2 -m benchmarks.host_cost --implementation fused --out "$OUT/host_cost_w2.json"
torchrun --nproc-per-node 2 -m benchmarks.exposed_time --whole-step --out "$OUT/exposed_step_block8b_w2.json"
torchrun --nproc-per-node 2 -m benchmarks.exposed_time --per-collective --out "$OUT/exposed_block8b_w2.json"
if [ "${EMULATE:-0}" = 1 ] || [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --tp 4 --out "$OUT/step_tp4_w4.json"
    for compiler in inductor overlap; do
        OVERLAP_PASS_CHOICE_CACHE=$(mktemp -d)/choices.json torchrun --nproc-per-node 4 -m benchmarks.bench_step \
            --tp 4 --compilers "$compiler" --rounds 0 --out "$OUT/memory_tp4_w4_$compiler.json"
    done
    for compiler in inductor overlap; do
        OVERLAP_PASS_CHOICE_CACHE=$(mktemp -d)/choices.json torchrun --nproc-per-node 4 -m benchmarks.bench_step \
            --tp 2 --compilers "$compiler" --rounds 0 --out "$OUT/memory_dp2_tp2_w4_$compiler.json"
    done
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --tp 2 --out "$OUT/step_dp2_tp2_w4.json"
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --tp 2 --rounds 3 --profile 2 --out "$OUT/phases_dp2_tp2_w4.json"
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --model hf --out "$OUT/step_hf_w4.json"
    torchrun --nproc-per-node 4 -m benchmarks.exposed_time --whole-step --out "$OUT/exposed_step_block8b_w4.json"
fi
