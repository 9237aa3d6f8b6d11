#!/usr/bin/env bash
# docs/benchmarks.md, "The floor at any world size, on one GPU": the models with every collective
# replaced by a local op of its shape (benchmarks/no_comm.py), timed at world size W on one GPU (rank 0
# of a fake process group: W's shapes, none of its traffic). Measured on one H200; under 3 minutes each.
# Results: results/floors_one_gpu/.
source "$(dirname "$0")/_common.sh"
floor="python3 -m benchmarks.bench_model"
$floor --fake-world 2 --model block --sizes llama3-8b --out "$OUT/floor_block8b_fake_w2.json"
for W in 4 8; do
    $floor --fake-world $W --model block --out "$OUT/floor_block_fake_w$W.json"
    $floor --fake-world $W --model mlp --out "$OUT/floor_mlp_fake_w$W.json"
done
$floor --fake-world 2 --layout plain --sizes llama3-8b --out "$OUT/floor_plain_8b_b1_w2.json"
$floor --fake-world 2 --layout plain --batch 4 --sizes llama3-8b --out "$OUT/floor_plain_8b_b4_w2.json"
$floor --fake-world 2 --layout plain --sizes llama3-70b --out "$OUT/floor_plain_70b_b1_w2.json"
$floor --fake-world 2 --float8 rowwise --sizes llama3-8b --out "$OUT/floor_fp8r_sp_8b_b1_w2.json"
