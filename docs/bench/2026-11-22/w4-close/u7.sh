export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l)
timeout 150 torchrun --nproc-per-node $NG .scratch/demo_modes.py 32 > $OUT/modes32.log 2>&1; echo "rc=$? at ${SECONDS}s"; grep -E "^\(|kv_heads" $OUT/modes32.log
timeout 150 torchrun --nproc-per-node $NG .scratch/demo_modes.py 8 > $OUT/modes8.log 2>&1; echo "rc=$? at ${SECONDS}s"; grep -E "^\(|kv_heads" $OUT/modes8.log
