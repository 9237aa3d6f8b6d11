"""The fused kernels' GEMM alone on one GPU, against cuBLAS on the same operands.

Hardware: one CUDA GPU (the TMA configs need Hopper or newer; the Gluon float8 kernels need
Hopper, sm_90, and are left out elsewhere). No communication is timed.

    python3 -m benchmarks.bench_gemm --out gemm.json                     # bf16
    python3 -m benchmarks.bench_gemm --float8 rowwise --out gemm8.json   # float8, fast accumulation
    python3 -m benchmarks.bench_gemm --float8 rowwise --split --graphs    # Q, K, V apart; graph replays
    python3 -m benchmarks.bench_gemm --float8 rowwise --sums --graphs     # their input gradients' sums

Per bench_ops shape at world size ``--world`` (its chunking; one GPU, no peers): the all-gather
consumer with every chunk already arrived (all flags set, so it never waits) and the
reduce-scatter producer storing each chunk's partial into buffers of this GPU, each config the
variants take (gemm.CONFIGS' TMA ones, or gemm.FLOAT8_CONFIGS, one exact-accumulation run and,
on Hopper, the Gluon consumer's and producer's pingpong.CONFIGS, fast and exact), against
torch.mm (bf16) or _scaled_mm (float8: e4m3, bf16 out, the same scales and accumulation, as the
ops' cuBLAS variants run it: scaled_ops.scaled_mm_rows). What a fused variant's GEMM costs
before any communication: at W ranks it can beat NCCL + cuBLAS only if the collective it hides
is longer than this GEMM's lag behind cuBLAS. A time is the median over interleaved rounds (in
shuffled order) of the mean per call (benchmarks/measure.time_interleaved). ``--split``: the
all-gather shapes as the models' separate weights (bench_ops.WEIGHTS) in one consumer call,
against cuBLAS on each weight; ``--graphs``: every runner timed as a CUDA graph replay, as the
ops run inside compiled models; ``--sums``: instead, the backward's input gradients of those
separate weights, one Gluon producer launch summing them against cuBLAS per weight plus adds.
"""

import argparse
import json
import types

import torch
import triton

from overlap_pass.ops.scaled_ops import scaled_mm_rows

from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import all_gather_matmul_pingpong as pingpong
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer
from overlap_pass.templates import matmul_reduce_scatter_pingpong as producer_pingpong
from benchmarks.bench_ops import SHAPES, WEIGHTS, weight_columns
from benchmarks.measure import relative_error, time_interleaved

EPOCH = 1
FP8 = torch.float8_e4m3fn
# the Gluon float8 consumer, in the place of the all_gather_matmul module _consumer_run calls
_PINGPONG = types.SimpleNamespace(all_gather_matmul_consumer=pingpong.all_gather_matmul_pingpong, Scales=consumer.Scales)
# the Gluon float8 producer, in the place of the matmul_reduce_scatter module _producer_run calls
_PINGPONG_PRODUCER = types.SimpleNamespace(matmul_reduce_scatter_producer=producer_pingpong.matmul_reduce_scatter_pingpong)


def _operands(m, k, n, float8, rowwise, device, columns=None):
    """A [m, k], a linear's weight as [k, n] (column-major) and their scales (None for bf16); with
    ``columns``, lists of weights and weight scales of those widths instead."""
    a = torch.randn(m, k, device=device)
    a_scale = None
    if float8:
        a_scale = torch.rand(m, 1, device=device) + 0.5 if rowwise else torch.tensor(0.7, device=device)
    ws, w_scales = [], []
    for cols in columns or [n]:
        w = torch.randn(cols, k, device=device)
        ws.append(w.to(FP8).t() if float8 else w.bfloat16().t())
        if float8:
            w_scales.append(torch.rand(1, cols, device=device) + 0.5 if rowwise else torch.tensor(0.9, device=device))
    a = a.to(FP8) if float8 else a.bfloat16()
    if columns is None:
        return a, ws[0], a_scale, w_scales[0] if float8 else None
    return a, ws, a_scale, w_scales if float8 else None


