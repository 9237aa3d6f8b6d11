"""How close each float8 GEMM comes to the exact product of its float8 operands, fast and exact
accumulation: cuBLAS (_scaled_mm) and overlap's consumer and producer (FP8_EXACT), fp32 out,
deep K. Prints the relative error against fp64 of the dequantized values."""

import torch

from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer

torch.manual_seed(0)
dev = "cuda"
for m, k, n in [(512, 8192, 512), (1024, 16384, 1024)]:
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    ref = a.double() @ w.double()

    def err(x):
        return ((x.double() - ref).norm() / ref.norm()).item()

    row = {}
    for fast in (True, False):
        tag = "fast" if fast else "exact"
        row[f"cublas {tag}"] = err(torch._scaled_mm(a, w, one, one, out_dtype=torch.float32, use_fast_accum=fast))
        out = torch.empty(m, n, device=dev)
        flags = torch.ones(2, dtype=torch.int32, device=dev)
        consumer.all_gather_matmul_consumer(
            a, [w], [None], [out], flags, torch.ones(1, dtype=torch.int32, device=dev), rank=0, world_size=2,
            inner=m // 2, config=gemm.CONFIGS[0], scales=consumer.Scales(one.reshape(1), None, (one.reshape(1),), fast),
        )
        row[f"consumer {tag}"] = err(out)
        dests = [torch.empty(m, n, device=dev) for _ in range(2)]
        pflags = torch.zeros(2, dtype=torch.int32, device=dev)
        producer.matmul_reduce_scatter_producer(
            a, w, None, torch.tensor([d.data_ptr() for d in dests], device=dev),
            torch.tensor([pflags[0].data_ptr(), pflags[1].data_ptr()], device=dev),
            torch.zeros(2, dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev),
            rank=0, world_size=2, config=gemm.CONFIGS[0], scales=(one.reshape(1), one.reshape(1)),
            out_dtype=torch.float32, fast_accum=fast,
        )
        torch.cuda.synchronize()
        row[f"producer {tag}"] = err(torch.cat([dests[0][: m // 2], dests[1][: m // 2]]))
    print(f"M={m} K={k} N={n}: " + ", ".join(f"{key} {v:.2e}" for key, v in row.items()))
