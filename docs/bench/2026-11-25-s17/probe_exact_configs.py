"""Probe: the fused float8 GEMMs with exact accumulation (use_fast_accum=False, torchao's
backward) in other tile configs, against cuBLAS's exact _scaled_mm, as CUDA graph replays on
one GPU (tools/bench_gemm's runners). The ops' float8 configs are 128x256 tiles: with exact
accumulation Triton keeps a second, partial accumulator (max_num_imprecise_acc), which at
128x256 over two warpgroups is 2 x 128 registers a thread; 128x128 halves it.

    python3 docs/bench/2026-11-25-s17/probe_exact_configs.py --out exact_configs.json
"""

import argparse
import json

import torch

from overlap_pass.templates import gemm
from tools.bench_gemm import _consumer_run, _graphed, _operands, _producer_run
from tools.bench_ops import SHAPES, weight_columns
from tools.measure import relative_error, time_interleaved

CANDIDATES = gemm.FLOAT8_CONFIGS[:1] + [
    gemm.GemmConfig(128, 128, 128, 8, 8, 4, tma=True),
    gemm.GemmConfig(128, 128, 128, 8, 8, 5, tma=True),
    gemm.GemmConfig(128, 128, 64, 8, 8, 6, tma=True),
    gemm.GemmConfig(64, 256, 128, 8, 4, 4, tma=True),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        for name, m, k, n in SHAPES[op][2]:
            columns = weight_columns(name, n, True) if op == "all_gather_matmul" else [n]
            columns = columns if len(columns) > 1 else None
            a, w, a_scale, w_scale = _operands(m, k, n, True, True, device, columns)
            ws, w_scales = (w, w_scale) if columns else ([w], [w_scale])
            exact = [lambda w=w1, s=s1: torch._scaled_mm(a, w, a_scale, s, out_dtype=torch.bfloat16) for w1, s1 in zip(ws, w_scales)]
            ref = torch.cat([run() for run in exact], dim=1)
            runners = {"cublas_exact": lambda: [run() for run in exact]}
            errors = {}
            make = _consumer_run if op == "all_gather_matmul" else _producer_run
            for config in CANDIDATES:
                try:
                    run, result = make(a, w, a_scale, w_scale, 2, config, False)
                    run()
                    torch.cuda.synchronize()
                except Exception as e:  # a config that does not fit (shared memory) is reported
                    print(f"{name} {config}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                errors[str(config)] = relative_error(result(), ref)
                runners[str(config)] = run
            times, _ = time_interleaved({k: _graphed(r) for k, r in runners.items()}, device, args.rounds, 10, 3)
            base = times["cublas_exact"]
            row = {"op": op, "shape": name, "cublas_exact_us": round(base, 1),
                   "ratio": {k: round(t / base, 3) for k, t in times.items() if k != "cublas_exact"},
                   "errors": {k: float(f"{e:.2e}") for k, e in errors.items()}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, f, indent=1)
    names = [str(c) for c in CANDIDATES]
    print("| op | shape | cuBLAS exact µs | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['op']} | {r['shape']} | {r['cublas_exact_us']} | " + " | ".join(str(r["ratio"].get(c, "-")) for c in names) + " |")


if __name__ == "__main__":
    main()