def _consumer_run(a, w, a_scale, w_scale, world, config, fast_accum, module=consumer):
    """A runner of the consumer (``module``: the all_gather_matmul module, or another version of
    it, as probes compare) and a function returning its output (the outputs side by side where
    ``w`` and ``w_scale`` are lists: one call over several weights)."""
    ws = w if isinstance(w, list) else [w]
    w_scales = w_scale if isinstance(w_scale, list) else [w_scale]
    m = a.shape[0]
    inner = m // world
    outs = [torch.full((m, w.shape[1]), float("nan"), dtype=torch.bfloat16, device=a.device) for w in ws]  # poisoned
    flags = torch.full((world,), EPOCH, dtype=torch.int32, device=a.device)
    epoch = torch.tensor([EPOCH], dtype=torch.int32, device=a.device)
    timeouts = torch.zeros(world, dtype=torch.int32, device=a.device)
    scales = None
    if a_scale is not None:
        flat = a_scale.reshape(-1).contiguous()
        b_scales = tuple(s.reshape(-1) for s in w_scales)
        scales = module.Scales(flat, flat[:inner] if flat.numel() > 1 else None, b_scales, fast_accum)

    def run():
        module.all_gather_matmul_consumer(
            a, ws, [None] * len(ws), outs, flags, epoch, rank=0, world_size=world, inner=inner, config=config,
            timeouts=timeouts, scales=scales,
        )  # fmt: skip

    return run, lambda: torch.cat(outs, dim=1)


def _producer_run(a, w, a_scale, w_scale, world, config, fast_accum, module=producer):
    """As _consumer_run, for the producer (``module``: the matmul_reduce_scatter module); where
    ``a``, ``w`` and their scales are lists, over their sum (the Gluon producer's terms)."""
    terms = {}
    if isinstance(a, list):
        flat = lambda s: s.reshape(-1).contiguous()  # noqa: E731
        rest = zip(a[1:], w[1:], a_scale[1:], w_scale[1:])
        terms = {"terms": [(a1, w1, (flat(s1), flat(t1))) for a1, w1, s1, t1 in rest]}
        a, w, a_scale, w_scale = a[0], w[0], a_scale[0], w_scale[0]
    m, n = a.shape[0], w.shape[1]
    dests = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=a.device) for _ in range(world)]
    flags = torch.zeros(world, dtype=torch.int32, device=a.device)
    dest_ptrs = torch.tensor([d.data_ptr() for d in dests], dtype=torch.int64, device=a.device)
    flag_ptrs = torch.tensor([flags[j].data_ptr() for j in range(world)], dtype=torch.int64, device=a.device)
    counters = torch.zeros(world, dtype=torch.int32, device=a.device)
    epoch = torch.tensor([EPOCH], dtype=torch.int32, device=a.device)
    scales = None if a_scale is None else (a_scale.reshape(-1).contiguous(), w_scale.reshape(-1).contiguous())

    def run():
        module.matmul_reduce_scatter_producer(
            a, w, None, dest_ptrs, flag_ptrs, counters, epoch, rank=0, world_size=world, config=config,
            scales=scales, out_dtype=torch.bfloat16, fast_accum=fast_accum, **terms,
        )  # fmt: skip

    # the kernel writes through the addresses in dest_ptrs and flag_ptrs on every call: their
    # tensors must live as long as run (a freed flags block reused for another runner's
    # dest_ptrs got the flag's epoch written into it: misaligned stores)
    run.buffers = (dests, flags)
    rows = m // world
    # chunk j's partial lands in dests[j], rows of slot 0: gather them back into A's row order
    return run, lambda: torch.cat([d[:rows] for d in dests])


