"""Probe: a warp-specialized float8 GEMM in Gluon with exact accumulation (use_fast_accum=False,
torchao's backward), against cuBLAS's exact _scaled_mm, on bench_ops' W=2 shapes (whole M, one
weight), plain GEMM (no chunks, no flags).

The ops' Triton kernels reach exactness with max_num_imprecise_acc (each 128-deep K block's
product added into the fp32 accumulator apart) and run 1.37-1.66x cuBLAS's exact time, in any
tile shape (probe_exact_configs.py). Here each K block's wgmma goes into a partial accumulator of
its own while the previous block's partial is added in: two partials in flight, as CUTLASS's
promotion keeps them. Cooperative: both consumer warpgroups on each 128 x BN tile, 64 rows each
(accumulator + two partials, 3 x 64 registers a thread at BN = 128), releasing each stage
together; s15's probe_gluon_ws.py gives the loader warp and the tile order.

    python3 docs/bench/2026-11-25-s17/probe_gluon_exact.py --compile-only   # sm_90a, no GPU
    python3 docs/bench/2026-11-25-s17/probe_gluon_exact.py                  # on an H100
"""

import functools
import importlib.util
import os
import re
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

MAXNREG = 168
S15 = os.path.join(_ROOT, "docs", "bench", "2026-11-24-s15")


@functools.lru_cache(maxsize=None)
def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(S15, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ws = _module("probe_gluon_ws")
_loader, _tile_coords = _ws._loader, _ws._tile_coords


@gluon.jit
def _partial(a_bufs, b_bufs, ready, pos, ROW0: gl.constexpr, BM_WG: gl.constexpr, mma_layout: gl.constexpr):
    """K block ``pos`` of the ring, once loaded, into a fresh partial (async wgmma)."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = b_bufs.shape[1]
    s = pos % NUM_STAGES
    mbarrier.wait(ready.index(s), (pos // NUM_STAGES) & 1)
    return warpgroup_mma(
        a_bufs.index(s).slice(ROW0, BM_WG, dim=0), b_bufs.index(s).permute((1, 0)),
        gl.zeros([BM_WG, BN], gl.float32, mma_layout), use_acc=False, is_async=True,
    )  # fmt: skip


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
              WG: gl.constexpr, GROUP_M: gl.constexpr, PAIRS: gl.constexpr, WAIT_EACH: gl.constexpr):  # fmt: skip
    """Warpgroup WG's 64 rows of every tile of the program: each K block's product into a fresh
    partial (async), the previous block's partial added into the fp32 accumulator while it runs.
    PAIRS: two partials of their own, alternating (an even number of K blocks); else one
    loop-carried partial, whose consecutive values the register allocator may put in the same
    registers. WAIT_EACH: each partial waited for before it is added (the other warpgroup's
    wgmmas keep the tensor cores busy meanwhile). ptxas serializes the first two forms (C7514:
    a non-wgmma instruction reads an accumulator while a wgmma is in flight)."""
    TILE_M: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = b_bufs.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    BM_WG: gl.constexpr = TILE_M // 2
    ROW0: gl.constexpr = WG * BM_WG
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 256 // a_bufs.dtype.primitive_bitwidth]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    tiles_m = gl.cdiv(M, TILE_M)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, a_bufs.shape[2])
    pos = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros([BM_WG, BN], gl.float32, mma_layout)
        if WAIT_EACH:  # each block's partial waited for before it is added: no wgmma in flight then
            for kb in range(0, k_tiles):
                part = _partial(a_bufs, b_bufs, ready, pos, ROW0, BM_WG, mma_layout)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(pos % NUM_STAGES))
                acc = acc + part
                pos += 1
        elif PAIRS:
            odd = gl.zeros([BM_WG, BN], gl.float32, mma_layout)
            for kb in range(0, k_tiles, 2):
                even = _partial(a_bufs, b_bufs, ready, pos, ROW0, BM_WG, mma_layout)
                even, odd = warpgroup_mma_wait(num_outstanding=1, deps=(even, odd))
                acc = acc + odd
                mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES), pred=kb > 0)
                pos += 1
                odd = _partial(a_bufs, b_bufs, ready, pos, ROW0, BM_WG, mma_layout)
                odd, even = warpgroup_mma_wait(num_outstanding=1, deps=(odd, even))
                acc = acc + even
                mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES))
                pos += 1
            odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd,))
            acc = acc + odd
        if not WAIT_EACH and not PAIRS:
            part = _partial(a_bufs, b_bufs, ready, pos, ROW0, BM_WG, mma_layout)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(part,))  # as a tensor: waits for nothing
            pos += 1
            for kb in range(1, k_tiles):
                nxt = _partial(a_bufs, b_bufs, ready, pos, ROW0, BM_WG, mma_layout)
                # the previous block's partial is done (this one may still run): add it, free its stage
                nxt, part = warpgroup_mma_wait(num_outstanding=1, deps=(nxt, part))
                acc = acc + part
                mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES))
                part = nxt
                pos += 1
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            acc = acc + part
        if not WAIT_EACH:
            mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES))

        offs_m = tile_m * TILE_M + ROW0 + gl.arange(0, BM_WG, layout=rows_layout)
        offs_n = tile_n * BN + gl.arange(0, BN, layout=cols_layout)
        m_mask = offs_m < M
        n_mask = offs_n < N
        sa = gl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
        sb = gl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
        ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(m_mask, 1) & gl.expand_dims(n_mask, 0))


@gluon.jit
def exact_gemm_kernel(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                      NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, PAIRS: gl.constexpr,
                      WAIT_EACH: gl.constexpr):  # fmt: skip
    """C = (A * a_scale[:, None]) @ (B * b_scale[None, :])^T, bf16, exact accumulation; a_desc:
    [128, BK] blocks of A, b_desc: [BN, BK] blocks of B ([N, K]). 4 + 4 + 1 warps."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a stage
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                     gl.constexpr(0), GROUP_M, PAIRS, WAIT_EACH)),
        (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                     gl.constexpr(1), GROUP_M, PAIRS, WAIT_EACH)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
    ], [4, 1], [232, 40])  # fmt: skip


