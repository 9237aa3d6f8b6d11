"""use_fast_accum in the float8 kernels (the Triton ones' gemm.tma_mainloop FP8_EXACT; on Hopper
the Gluon ones' cooperative form), consumer and producer, and in the cuBLAS variants' rowwise
_scaled_mm (scaled_ops.scaled_mm_rows), fp32 out (bf16 for that one), K deep enough for Hopper's fp8 tensor-core accumulation to show: against
fp64 of the same float8 values, exact accumulation must be several times closer than fast, and
as close as cuBLAS's exact _scaled_mm. (Measured on an H100: fast 2.0e-3, exact 7.4e-5,
cuBLAS exact 1.3e-4, at K = 8192.) Skipped without a GPU."""

import pytest
import torch

from overlap_pass.ops import scaled_ops
from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import all_gather_matmul_pingpong as consumer_pingpong
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer
from overlap_pass.templates import matmul_reduce_scatter_pingpong as producer_pingpong

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

M, K, N = 512, 8192, 384


def _consumer(a, w, one, fast, gluon=False):
    out = torch.full((M, N), float("nan"), device="cuda")
    flags = torch.ones(2, dtype=torch.int32, device="cuda")
    launch, config = consumer.all_gather_matmul_consumer, gemm.FLOAT8_CONFIGS[0]
    timeouts = {}
    if gluon:
        launch, config = consumer_pingpong.all_gather_matmul_pingpong, consumer_pingpong.CONFIGS[0]
        timeouts = {"timeouts": torch.zeros(2, dtype=torch.int32, device="cuda")}
    launch(
        a, [w], [None], [out], flags, torch.ones(1, dtype=torch.int32, device="cuda"), rank=0, world_size=2,
        inner=M // 2, config=config, spin_limit=1 << 20, scales=consumer.Scales(one, None, (one,), fast),
        **timeouts,
    )  # fmt: skip
    return out


def _producer(a, w, one, fast, gluon=False):
    dests = [torch.full((M, N), float("nan"), device="cuda") for _ in range(2)]
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    launch, config = producer.matmul_reduce_scatter_producer, gemm.FLOAT8_CONFIGS[0]
    if gluon:
        launch, config = producer_pingpong.matmul_reduce_scatter_pingpong, producer_pingpong.CONFIGS[0]
    launch(
        a, w, None, torch.tensor([d.data_ptr() for d in dests], device="cuda"),
        torch.tensor([flags[0].data_ptr(), flags[1].data_ptr()], device="cuda"),
        torch.zeros(2, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"),
        rank=0, world_size=2, config=config, scales=(one, one), out_dtype=torch.float32, fast_accum=fast,
    )  # fmt: skip
    return torch.cat([dests[0][: M // 2], dests[1][: M // 2]])  # chunk j's rows went to rank j


def _gluon(kernel):
    def run(*args):
        if not consumer_pingpong.usable(torch.device("cuda", 0)):
            pytest.skip("the Gluon kernels run on Hopper")
        return kernel(*args, gluon=True)

    return run


@pytest.mark.parametrize(
    "kernel", [_consumer, _producer, _gluon(_consumer), _gluon(_producer)],
    ids=["consumer", "producer", "gluon consumer", "gluon producer"],
)  # fmt: skip
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


def test_rowwise_cublas_variant_accumulates_exactly():
    """scaled_ops.scaled_mm_rows with rowwise scales and use_fast_accum=False (what the ops'
    cuBLAS variants run in torchao's backward) calls _scaled_mm's rowwise kernel, which must
    then accumulate exactly: bf16 out, so bf16's rounding bounds both errors, and fast
    accumulation's K = 8192 error still shows above it."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(M, K, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(N, K, generator=gen, device="cuda").to(torch.float8_e4m3fn).t()
    a_scale = torch.rand(M, 1, generator=gen, device="cuda") + 0.5
    w_scale = torch.rand(1, N, generator=gen, device="cuda") + 0.5
    ref = (a.double() * a_scale.double()) @ (w.double() * w_scale.double())

    def error(fast):
        out = scaled_ops.scaled_mm_rows(a, a_scale, w, w_scale, None, torch.bfloat16, fast)
        return ((out.double() - ref).norm() / ref.norm()).item()

    exact, fast = error(False), error(True)
    assert exact < 3e-3 and exact * 1.2 < fast, (exact, fast)
