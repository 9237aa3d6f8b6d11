export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m tools.demo > $OUT/demo.log 2>&1; echo "demo rc=$? at ${SECONDS}s"; grep -v "^model__\|^---\|^graph" $OUT/demo.log | tail -14
timeout 120 python3 -m tools.demo --batch 2 > $OUT/demo_b2.log 2>&1; echo "demo b2 rc=$? at ${SECONDS}s"; tail -3 $OUT/demo_b2.log
