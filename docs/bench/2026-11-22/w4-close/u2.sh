export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG"
timeout 300 python3 -m pytest -q tests/gpu/test_all_gather_matmul_gpu.py -k "W4 or choice_cache" --durations=4 > $OUT/ag_tests.log 2>&1; echo "ag tests rc=$? at ${SECONDS}s"; tail -8 $OUT/ag_tests.log
timeout 270 python3 -m pytest -q tests/gpu/test_compiled_block_gpu.py -k W4 --durations=4 > $OUT/block_tests.log 2>&1; echo "block tests rc=$? at ${SECONDS}s"; tail -8 $OUT/block_tests.log
