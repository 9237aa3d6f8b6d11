export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m tools.demo --warmup 10 --iters 30 > $OUT/demo_long.log 2>&1; echo "demo long rc=$? at ${SECONDS}s"; tail -3 $OUT/demo_long.log
timeout 150 python3 -m tools.demo > $OUT/demo.log 2>&1; echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo.log
