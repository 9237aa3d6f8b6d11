#!/usr/bin/env bash
# docs/benchmarks.md, "The ops, W=4": both ops on 27 shapes (Llama 3 8B and 70B projections and a
# wide one, at M = 2048, 8192 and 16384) against mm alone, NCCL + cuBLAS, PyTorch's async TP and
# every overlap variant, eager and replayed from CUDA graphs; then the four rows where overlap
# trailed async TP, over 15 rounds. Measured on 4×H200 (NVLink); about 12 minutes.
# Results: results/ops_w4/ (python3 -m benchmarks.bench_ops --render FILE prints a table again).
source "$(dirname "$0")/_common.sh"
ops="torchrun --nproc-per-node 4 -m benchmarks.bench_ops --extra-ms --graph"
$ops --op all_gather_matmul --rounds 5 --out "$OUT/ops_ag_w4.json" --png "$OUT/ops_ag_w4.png"
$ops --op matmul_reduce_scatter --rounds 5 --out "$OUT/ops_rs_w4.json" --png "$OUT/ops_rs_w4.png"
$ops --op matmul_reduce_scatter --only "70b down" --rounds 15 --out "$OUT/ops_rs_70bdown_w4.json"
$ops --op all_gather_matmul --only "8b up+gate" --rounds 15 --out "$OUT/ops_ag_8bup_w4.json"
