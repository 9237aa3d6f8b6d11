"""Does Triton 3.6's Hopper warp specialization pay at the bench shapes? A plain persistent TMA
GEMM (the fused kernels' structure without chunks or flags: GROUP_M-swizzled tiles, masked
pointer-store epilogue, float8 rowwise scales there) in three forms, interleaved with cuBLAS:
flattened at 8 warps (what the fused kernels run today), and warp-specialized at 4 warps
(Triton adds two warp groups: 12 warps) with 128x256 and 128x128 tiles.

    python3 docs/bench/2026-11-24-s15/probe_ws_plain.py [--float8]
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tools.measure import relative_error, time_interleaved

SHAPES = [  # (name, M, K, N): bench_ops' W=2 shapes, the whole M
    ("ag 8B qkv", 8192, 4096, 3072), ("ag 8B up+gate", 8192, 4096, 14336), ("ag 70B qkv", 8192, 8192, 5120),
    ("ag 70B up+gate", 8192, 8192, 28672), ("ag wide", 4096, 16384, 6656), ("rs 8B o", 8192, 2048, 4096),
    ("rs 8B down", 8192, 7168, 4096), ("rs 70B o", 8192, 4096, 8192), ("rs 70B down", 8192, 14336, 8192),
]  # fmt: skip


@triton.jit
def plain_kernel(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, NUM_SMS: tl.constexpr,
                 SCALED: tl.constexpr, FLAT: tl.constexpr, WS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % size_m)
        tile_n = (tile % (GROUP_M * tiles_n)) // size_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([tile_m * BM, k0])
            b = b_desc.load([tile_n * BN, k0])
            acc = tl.dot(a, b.T, acc)
        offs_m = tile_m * BM + tl.arange(0, BM)
        offs_n = tile_n * BN + tl.arange(0, BN)
        m_mask = offs_m < M
        n_mask = offs_n < N
        if SCALED:
            acc *= tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
            acc *= tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
                 mask=m_mask[:, None] & n_mask[None, :])


def runner(a, w_nk, a_scale, b_scale, out, bm, bn, bk, warps, stages, flat, ws, sms):
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w_nk, [bn, bk])
    m, k = a.shape
    n = w_nk.shape[0]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(sms, tiles),)
    scaled = a_scale is not None
    sa = a_scale if scaled else out
    sb = b_scale if scaled else out

    def run():
        plain_kernel[grid](a_desc, b_desc, out, sa, sb, m, n, k, NUM_SMS=grid[0], SCALED=scaled, FLAT=flat,
                           WS=ws, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)  # fmt: skip

    return run


def main():
    float8 = "--float8" in sys.argv
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    bk = 128 if float8 else 64
    variants = {
        "flat w8 128x256 s3": (128, 256, bk, 8, 3, True, False),
        "ws w4 128x256 s3": (128, 256, bk, 4, 3, False, True),
        "ws w4 128x256 s4": (128, 256, bk, 4, 4, False, True),
        "ws w4 128x128 s4": (128, 128, bk, 4, 4, False, True),
    }
    if float8:
        variants["ws w4 128x256 s4"] = (128, 256, 64, 4, 4, False, True)  # 128-deep, 4 stages: too big
    print(f"{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__} "
          f"{'float8 rowwise' if float8 else 'bf16'}", flush=True)  # fmt: skip
    rows = []
    for name, m, k, n in SHAPES:
        a = torch.randn(m, k, device=device)
        w = torch.randn(n, k, device=device)
        if float8:
            a, w = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            sa, sb = torch.rand(m, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
            ref_fn = lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
            sa_flat, sb_flat = sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous()
        else:
            a, w = a.bfloat16(), w.bfloat16()
            ref_fn = lambda: torch.mm(a, w.t())  # noqa: E731
            sa_flat = sb_flat = None
        runners = {"cublas": ref_fn}
        ref = ref_fn()
        errs = {}
        for key, (bm, bn, bk_, warps, stages, flat, ws) in variants.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            run = runner(a, w, sa_flat, sb_flat, out, bm, bn, bk_, warps, stages, flat, ws, sms)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # a variant that does not compile or fit: say so, go on
                print(f"  {name} {key}: {type(e).__name__} {str(e)[:200]}", flush=True)
                continue
            errs[key] = relative_error(out, ref)
            runners[key] = run
        times, _ = time_interleaved(runners, device, rounds=15, calls=10, warmup=3)
        rows.append((name, times, errs))
        cells = " | ".join(f"{key} {times[key] / times['cublas']:.3f} (err {errs[key]:.1e})" for key in errs)
        print(f"{name}: cublas {times['cublas']:.1f} us | {cells}", flush=True)
    keys = list(variants)
    print("\n| shape | cuBLAS µs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, times, errs in rows:
        cells = " | ".join(f"{times[k] / times['cublas']:.3f}" if k in times else "-" for k in keys)
        print(f"| {name} | {times['cublas']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
