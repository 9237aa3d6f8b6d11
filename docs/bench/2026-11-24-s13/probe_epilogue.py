"""Probe (session 13, one H100): the fused GEMMs before and after this session's epilogue work,
interleaved with cuBLAS in one process, at the bench_ops W=2 shapes. "after": the consumer's
wait reads no memory on tiles that need no wait, its epilogue issues its loads before it
touches the accumulator (and, at commit 6092322, where the session's tables were taken, stored
whole tiles through TMA in two halves, with "after ptr-store" the same kernel without; the TMA
store was taken out after it came with misaligned-address faults, PERF.md).

``s13_before/`` (not committed) holds templates/ as of commit 25b2835:

    mkdir s13_before && for f in __init__ all_gather_matmul gemm launch matmul_reduce_scatter \
        signals tiles; do git show 25b2835:templates/$f.py > s13_before/$f.py; done
    PYTHONPATH=$PWD python3 docs/bench/2026-11-24-s13/probe_epilogue.py --mode bf16|rowwise|tensorwise [--compile-only]
"""

import argparse
import json

import torch
import triton

import s13_before.all_gather_matmul as consumer_before
import s13_before.gemm as gemm_before
import s13_before.matmul_reduce_scatter as producer_before
from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer
from tools.bench_gemm import _consumer_run, _operands, _producer_run
from tools.bench_ops import SHAPES
from tools.measure import relative_error, time_interleaved


def variants(op, float8):
    """name -> (module, config): before and after at the first config; after with 4 stages."""
    before = (gemm_before.FLOAT8_CONFIGS if float8 else gemm_before.CONFIGS)[0]
    configs = gemm.FLOAT8_CONFIGS if float8 else gemm.CONFIGS
    module, old = (consumer, consumer_before) if op == "all_gather_matmul" else (producer, producer_before)
    return {"before": (old, before), "after": (module, configs[0]), "after s4": (module, configs[1])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("bf16", "rowwise", "tensorwise"), required=True)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--op", default=None, help="only this op")
    parser.add_argument("--shape", default=None, help="only this shape")
    parser.add_argument("--variants", default=None, help="only these variants, comma-separated")
    parser.add_argument("--jit-launch", action="store_true", help="launch through Triton's JIT, not DirectKernel")
    args = parser.parse_args()
    if args.jit_launch:  # a launch hook sends every DirectKernel launch through the JIT
        from triton import knobs

        knobs.runtime.launch_enter_hook.add(lambda metadata: None)
    float8 = args.mode != "bf16"
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []
    for op in [args.op] if args.op else SHAPES:
        for name, m, k, n in SHAPES[op][2]:
            if args.shape and name != args.shape:
                continue
            a, w, a_scale, w_scale = _operands(m, k, n, float8, args.mode == "rowwise", device)
            if float8:
                runners = {"cublas": lambda: torch._scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.bfloat16, use_fast_accum=True)}
            else:
                runners = {"cublas": lambda: torch.mm(a, w)}
            ref = runners["cublas"]()
            make = _consumer_run if op == "all_gather_matmul" else _producer_run
            errors = {}
            for key, (module, config) in variants(op, float8).items():
                if args.variants and key not in args.variants.split(","):
                    continue
                run, result = make(a, w, a_scale, w_scale, 2, config, True, module=module)
                run()
                torch.cuda.synchronize()
                errors[key] = relative_error(result(), ref)
                runners[key] = run
            if args.compile_only:
                print(op, name, {k_: f"{e:.1e}" for k_, e in errors.items()}, flush=True)
                continue
            times, _ = time_interleaved(runners, device, args.rounds, 10, 3)
            row = {"op": op, "shape": name, "M": m, "K": k, "N": n, "times_us": {k_: round(t, 1) for k_, t in times.items()},
                   "errors": {k_: float(f"{e:.1e}") for k_, e in errors.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.compile_only:
        return
    print(f"\n{torch.cuda.get_device_name(device)} torch {torch.__version__} triton {triton.__version__} {args.mode}")
    keys = ["before", "after", "after s4"]
    print("| op | shape | " + " | ".join(keys) + " |  (time / cuBLAS)")
    print("|---|---|" + "---|" * len(keys))
    for r in rows:
        t = r["times_us"]
        cells = [f"{t[k_] / t['cublas']:.3f}" if k_ in t else "" for k_ in keys]
        print(f"| {r['op'][:14]} | {r['shape']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
