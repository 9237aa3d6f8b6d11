"""Does Triton 3.6's Hopper warp specialization pay at the bench shapes? A plain persistent TMA
GEMM (the fused kernels' structure without chunks or flags: GROUP_M-swizzled tiles, masked
pointer-store epilogue, float8 rowwise scales there) in three forms, interleaved with cuBLAS:
flattened at 8 warps (what the fused kernels run today), and warp-specialized at 4 warps
(Triton adds two warp groups: 12 warps) with 128x256 and 128x128 tiles.

The first run (host-side descriptors for every variant) printed nothing past its header in
280 s: the first warp-specialized variant never finished. So each variant is first run once on
a small problem in a process of its own under a time limit; only those that finish are timed.
Warp-specialized variants make their descriptors in the kernel (tl.make_tensor_descriptor), as
Triton's Hopper examples do for warp specialization; "host" variants take host-side ones.

    python3 docs/bench/2026-11-24-s15/probe_ws_plain.py [--float8]
"""

import subprocess
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
                 BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DEVICE_DESC: tl.constexpr):  # fmt: skip
    if DEVICE_DESC:  # a_desc, b_desc: the operands' pointers
        a_desc = tl.make_tensor_descriptor(a_desc, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_desc, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
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


def runner(a, w_nk, a_scale, b_scale, out, sms, bm, bn, bk, warps, stages, flat, ws, device_desc):
    if device_desc:
        a_desc, b_desc = a, w_nk
    else:
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
                           WS=ws, BM=bm, BN=bn, BK=bk, GROUP_M=8, DEVICE_DESC=device_desc, num_warps=warps,
                           num_stages=stages)  # fmt: skip

    return run


def variants(float8: bool) -> dict:
    """name -> (BM, BN, BK, warps, stages, flatten, warp-specialize, device-side descriptors)"""
    bk = 128 if float8 else 64
    return {
        "flat w8 128x256 s3": (128, 256, bk, 8, 3, True, False, False),
        "ws w4 128x256 s3": (128, 256, bk, 4, 3, False, True, True),
        "ws w4 128x256 s4": (128, 256, 64 if float8 else bk, 4, 4, False, True, True),
        "ws w4 128x128 s4": (128, 128, bk, 4, 4, False, True, True),
        "ws host w4 128x128 s4": (128, 128, bk, 4, 4, False, True, False),
    }


def operands(m, k, n, float8, device):
    a = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    if not float8:
        a, w = a.bfloat16(), w.bfloat16()
        return a, w, None, None, lambda: torch.mm(a, w.t())
    a, w = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
    ref = lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
    return a, w, sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(), ref


def check(key: str, float8: bool) -> None:
    """One run of variant ``key`` on a small problem (odd M and N), against the reference."""
    device = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    a, w, sa, sb, ref_fn = operands(1000, 1024, 1200, float8, device)
    out = torch.full((1000, 1200), float("nan"), dtype=torch.bfloat16, device=device)
    runner(a, w, sa, sb, out, sms, *variants(float8)[key])()
    torch.cuda.synchronize()
    err = relative_error(out, ref_fn())
    print(f"{'ok' if err < 2e-2 else 'wrong'} err {err:.2e}")


def passing(float8: bool) -> dict:
    """The variants that finish a small problem within 60 s, each in a process of its own."""
    ok = {}
    for key, spec in variants(float8).items():
        cmd = [sys.executable, __file__, "--check", key] + (["--float8"] if float8 else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            said = (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-1]
        except subprocess.TimeoutExpired:
            said = "did not finish in 60 s"
        print(f"check {key}: {said}", flush=True)
        if said.startswith("ok "):
            ok[key] = spec
    return ok


def main():
    float8 = "--float8" in sys.argv
    if "--check" in sys.argv:
        check(sys.argv[sys.argv.index("--check") + 1], float8)
        return
    device = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__} "
          f"{'float8 rowwise' if float8 else 'bf16'}", flush=True)  # fmt: skip
    chosen = passing(float8)
    rows = []
    for name, m, k, n in SHAPES:
        a, w, sa_flat, sb_flat, ref_fn = operands(m, k, n, float8, device)
        runners = {"cublas": ref_fn}
        ref = ref_fn()
        errs = {}
        for key, spec in chosen.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            run = runner(a, w, sa_flat, sb_flat, out, sms, *spec)
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
    keys = list(chosen)
    print("\n| shape | cuBLAS µs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, times, errs in rows:
        cells = " | ".join(f"{times[k] / times['cublas']:.3f}" if k in times else "-" for k in keys)
        print(f"| {name} | {times['cublas']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
