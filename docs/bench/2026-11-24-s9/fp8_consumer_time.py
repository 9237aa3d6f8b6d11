"""One GPU: the float8 all-gather consumer kernel (every chunk's flag already set: the GEMM
alone, no communication) against torch._scaled_mm on the same gathered operands, Llama 3 8B
shapes at 8192 tokens and W=2 (K = 4096: QKV and gate/up), tensorwise and rowwise. Says how far
the Triton fp8 GEMM is from cuBLAS before any overlap.

    python3 docs/bench/2026-11-24-s9/fp8_consumer_time.py
"""

import torch
import torch.distributed as dist

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import gemm
from tools.measure import time_interleaved

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29511", device_id=device)
M, K, W = 8192, 4096, 2
rows = []
for n in (3072, 7168):  # QKV (4096 + 2 * 1024) / 2, gate or up 14336 / 2
    a = torch.randn(M, K, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(n, K, device=device).to(torch.float8_e4m3fn)
    for rowwise in (False, True):
        sa = torch.rand(M, device=device) + 0.5 if rowwise else torch.tensor(0.7, device=device)
        sb = torch.rand(1, n, device=device) + 0.5 if rowwise else torch.tensor(1.3, device=device)
        out = torch.empty(M, n, device=device, dtype=torch.bfloat16)
        flags = torch.full((W,), 7, dtype=torch.int32, device=device)
        epoch = torch.tensor([7], dtype=torch.int32, device=device)
        scales = agm.Scales(sa, agm.own_rows(sa[:, None], 0, W, M // W)[:, 0].contiguous() if rowwise else None, (sb,))

        def triton_fp8(config):
            agm.all_gather_matmul_consumer(
                a, [w.t()], [None], [out], flags, epoch, rank=0, world_size=W, inner=M // W,
                config=config, scales=scales,
            )

        def cublas():
            torch._scaled_mm(a, w.t(), sa[:, None] if rowwise else sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)

        runners = {"scaled_mm(fast_accum)": cublas}
        runners |= {f"triton {c}": (lambda c=c: triton_fp8(c)) for c in gemm.CONFIGS[:3]}
        timed, _ = time_interleaved(runners, device, 10, 50, 3)
        ref = torch._scaled_mm(a, w.t(), sa[:, None] if rowwise else sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
        triton_fp8(gemm.CONFIGS[0])
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        flops = 2 * M * n * K
        for name, us in timed.items():
            rows.append((n, "rowwise" if rowwise else "tensorwise", name, us, flops / us / 1e6, err))
print(f"{'N':>6} {'scales':>10} {'kernel':>36} {'us':>8} {'TFLOP/s':>8}")
for n, kind, name, us, tflops, err in rows:
    print(f"{n:>6} {kind:>10} {name:>36} {us:8.1f} {tflops:8.0f}   (triton vs cuBLAS rel err {err:.1e})")
dist.destroy_process_group()
