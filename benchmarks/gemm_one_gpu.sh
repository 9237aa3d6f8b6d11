#!/usr/bin/env bash
# docs/benchmarks.md, "The fused GEMMs alone": the fused kernels' GEMM with every chunk already
# there (no communication), chunked as at W=2, against cuBLAS on the same operands, as CUDA graph
# replays. Measured on one H100 (the Gluon kernels need Hopper); under 5 minutes each.
# Results: results/gemm_one_gpu/.
source "$(dirname "$0")/_common.sh"
gemm="python3 -m benchmarks.bench_gemm --graphs --rounds 10"
$gemm --split --out "$OUT/bf16_split_graphs.json"
$gemm --float8 rowwise --op all_gather_matmul --split --out "$OUT/fp8_rowwise_ag_split_graphs.json"
$gemm --float8 rowwise --op matmul_reduce_scatter --out "$OUT/fp8_rowwise_rs_graphs.json"
$gemm --float8 tensorwise --split --out "$OUT/fp8_tensorwise_split_graphs.json"
$gemm --float8 tensorwise --op matmul_reduce_scatter --out "$OUT/fp8_tensorwise_rs_graphs.json"
$gemm --float8 rowwise --sums --out "$OUT/fp8_rowwise_sums_graphs.json"
$gemm --float8 tensorwise --sums --out "$OUT/fp8_tensorwise_sums_graphs.json"
