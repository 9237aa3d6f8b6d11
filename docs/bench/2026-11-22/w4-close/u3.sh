export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG"
timeout 300 torchrun --nproc-per-node $NG -m tools.bench_ops --op all_gather_matmul --extra-ms --graph --rounds 5 --png $OUT/ops_ag_w$NG.png --out $OUT/ops_ag_w$NG.json > $OUT/ops_ag.log 2>&1; echo "ag bench rc=$? at ${SECONDS}s"
timeout 270 torchrun --nproc-per-node $NG -m tools.bench_ops --op matmul_reduce_scatter --extra-ms --graph --rounds 5 --png $OUT/ops_rs_w$NG.png --out $OUT/ops_rs_w$NG.json > $OUT/ops_rs.log 2>&1; echo "rs bench rc=$? at ${SECONDS}s"
grep -E "^[a-z0-9_ +]+: overlap" $OUT/ops_ag.log $OUT/ops_rs.log | cut -c1-200
