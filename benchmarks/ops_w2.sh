#!/usr/bin/env bash
# docs/benchmarks.md, "The ops, W=2": both ops on 9 shapes (M = 8192), eager and replayed from
# CUDA graphs, against mm alone, NCCL + cuBLAS and PyTorch's async TP. Measured on 2×H200
# (NVLink); about 6 minutes. Results: results/ops_w2/.
source "$(dirname "$0")/_common.sh"
ops="torchrun --nproc-per-node 2 -m benchmarks.bench_ops --graph --rounds 5"
$ops --op all_gather_matmul --out "$OUT/ops_ag_w2.json"
$ops --op matmul_reduce_scatter --out "$OUT/ops_rs_w2.json"
