"""Probe (session 12, one H100): which loop structure closes the Triton float8 GEMM's gap to
cuBLAS? A plain persistent TMA GEMM (the shape of the fused kernels' main loop, no flags) in
variants: the tile loop flattened into the K loop (the next tile's loads issue during this
tile's epilogue), the epilogue through TMA stores (whole or in two halves), Hopper warp
specialization on either loop; against torch._scaled_mm and the repo's own consumer and
producer at the same config. Rowwise scales, e4m3, bf16 out, fast accumulation.

    PYTHONPATH=$PWD python3 docs/bench/2026-11-24-s12/probe_gemm_loops.py
"""

import json
import sys
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_pass.templates import gemm
from tools.bench_gemm import _consumer_run, _operands, _producer_run
from tools.measure import relative_error, time_interleaved


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % per_group) // size_m


@triton.jit
def probe_kernel(
    a_desc, b_desc, c_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
    NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr,
    STORE: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tile_c = start - NUM_SMS  # the epilogue's own counter (the pipeliner's advice)
    for tile in tl.range(start, tiles_m * tiles_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_OUTER):
        pm, pn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in tl.range(k_tiles, warp_specialize=WS_INNER):
            a = a_desc.load([pm * BM, ki * BK])
            b = b_desc.load([pn * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        tile_c += NUM_SMS
        pm, pn = _tile_coords(tile_c, tiles_m, tiles_n, GROUP_M)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        if SCALED:
            acc *= tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
            acc *= tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if STORE == 0:  # pointer stores, as the fused kernels do
            ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
            tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])
        if STORE == 1:  # one TMA store of the tile
            c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))
        if STORE == 2:  # two TMA stores of half tiles (less shared memory, shorter live ranges)
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([pm * BM, pn * BN], left.to(c_desc.dtype))
            c_desc.store([pm * BM, pn * BN + BN // 2], right.to(c_desc.dtype))


VARIANTS = {  # name: (flatten, ws_outer, ws_inner, store, stages)
    "base": (False, False, False, 0, 3),
    "flat": (True, False, False, 0, 3),
    "flat+tma": (True, False, False, 1, 3),
    "flat+tma/2": (True, False, False, 2, 3),
    "flat+tma/2 s4": (True, False, False, 2, 4),
    "tma/2": (False, False, False, 2, 3),
    "ws_outer": (False, True, False, 0, 3),
    "ws_outer+tma/2": (False, True, False, 2, 3),
    "ws_inner": (False, False, True, 0, 3),
}


def probe_runner(a, w, a_scale, w_scale, variant, config):
    flatten, ws_outer, ws_inner, store, stages = VARIANTS[variant]
    m, n, k = a.shape[0], w.shape[1], a.shape[1]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    bn_store = config.block_n // 2 if store == 2 else config.block_n
    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
    b_desc = TensorDescriptor.from_tensor(w.t(), [config.block_n, config.block_k])
    c_desc = TensorDescriptor.from_tensor(out, [config.block_m, bn_store])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    a_s = a_scale.reshape(-1).contiguous() if a_scale is not None else out
    b_s = w_scale.reshape(-1).contiguous() if w_scale is not None else out
    compiled = {}

    def run():
        compiled["k"] = probe_kernel[(min(sms, tiles),)](
            a_desc, b_desc, c_desc, out, a_s, b_s, m, n, k, out.stride(0),
            NUM_SMS=sms, BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=8,
            FLATTEN=flatten, WS_OUTER=ws_outer, WS_INNER=ws_inner, STORE=store,
            SCALED=a_scale is not None, num_warps=config.num_warps, num_stages=stages,
        )  # fmt: skip

    return run, lambda: out, compiled


SHAPES = [  # (op whose shape it is, name, M, K, N) at W=2
    ("ag", "8B qkv", 8192, 4096, 3072),
    ("ag", "8B up+gate", 8192, 4096, 14336),
    ("ag", "70B qkv", 8192, 8192, 5120),
    ("rs", "8B o", 8192, 2048, 4096),
    ("rs", "8B down", 8192, 7168, 4096),
    ("rs", "70B o", 8192, 4096, 8192),
]


def main():
    float8 = "--bf16" not in sys.argv
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    config = gemm.FLOAT8_CONFIGS[0] if float8 else gemm.CONFIGS[0]
    rows = []
    for op, name, m, k, n in SHAPES:
        a, w, a_scale, w_scale = _operands(m, k, n, float8, True, device)
        if float8:
            runners = {"cublas": lambda: torch._scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.bfloat16, use_fast_accum=True)}
        else:
            runners = {"cublas": lambda: torch.mm(a, w)}
        ref = runners["cublas"]()
        results = {}
        make = _consumer_run if op == "ag" else _producer_run
        run, result = make(a, w, a_scale, w_scale, 2, config, True)
        results["ours"] = (run, result)
        info = {}
        for variant in VARIANTS:
            run, result, compiled = probe_runner(a, w, a_scale, w_scale, variant, config)
            results[variant] = (run, result)
            info[variant] = compiled
        errors, notes = {}, {}
        for key, (run, result) in results.items():
            try:
                out = result()
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                errors[key] = relative_error(result(), ref)
                if errors[key] < 2e-2:
                    runners[key] = run
                if key in info and "k" in info[key]:
                    ttgir = info[key]["k"].asm.get("ttgir", "")
                    notes[key] = {
                        "warp_specialize": "ttg.warp_specialize" in ttgir,
                        "smem": info[key]["k"].metadata.shared,
                        "n_regs": getattr(info[key]["k"], "n_regs", None),
                        "spills": getattr(info[key]["k"], "n_spills", None),
                    }
            except Exception as e:  # a variant that does not compile on Hopper is a result too
                errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                traceback.print_exc(limit=2)
        times, _ = time_interleaved(runners, device, 20, 10, 3)
        row = {"op": op, "shape": name, "M": m, "K": k, "N": n, "times_us": {k_: round(t, 1) for k_, t in times.items()},
               "errors": {k_: (f"{e:.1e}" if isinstance(e, float) else e) for k_, e in errors.items()}, "notes": notes}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__} "
          f"{'float8 rowwise fast' if float8 else 'bf16'} config {config}")
    keys = ["cublas", "ours", *VARIANTS]
    print("| shape | " + " | ".join(keys) + " |")
    for r in rows:
        t = r["times_us"]
        cells = [f"{t[k_]:.0f} ({t[k_] / t['cublas']:.2f})" if k_ in t else "x" for k_ in keys]
        print(f"| {r['op']} {r['shape']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
