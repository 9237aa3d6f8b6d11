export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG"
timeout 100 torchrun --nproc-per-node $NG -m tools.bench_ops --op matmul_reduce_scatter --extra-ms --only "70b down" --graph --rounds 15 --out $OUT/ops_rs_70bdown_w$NG.json > $OUT/ops_rs2.log 2>&1; echo "rs bench rc=$? at ${SECONDS}s"
timeout 100 torchrun --nproc-per-node $NG -m tools.bench_ops --op all_gather_matmul --extra-ms --only "8b up+gate" --graph --rounds 15 --out $OUT/ops_ag_8bup_w$NG.json > $OUT/ops_ag2.log 2>&1; echo "ag bench rc=$? at ${SECONDS}s"
timeout 200 torchrun --nproc-per-node $NG -m tools.bench_model --model block --compilers inductor,inductor_micro_pipeline_tp,overlap,no_communication --out $OUT/block_w$NG.json > $OUT/block.log 2>&1; echo "block rc=$? at ${SECONDS}s"
timeout 110 torchrun --nproc-per-node $NG -m tools.bench_model --model mlp --compilers inductor,inductor_micro_pipeline_tp,overlap,no_communication --out $OUT/mlp_w$NG.json > $OUT/mlp.log 2>&1; echo "mlp rc=$? at ${SECONDS}s"
grep -E "^\| llama" $OUT/ops_rs2.log $OUT/ops_ag2.log | cut -c1-300
grep -E "^\|" $OUT/block.log $OUT/mlp.log | cut -c1-300
