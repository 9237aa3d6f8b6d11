export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l)
timeout 150 torchrun --nproc-per-node $NG -m tools.bench_model --model block --sizes llama3-8b --batch 2 --compilers inductor,overlap --profile 10 --out $OUT/b2.json > $OUT/b2.log 2>&1; echo "b2 rc=$? at ${SECONDS}s"
timeout 120 torchrun --nproc-per-node $NG -m tools.bench_model --model block --sizes llama3-8b --batch 1 --compilers inductor,overlap --profile 10 --out $OUT/b1.json > $OUT/b1.log 2>&1; echo "b1 rc=$? at ${SECONDS}s"
for f in b2 b1; do grep -E "^llama|^  host|op calls" $OUT/$f.log | cut -c1-300; grep -A14 "host profile, overlap forward+backward" $OUT/$f.log | cut -c1-160; done
