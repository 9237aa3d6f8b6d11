"""An explicitly warp-specialized Hopper GEMM in Gluon (triton.experimental.gluon, Triton 3.6),
against cuBLAS and the plain flattened Triton kernel of probe_ws_plain.py.

probe_ws_plain.py found Triton's automatic Hopper warp specialization no faster than the
flattened loop: the tensor cores still idle through each tile's epilogue. This kernel
partitions the warps by hand, CUTLASS "pingpong" style:

- a loader partition (1 warp, few registers) walks the program's tiles (persistent: grid = SMs,
  GROUP_M-swizzled order) and issues the TMA loads of A [TILE_M, BK] and B [BN, BK] into a ring
  of NUM_STAGES shared-memory stages, each guarded by a "ready" mbarrier (TMA transaction count)
  and an "empty" one (consumers' release);
- two consumer warpgroups (the default partition and a 4-warp worker). Pingpong: they take the
  program's tiles alternately (local tile j goes to warpgroup j % 2, its K blocks at ring
  positions j * k_tiles ...), each running async wgmma over K into its own [BM_WG, BN] fp32
  accumulator and then its own epilogue (rowwise scales, bf16 cast, masked store), while the
  other warpgroup's main loop keeps the tensor cores busy. An "order" mbarrier pair passes the
  main-loop turn from one warpgroup to the other, as CUTLASS's math order barrier does: their
  wgmmas do not interleave, and it is what makes the shared ring correct. Without it (tried: an
  "unordered" variant died with "unspecified launch failure" on the H100) warpgroup 1 can wait
  on a stage two uses ahead of the stage's state, and an mbarrier's parity wait cannot tell that
  from one use behind: it passes at once, on a stage not yet loaded. Cooperative (PINGPONG=False): both warpgroups take
  every tile, each its half of the rows ([2 * BM_WG, BN] tile), and release each stage
  together (empty count 2): the epilogue is not overlapped, the simpler fallback.

Registers: 4 (default) + 4 + 1 warps, rounded to 12 warps (3 warpgroups); the kernel launches
with maxnreg 168 (65536 / 384) and setmaxnreg gives the worker consumer CONSUMER_REGS, the loader
LOADER_REGS and the default consumer what is left (3 * 168 - 232 - 40 = 232).

    python3 docs/bench/2026-11-24-s15/probe_gluon_ws.py --compile-only   # sm_90a, no GPU needed
    python3 docs/bench/2026-11-24-s15/probe_gluon_ws.py [--float8]       # on an H100

On the GPU each variant is first run once (two small problems: odd M and N, K not a multiple of
BK, several tiles per program) in a process of its own under a time limit, into a NaN-poisoned
output, against torch._scaled_mm(use_fast_accum=True) / torch.mm; only those that pass are timed
(tools.measure.time_interleaved) on probe_ws_plain's 9 shapes.
"""

import collections
import functools
import importlib.util
import os
import subprocess
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SMEM_LIMIT = 232448  # bytes of shared memory a Hopper block may take
MAXNREG = 168  # 65536 registers over 12 warps (384 threads), rounded down to a multiple of 8


# ---------------------------------------------------------------------------------------------
# the kernel


