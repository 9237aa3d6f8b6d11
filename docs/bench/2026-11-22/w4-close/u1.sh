export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OVERLAP_PASS_SPIN_LIMIT=20000000
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG"; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 280 python3 -m pytest -q -x tests/gpu/test_all_gather_matmul_gpu.py -k "W4 or choice_cache" --durations=5 > $OUT/ag_tests.log 2>&1; echo "ag tests rc=$? at ${SECONDS}s"; tail -12 $OUT/ag_tests.log
timeout 260 python3 -m pytest -q -x tests/gpu/test_matmul_reduce_scatter_gpu.py -k W4 --durations=5 > $OUT/rs_tests.log 2>&1; echo "rs tests rc=$? at ${SECONDS}s"; tail -10 $OUT/rs_tests.log
