#!/usr/bin/env bash
# The measurements the open issues wait for, as rounds of one device call each (<= 600 s) on
# nvidia-h200-x2, run from the repository root: bash docs/bench/2026-11-25-s17/x2_rounds.sh A
# Logs and JSON go to $OUT; each round ends with its short tables.
#   A: the float8 ops' NCCL tests (per-call graph replay), then the float8 rowwise 8B block
#      (issue 23: was host-bound, the float8 ops now replay per-call graphs), with a host profile
#   B: bench_ops --float8 rowwise, both ops (issue 23's op tables; the all-gather over the
#      models' separate weights, --split; eager and graph-replayed)
#   C: the plain-TP block's GPU test; plain TP 8B at batch 1 (saved activations ride now)
#   E: plain TP 8B at batch 4 and 70B at batch 1 (issue 22's missing rows)
#   D: bench_ops --float8 tensorwise, both ops (as B)
#   F: the float8 tensorwise 8B block
#   G: bench_ops bf16 all-gather over separate weights (--split), eager and replayed
#   T: (session 18) the GPU tests on real NCCL ranks, all but the one-GPU simulated world: the
#      float8 ops' replays, the compiled blocks, the ops against NCCL (first, if time allows)
# (each item is cut at 280 s: two a round fit a call)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OVERLAP_PASS_SPIN_LIMIT=2000000 TRITON_CACHE_DIR=$PWD/.triton_cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-deps .whl/torchao-*.whl >/dev/null 2>&1
model() {  # name, then bench_model's arguments
    local name=$1; shift
    timeout 280 torchrun --nproc-per-node 2 -m tools.bench_model --out "$OUT/$name.json" "$@" > "$OUT/$name.out.txt" 2>&1
    echo "== $name (rc $?)"; tail -n 12 "$OUT/$name.out.txt"
}
ops() {
    local name=$1; shift
    timeout 280 torchrun --nproc-per-node 2 -m tools.bench_ops --out "$OUT/$name.json" "$@" > "$OUT/$name.out.txt" 2>&1
    echo "== $name (rc $?)"; tail -n 9 "$OUT/$name.out.txt"
}
case "${1:-A}" in
A)
    timeout 240 python3 -m pytest -q tests/gpu/test_scaled_ops_gpu.py tests/gpu/test_all_gather_matmul_gpu.py \
        -k "replay" > "$OUT/gpu_replay.log" 2>&1
    echo "== float8 and bf16 (passengers) per-call graph tests (rc $?)"; tail -n 3 "$OUT/gpu_replay.log"
    model float8_rowwise_8b --float8 rowwise --sizes llama3-8b --profile 200
    ;;
B)
    ops fp8r_ag --op all_gather_matmul --float8 rowwise --split --graph --rounds 10
    ops fp8r_rs --op matmul_reduce_scatter --float8 rowwise --graph --rounds 10
    ;;
C)
    timeout 150 python3 -m pytest -q tests/gpu/test_compiled_block_gpu.py -k plain > "$OUT/gpu_plain_block.log" 2>&1
    echo "== plain-TP block on NCCL, saved activations as passengers (rc $?)"; tail -n 3 "$OUT/gpu_plain_block.log"
    model plain_8b_b1 --layout plain --batch 1 --sizes llama3-8b \
        --compilers inductor,inductor_micro_pipeline_tp,overlap,sp:inductor_micro_pipeline_tp
    ;;
E)
    model plain_8b_b4 --layout plain --batch 4 --sizes llama3-8b \
        --compilers inductor,inductor_micro_pipeline_tp,overlap,sp:inductor_micro_pipeline_tp
    model plain_70b_b1 --layout plain --batch 1 --sizes llama3-70b \
        --compilers inductor,inductor_micro_pipeline_tp,overlap,sp:inductor_micro_pipeline_tp
    ;;
D)
    ops fp8t_ag --op all_gather_matmul --float8 tensorwise --split --graph --rounds 10
    ops fp8t_rs --op matmul_reduce_scatter --float8 tensorwise --graph --rounds 10
    ;;
F)
    model float8_tensorwise_8b --float8 tensorwise --sizes llama3-8b
    ;;
G)
    ops bf16_ag_split --op all_gather_matmul --split --graph --rounds 10
    ;;
T)
    timeout 540 python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_sim_world_gpu.py > "$OUT/gpu_tests_w2.log" 2>&1
    echo "== GPU tests at W=2 (rc $?)"; tail -n 5 "$OUT/gpu_tests_w2.log"
    ;;
esac