@gluon.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """GROUP_M-swizzled (tile_m, tile_n) of linear tile ``tile``, as the fused kernels order them."""
    group = tile // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + tile % size_m
    tile_n = (tile % (GROUP_M * tiles_n)) // size_m
    return tile_m, tile_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """1 warp: every tile of this program in order, every K block, into the ring."""
    TILE_M: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.cdiv(M, TILE_M)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    pos = 0  # ring position: stage pos % NUM_STAGES, its use number pos // NUM_STAGES
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        off_m = tile_m * TILE_M
        off_n = tile_n * BN
        for kb in range(k_tiles):
            s = pos % NUM_STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0: the first
            # pass over the ring does not wait
            mbarrier.wait(empty.index(s), ((pos // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kb * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kb * BK], bar, b_bufs.index(s))
            pos += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
              WG: gl.constexpr, SCALED: gl.constexpr, PINGPONG: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """One warpgroup (4 warps): main loop of async wgmma over K, then the epilogue, per tile."""
    TILE_M: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    BM_WG: gl.constexpr = TILE_M if PINGPONG else TILE_M // 2
    ROW0: gl.constexpr = 0 if PINGPONG else WG * BM_WG  # this warpgroup's rows of the tile
    INSTR_N: gl.constexpr = BN if BN <= 256 else 256
    INSTR_K: gl.constexpr = 256 // a_bufs.dtype.primitive_bitwidth
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, INSTR_N, INSTR_K])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    tiles_m = gl.cdiv(M, TILE_M)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if PINGPONG:
        first = pid + WG * nprog
        step = 2 * nprog
        j = WG  # the program's local tile number: its K blocks start at ring position j * k_tiles
        j_step = 2
    else:
        first = pid
        step = nprog
        j = 0
        j_step = 1
    turn = 0  # the main loops this warpgroup has run (pingpong order barrier phase)
    for tile in range(first, tiles_m * tiles_n, step):
        tile_m, tile_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        pos = j * k_tiles
        if PINGPONG:
            # the main-loop turn (see the docstring: the ring needs it). Warpgroup 0 goes first: its first wait is on the fresh barrier's "previous" phase
            mbarrier.wait(order.index(WG), (turn & 1) ^ (1 - WG))
        acc = gl.zeros([BM_WG, BN], gl.float32, mma_layout)
        for kb in range(k_tiles):
            s = pos % NUM_STAGES
            mbarrier.wait(ready.index(s), (pos // NUM_STAGES) & 1)
            a = a_bufs.index(s)
            if not PINGPONG:
                a = a.slice(ROW0, BM_WG, dim=0)
            b = b_bufs.index(s).permute((1, 0))  # [BK, BN], K-major as fp8 wgmma requires
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # at most this wgmma in flight: the previous K block's stage is read, release it
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES), pred=kb > 0)
            pos += 1
        if PINGPONG:
            mbarrier.arrive(order.index(1 - WG))  # the other warpgroup's main loop may start
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES))
        turn += 1
        j += j_step

        # epilogue: scales on the fp32 accumulator, bf16, masked store from the wgmma layout
        offs_m = tile_m * TILE_M + ROW0 + gl.arange(0, BM_WG, layout=rows_layout)
        offs_n = tile_n * BN + gl.arange(0, BN, layout=cols_layout)
        m_mask = offs_m < M
        n_mask = offs_n < N
        if SCALED:
            sa = gl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
            sb = gl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
            acc = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
        ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_n, 0)
        mask = gl.expand_dims(m_mask, 1) & gl.expand_dims(n_mask, 0)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _consumer_default(a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                      SCALED: gl.constexpr, PINGPONG: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    _consumer(a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm, 0, SCALED,
              PINGPONG, GROUP_M)  # fmt: skip


@gluon.jit
def _consumer_worker(a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                     SCALED: gl.constexpr, PINGPONG: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    _consumer(a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm, 1, SCALED,
              PINGPONG, GROUP_M)  # fmt: skip


@gluon.jit
def gluon_ws_gemm_kernel(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                         SCALED: gl.constexpr, PINGPONG: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         LOADER_REGS: gl.constexpr):  # fmt: skip
    """C[M, N] (bf16, row stride stride_cm) = A[M, K] @ B[N, K]^T (* a_scale[M, None] * b_scale[None, N]
    if SCALED). a_desc: [TILE_M, BK] blocks of A; b_desc: [BN, BK] blocks of B. 4 warps."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if PINGPONG else 2)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    fence_async_shared()  # the inits seen by the async proxy (TMA) before the partitions start

    # (the argument tuples written out in the call: a tuple assigned to a variable first turns its
    # constexprs into tensors)
    gl.warp_specialize([
        (_consumer_default, (a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                             SCALED, PINGPONG, GROUP_M)),
        (_consumer_worker, (a_bufs, b_bufs, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                            SCALED, PINGPONG, GROUP_M)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------------------------
# variants, launch, CPU compile


def variants(float8: bool) -> dict:
    """name -> (pingpong, BM per warpgroup, BN, BK, stages[, GROUP_M]). Stages: as many as fit.
    With PROBE_GROUP_SWEEP=1 in the environment (inherited by the check processes): the
    128x128 pingpong at 4 and 6 stages, GROUP_M 4, 8 and 16 (the tile order's L2 reuse)."""
    bk = 128 if float8 else 64  # 128-byte rows either way
    if os.environ.get("PROBE_GROUP_SWEEP") == "1":
        return {f"gluon pp 128x128 s{s} g{g}": (True, 128, 128, bk, s, g) for s in (4, 6) for g in (4, 8, 16)}
    return {
        "gluon pp 128x128 s6": (True, 128, 128, bk, 6),
        "gluon pp 128x128 s5": (True, 128, 128, bk, 5),
        "gluon pp 128x128 s4": (True, 128, 128, bk, 4),
        "gluon pp 64x256 s5": (True, 64, 256, bk, 5),
        "gluon coop 128x256 s4": (False, 64, 256, bk, 4),
    }


def _tile_m(pingpong, bm_wg):
    return bm_wg if pingpong else 2 * bm_wg


def _gl_dtype(float8: bool):
    return gl.float8e4nv if float8 else gl.bfloat16


def _constexprs(scaled, pingpong, stages, group_m=8):
    return dict(SCALED=scaled, PINGPONG=pingpong, NUM_STAGES=stages, GROUP_M=group_m, CONSUMER_REGS=232,
                LOADER_REGS=40)  # fmt: skip


def gluon_runner(a, w_nk, a_scale, b_scale, out, sms, pingpong, bm_wg, bn, bk, stages, group_m=8):
    """A function of no arguments that runs the Gluon kernel on these operands into ``out``."""
    float8 = a.dtype == torch.float8_e4m3fn
    tile_m = _tile_m(pingpong, bm_wg)
    dt = _gl_dtype(float8)
    a_desc = TensorDescriptor.from_tensor(a, [tile_m, bk], gl.NVMMASharedLayout.get_default_for([tile_m, bk], dt))
    b_desc = TensorDescriptor.from_tensor(w_nk, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], dt))
    m, k = a.shape
    n = w_nk.shape[0]
    grid = (min(sms, triton.cdiv(m, tile_m) * triton.cdiv(n, bn)),)
    scaled = a_scale is not None
    sa = a_scale if scaled else out
    sb = b_scale if scaled else out
    consts = _constexprs(scaled, pingpong, stages, group_m)

    def run():
        gluon_ws_gemm_kernel[grid](a_desc, b_desc, out, sa, sb, m, n, k, out.stride(0), **consts, num_warps=4,
                                   maxnreg=MAXNREG)  # fmt: skip

    return run


def compile_sm90(float8: bool, spec: tuple):
    """The kernel compiled for sm_90a without a GPU (as tools/kernel_ir.py does for tl kernels:
    Gluon's source class is GluonASTSource; triton.compile takes it the same way)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    pingpong, bm_wg, bn, bk, stages, group_m = (*spec, 8)[:6]
    tile_m = _tile_m(pingpong, bm_wg)
    dt = _gl_dtype(float8)
    dname = "fp8e4nv" if float8 else "bf16"
    a_lay = gl.NVMMASharedLayout.get_default_for([tile_m, bk], dt)
    b_lay = gl.NVMMASharedLayout.get_default_for([bn, bk], dt)
    signature = {
        "a_desc": f"tensordesc<{dname}[{tile_m}, {bk}],{a_lay!r}>", "b_desc": f"tensordesc<{dname}[{bn}, {bk}],{b_lay!r}>",
        "c_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
        "stride_cm": "i32",
    }  # fmt: skip
    consts = _constexprs(float8, pingpong, stages, group_m)
    signature.update({key: "constexpr" for key in consts})
    names = list(signature)
    # as the JIT specializes the bench shapes: pointers 16-byte aligned, M, N, K 16-divisible
    aligned = ("c_ptr", "a_scale_ptr", "b_scale_ptr", "M", "N", "K", "stride_cm")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    source = GluonASTSource(gluon_ws_gemm_kernel, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})


def compile_only() -> bool:
    """Every variant, float8 and bf16, compiled for sm_90a: a table, and whether all fit."""
    import re

    ok_all = True
    print("| variant | dtype | compiled | shared memory | setmaxnreg | wgmma | stores |")
    print("|---|---|---|---|---|---|---|")
    for float8 in (True, False):
        for name, spec in variants(float8).items():
            dname = "float8" if float8 else "bf16"
            try:
                kernel = compile_sm90(float8, spec)
            except Exception as e:  # say which and why, go on with the others
                ok_all = False
                msg = " ".join(str(e).split())[:300]
                print(f"| {name} | {dname} | no: {type(e).__name__} {msg} | - | - | - | - |", flush=True)
                continue
            ptx = kernel.asm["ptx"]
            shared = kernel.metadata.shared
            regs = sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)), key=int)
            wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
            stores = collections.Counter(re.findall(r"st\.global[a-z0-9.:]*", ptx))
            fits = shared <= SMEM_LIMIT
            ok_all &= fits
            print(f"| {name} | {dname} | {'yes' if fits else 'yes, but over the smem limit'} | {shared} B | "
                  f"{','.join(regs) or '-'} | {wgmma} | {dict(stores)} |", flush=True)  # fmt: skip
    return ok_all


# ---------------------------------------------------------------------------------------------
# GPU harness (probe_ws_plain's)


@functools.lru_cache(maxsize=None)
def _plain():
    """probe_ws_plain.py, imported from its file (docs/bench is no package)."""
    spec = importlib.util.spec_from_file_location("probe_ws_plain", os.path.join(os.path.dirname(__file__), "probe_ws_plain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASELINE = "triton flat w8 128x256 s3"


def all_variants(float8: bool) -> dict:
    """name -> ("plain", spec) | ("gluon", spec): the flattened Triton baseline, then the Gluon ones."""
    out = {BASELINE: ("plain", _plain().variants(float8)["flat w8 128x256 s3"])}
    out.update({name: ("gluon", spec) for name, spec in variants(float8).items()})
    return out


def make_runner(kind, spec, a, w, sa, sb, out, sms):
    if kind == "plain":
        return _plain().runner(a, w, sa, sb, out, sms, *spec)
    return gluon_runner(a, w, sa, sb, out, sms, *spec)


CHECK_SHAPES = [(1000, 1040, 1200), (3000, 2064, 2512)]  # odd M, N; K % BK != 0; several tiles per program


def check(key: str, float8: bool) -> None:
    """One run of variant ``key`` on each check shape, against the reference."""
    device = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    kind, spec = all_variants(float8)[key]
    plain = _plain()
    errs = []
    for m, k, n in CHECK_SHAPES:
        a, w, sa, sb, ref_fn = plain.operands(m, k, n, float8, device)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        make_runner(kind, spec, a, w, sa, sb, out, sms)()
        torch.cuda.synchronize()
        errs.append(plain.relative_error(out, ref_fn()))
    worst = max(errs)
    print(f"{'ok' if worst < 2e-2 else 'wrong'} err {' '.join(f'{e:.2e}' for e in errs)}")


def passing(float8: bool) -> dict:
    """The variants that pass the check within 90 s (first compile included), each in a process
    of its own: a wait that never ends hangs that process, not this one."""
    ok = {}
    for key, (kind, spec) in all_variants(float8).items():
        cmd = [sys.executable, os.path.abspath(__file__), "--check", key] + (["--float8"] if float8 else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=_ROOT)
            said = (done.stdout.strip().splitlines() or [f"failed: {line[:300]}" for line in done.stderr.splitlines()
                                                          if line.strip() and not line.startswith(" ")] or ["failed"])[-1]
        except subprocess.TimeoutExpired:
            said = "did not finish in 90 s"
        print(f"check {key}: {said}", flush=True)
        if said.startswith("ok "):
            ok[key] = (kind, spec)
    return ok


def main():
    if "--compile-only" in sys.argv:
        sys.exit(0 if compile_only() else 1)
    float8 = "--float8" in sys.argv
    if "--check" in sys.argv:
        check(sys.argv[sys.argv.index("--check") + 1], float8)
        return
    from tools.measure import relative_error, time_interleaved

    plain = _plain()
    device = torch.device("cuda", 0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__} "
          f"{'float8 rowwise' if float8 else 'bf16'}", flush=True)  # fmt: skip
    chosen = passing(float8)
    rows = []
    for name, m, k, n in plain.SHAPES:
        a, w, sa, sb, ref_fn = plain.operands(m, k, n, float8, device)
        runners = {"cublas": ref_fn}
        ref = ref_fn()
        errs = {}
        for key, (kind, spec) in chosen.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            run = make_runner(kind, spec, a, w, sa, sb, out, sms)
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
