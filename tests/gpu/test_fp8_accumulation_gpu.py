"""use_fast_accum in the Triton float8 kernels (gemm.tma_mainloop's FP8_EXACT), consumer and
producer, fp32 out, K deep enough for Hopper's fp8 tensor-core accumulation to show: against
fp64 of the same float8 values, exact accumulation must be several times closer than fast, and
as close as cuBLAS's exact _scaled_mm. (An H100 in session 11: fast 2.0e-3, exact 7.4e-5,
cuBLAS exact 1.3e-4, at K = 8192.) Skipped without a GPU."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

M, K, N = 512, 8192, 384


def _consumer(a, w, one, fast):
    out = torch.full((M, N), float("nan"), device="cuda")
    flags = torch.ones(2, dtype=torch.int32, device="cuda")
    consumer.all_gather_matmul_consumer(
        a, [w], [None], [out], flags, torch.ones(1, dtype=torch.int32, device="cuda"), rank=0, world_size=2,
        inner=M // 2, config=gemm.FLOAT8_CONFIGS[0], spin_limit=1 << 20,
        scales=consumer.Scales(one, None, (one,), fast),
    )  # fmt: skip
    return out


def _producer(a, w, one, fast):
    dests = [torch.full((M, N), float("nan"), device="cuda") for _ in range(2)]
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    producer.matmul_reduce_scatter_producer(
        a, w, None, torch.tensor([d.data_ptr() for d in dests], device="cuda"),
        torch.tensor([flags[0].data_ptr(), flags[1].data_ptr()], device="cuda"),
        torch.zeros(2, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"),
        rank=0, world_size=2, config=gemm.FLOAT8_CONFIGS[0], scales=(one, one), out_dtype=torch.float32,
        fast_accum=fast,
    )  # fmt: skip
    return torch.cat([dests[0][: M // 2], dests[1][: M // 2]])  # chunk j's rows went to rank j


@pytest.mark.parametrize("kernel", [_consumer, _producer], ids=["consumer", "producer"])
def test_exact_accumulation_when_asked(kernel):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(N, K, generator=gen, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones(1, device="cuda")
    ref = a.double() @ w.double()

    def error(x):
        return ((x.double() - ref).norm() / ref.norm()).item()

    fast, exact = error(kernel(a, w, one, True)), error(kernel(a, w, one, False))
    cublas_exact = error(torch._scaled_mm(a, w, one[0], one[0], out_dtype=torch.float32, use_fast_accum=False))
    assert exact * 4 < fast, (exact, fast)
    assert exact < 2 * cublas_exact, (exact, cublas_exact)