def _graphed(run):
    """``run`` captured once in a CUDA graph (after a warm-up call): its replay, with no host
    launch cost, as the ops' per-call graphs run (lowering/replay.py)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def replay():
        graph.replay()

    replay.kept = run  # the tensors the graph reads and writes
    return replay


def bench_shape(op, name, m, k, n, args, device) -> dict:
    float8 = args.float8 is not None
    columns = weight_columns(name, n, args.split) if op == "all_gather_matmul" else [n]
    columns = columns if len(columns) > 1 else None
    a, w, a_scale, w_scale = _operands(m, k, n, float8, args.float8 == "rowwise", device, columns)
    ws, w_scales = (w, w_scale) if columns else ([w], [w_scale])
    def cublas(fast_accum=True):
        """cuBLAS on each weight, as the ops' NCCL + cuBLAS variant runs them."""
        if not float8:
            return lambda: [torch.mm(a, w1) for w1 in ws]
        bf16 = torch.bfloat16
        return lambda: [scaled_mm_rows(a, a_scale, w1, s1, None, bf16, fast_accum) for w1, s1 in zip(ws, w_scales)]

    runners = {"cublas": cublas()}
    ref = torch.cat(runners["cublas"](), dim=1)  # the outputs side by side
    if float8:  # exact accumulation: what the fused kernels' exact runs compare with
        runners["cublas_exact"] = cublas(fast_accum=False)
    make = _consumer_run if op == "all_gather_matmul" else _producer_run
    configs = gemm.FLOAT8_CONFIGS if float8 else [c for c in gemm.CONFIGS if c.tma]
    errors = {}
    runs = [(str(c), c, True, None) for c in configs]
    if float8:  # exact accumulation (use_fast_accum=False) on the first config
        runs.append((f"{configs[0]}:exact", configs[0], False, None))
    if float8 and pingpong.usable(device):  # the Gluon consumer or producer
        gluon = _PINGPONG if op == "all_gather_matmul" else _PINGPONG_PRODUCER
        runs += [(str(c), c, True, gluon) for c in pingpong.CONFIGS]
        runs += [(f"{c}:exact", c, False, gluon) for c in pingpong.CONFIGS]  # the cooperative form
    for key, config, fast, module in runs:
        run, result = make(a, w, a_scale, w_scale, args.world, config, fast, *([module] if module else []))
        run()
        errors[key] = relative_error(result(), ref)
        runners[key] = run
    if float8 and columns and pingpong.usable(device):  # the Gluon consumer a launch per weight, as before
        config = pingpong.CONFIGS[0]
        singles = [_consumer_run(a, w1, a_scale, s1, args.world, config, True, _PINGPONG) for w1, s1 in zip(ws, w_scales)]
        key = f"{config}:per_weight"
        runners[key] = lambda: [run() for run, _ in singles]
        runners[key]()
        errors[key] = relative_error(torch.cat([result() for _, result in singles], dim=1), ref)
    times, timed = _timed(runners, errors, args, device)
    flops = 2 * m * k * n
    return {
        "op": op, "shape": name, "M": m, "K": k, "N": n, "weights": [w1.shape[1] for w1 in ws], **timed,
        "cublas_tflops": round(flops / times["cublas"] / 1e6, 1),
        "best_tflops": round(flops / times[timed["best"]] / 1e6, 1),
    }


def _timed(runners, errors, args, device) -> tuple[dict, dict]:
    """Every runner timed (as a CUDA graph replay with --graphs): the times (µs), and the row's
    rounded times, errors and best (the fastest fused run with fast accumulation)."""
    if args.graphs:
        runners = {key: _graphed(run) for key, run in runners.items()}
    times, _ = time_interleaved(runners, device, args.rounds, args.calls, args.warmup)
    best = min((key for key in times if not key.startswith("cublas") and ":" not in key), key=times.get)
    return times, {
        "times_us": {key: round(t, 1) for key, t in times.items()},
        "errors": {key: float(f"{e:.2e}") for key, e in errors.items()}, "best": best,
    }