VARIANTS = {  # name -> (BN, stages, GROUP_M, form); BK 128 (128-byte float8 rows)
    "coop exact 128x128 s6": (128, 6, 8, "one partial"),
    "coop exact 128x128 s6 pairs": (128, 6, 8, "pairs"),
    "coop exact 128x128 s6 wait each": (128, 6, 8, "wait each"),
    "coop exact 128x256 s4 wait each": (256, 4, 8, "wait each"),
    "coop exact 128x128 s4 wait each": (128, 4, 8, "wait each"),
}


def runner(a, w_nk, sa, sb, out, sms, bn, stages, group_m, form):
    pairs, wait_each = form == "pairs", form == "wait each"
    lay = functools.partial(gl.NVMMASharedLayout.get_default_for, dtype=gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(w_nk, [bn, 128], lay([bn, 128]))
    m, k = a.shape
    n = w_nk.shape[0]
    grid = (min(sms, triton.cdiv(m, 128) * triton.cdiv(n, bn)),)

    def run():
        exact_gemm_kernel[grid](a_desc, b_desc, out, sa, sb, m, n, k, out.stride(0), NUM_STAGES=stages,
                                GROUP_M=group_m, PAIRS=pairs, WAIT_EACH=wait_each, num_warps=4,
                                maxnreg=MAXNREG)  # fmt: skip

    if pairs and triton.cdiv(k, 128) % 2:
        raise ValueError("the pairs loop takes an even number of K blocks")

    return run


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for name, (bn, stages, group_m, form) in VARIANTS.items():
        a_lay = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
        b_lay = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
        signature = {
            "a_desc": f"tensordesc<fp8e4nv[128, 128],{a_lay!r}>", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{b_lay!r}>",
            "c_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
            "stride_cm": "i32", "NUM_STAGES": "constexpr", "GROUP_M": "constexpr", "PAIRS": "constexpr",
            "WAIT_EACH": "constexpr",
        }  # fmt: skip
        names = list(signature)
        attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("c_ptr", "M", "N", "K", "stride_cm")}
        source = GluonASTSource(exact_gemm_kernel, signature, {"NUM_STAGES": stages, "GROUP_M": group_m, "PAIRS": form == "pairs", "WAIT_EACH": form == "wait each"}, attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
        ptx = kernel.asm["ptx"]
        print(f"{name}: shared {kernel.metadata.shared} B, wgmma {len(re.findall(r'wgmma.mma_async', ptx))}, "
              f"local {ptx.count('.local')}", flush=True)  # fmt: skip


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    from tools.measure import relative_error, time_interleaved

    plain = _module("probe_ws_plain")
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__}", flush=True)
    rows = []
    for name, m, k, n in [(f"check {m}x{k}x{n}", m, k, n) for m, k, n in ((1000, 1024, 1200),)] + plain.SHAPES:
        a, w, sa, sb, _ = plain.operands(m, k, n, True, device)
        scale_a, scale_b = sa.view(-1, 1), sb.view(1, -1)
        runners = {
            "cublas exact": lambda: torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16),
            "cublas fast": lambda: torch._scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16, use_fast_accum=True),
        }
        exact = runners["cublas exact"]()
        errs = {"cublas fast": relative_error(runners["cublas fast"](), exact)}
        for key, spec in VARIANTS.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            run = runner(a, w, sa, sb, out, sms, *spec)
            run()
            torch.cuda.synchronize()
            errs[key] = relative_error(out, exact)
            runners[key] = run
        if name.startswith("check"):
            print(f"{name}: errors against cuBLAS exact {errs}", flush=True)
            continue
        times, _ = time_interleaved(runners, device, rounds=10, calls=10, warmup=3)
        base = times["cublas exact"]
        rows.append((name, base, {key: t / base for key, t in times.items()}, errs))
        print(f"{name}: cuBLAS exact {base:.1f} us; " + "; ".join(f"{key} {t / base:.3f} (err {errs.get(key, 0):.1e})" for key, t in times.items()), flush=True)
    keys = ["cublas fast", *VARIANTS]
    print("\n| shape | cuBLAS exact µs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name, base, ratio, _ in rows:
        print(f"| {name} | {base:.1f} | " + " | ".join(f"{ratio[key]:.3f}" for key in keys) + " |")


if __name__ == "__main__":
    main()
