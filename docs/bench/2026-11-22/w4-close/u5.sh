export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 240 python3 -m pytest -q tests/gpu/test_alternating_kinds_gpu.py tests/gpu/test_consumer_gpu.py tests/gpu/test_ops_nccl.py --durations=4 > $OUT/other_tests.log 2>&1; echo "other tests rc=$? at ${SECONDS}s"; tail -8 $OUT/other_tests.log
timeout 200 python3 -m tools.demo > $OUT/demo.log 2>&1; echo "demo rc=$? at ${SECONDS}s"; tail -25 $OUT/demo.log | cut -c1-250