def bench_sum(name, m, ks, n, args, device) -> dict:
    """The backward's input gradient of separate weights (Q, K, V; gate, up): a sum of
    _scaled_mm over ``ks``, reduce-scattered. cuBLAS runs a matmul per term and adds (what the
    copy engine's variant runs per chunk, scaled_mm_rows); the Gluon producer sums them in one
    launch (its cooperative form)."""
    rowwise = args.float8 == "rowwise"
    operands = [_operands(m, k, n, True, rowwise, device) for k in ks]
    a_s, w_s, a_scales, w_scales = (list(part) for part in zip(*operands))

    def cublas(fast_accum):
        def run():
            out = None
            for a, w, sa, sw in operands:
                term = scaled_mm_rows(a, sa, w, sw, None, torch.bfloat16, fast_accum)
                out = term if out is None else out.add_(term)
            return out

        return run

    runners = {"cublas": cublas(True), "cublas_exact": cublas(False)}
    ref = runners["cublas_exact"]()
    errors = {}
    for config in pingpong.CONFIGS:
        for key, fast in ((str(config), True), (f"{config}:exact", False)):
            run, result = _producer_run(a_s, w_s, a_scales, w_scales, args.world, config, fast, _PINGPONG_PRODUCER)
            run()
            errors[key] = relative_error(result(), ref)
            runners[key] = run
    _, timed = _timed(runners, errors, args, device)
    return {"op": "matmul_reduce_scatter sum", "shape": name, "M": m, "K": sum(ks), "N": n, "weights": list(ks), **timed}


def sum_shapes(world: int) -> list[tuple]:
    """(name, M, the terms' K, N): the input gradients of the all-gather shapes' separate
    weights (WEIGHTS), each weight's columns a term's K, the all-gather's K the sum's N."""
    shapes = SHAPES["all_gather_matmul"].get(world, SHAPES["all_gather_matmul"][4])
    return [(f"{name} input grad", m, weight_columns(name, n, True), k) for name, m, k, n in shapes if name in WEIGHTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None)
    parser.add_argument("--world", type=int, default=2, help="the chunking: the world size simulated")
    parser.add_argument("--op", choices=("all_gather_matmul", "matmul_reduce_scatter", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--split", action="store_true", help="Q, K, V (up, gate) as weights of their own, one call")
    parser.add_argument("--graphs", action="store_true", help="time CUDA graph replays (no host launch cost)")
    parser.add_argument(
        "--sums", action="store_true",
        help="float8 on Hopper: the reduce-scatter of the backward's input-gradient sums (Q+K+V, gate+up) instead",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    ops = list(SHAPES) if args.op == "both" else [args.op]
    rows = []
    if args.sums:
        if not (args.float8 and pingpong.usable(device)):
            parser.error("--sums times the Gluon float8 producer: needs --float8 and a Hopper GPU")
        for name, m, ks, n in sum_shapes(args.world):
            rows.append(bench_sum(name, m, ks, n, args, device))
            print(json.dumps(rows[-1]), flush=True)
        ops = []
    for op in ops:
        for name, m, k, n in SHAPES[op].get(args.world, SHAPES[op][4]):
            rows.append(bench_shape(op, name, m, k, n, args, device))
            r = rows[-1]
            print(json.dumps(r), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "triton": triton.__version__, "world_chunking": args.world,
        "dtype": f"float8 {args.float8} (fast accumulation)" if args.float8 else "bf16",
        "rounds": args.rounds, "calls": args.calls, "split": args.split, "graphs": args.graphs, "sums": args.sums,
    }  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}")
    print(
        "| op | shape | weights | cuBLAS µs | best fused µs (config) | fused / cuBLAS "
        "| exact accumulation: best fused (config) / cuBLAS µs | Gluon a launch per weight µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["times_us"]
        exacts = {key: v for key, v in t.items() if key.endswith(":exact")}
        best_exact = min(exacts, key=exacts.get) if exacts else None
        exact = f"{exacts[best_exact]} ({best_exact[:-6]}) / {t.get('cublas_exact', '-')}" if exacts else "-"
        per_weight = next((v for key, v in t.items() if key.endswith(":per_weight")), "-")
        print(
            f"| {r['op']} | {r['shape']} | {r['weights']} | {t['cublas']} | {t[r['best']]} ({r['best']}) | "
            f"{t[r['best']] / t['cublas']:.2f} | {exact} | {per_weight} |"
        )


if __name__ == "__main__":
    main()
