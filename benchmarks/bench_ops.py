"""Benchmark of the overlap ops against NCCL + cuBLAS and PyTorch's async TP.

    torchrun --nproc-per-node 4 -m benchmarks.bench_ops --op all_gather_matmul --out ag.json [--png ag.png]
    torchrun --nproc-per-node 4 -m benchmarks.bench_ops --op matmul_reduce_scatter --out rs.json
    torchrun --nproc-per-node 2 -m benchmarks.bench_ops --op all_gather_matmul --float8 rowwise --out ag8.json
    python3 -m benchmarks.bench_ops --emulate 8 --op all_gather_matmul --graph --out ag_e8.json  # one GPU
    python3 -m benchmarks.bench_ops --render ag.json     # the tables of an earlier run, on any machine

Hardware: W CUDA GPUs of one host (NVLink), one process per GPU under torchrun; or with
--emulate W one GPU, rank 0 of an emulated world (benchmarks/emulated/), every time "emulated".

Per shape (bf16; B a linear weight N x K used transposed), all in one process, interleaved round
by round in a shuffled order so drift hits every variant alike: mm alone, the NCCL collective
alone, NCCL + cuBLAS, torch async TP (torch.ops.symm_mem.fused_all_gather_matmul /
fused_matmul_reduce_scatter), overlap as the op runs it (its per-shape choice), and each overlap
variant. all_gather_matmul: A is M x K sharded along M; matmul_reduce_scatter: A is M x K (K the
rank's slice) and the M x N product is reduce-scattered along M. A time is the median over rounds
of the mean per call of a round, on the slowest rank. ideal = max(mm, collective); hidden =
(NCCL+cuBLAS - overlap) / (NCCL+cuBLAS - ideal). Outputs of torch async TP and overlap are
checked against NCCL + cuBLAS. --split gives the all-gather shapes the models' separate weights
(Q, K, V; up, gate) in one call of each. --float8 runs the float8 ops (all_gather_scaled_matmul,
scaled_matmul_reduce_scatter) against NCCL + _scaled_mm and torch's fused_all_gather_scaled_matmul
/ fused_scaled_matmul_reduce_scatter, on the same shapes.
"""

import argparse
import functools
import json
import os
import random
import statistics

# NVLink multicast off in every process; waits bounded to seconds, not the default ten minutes
from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import emulated  # noqa: E402
from benchmarks.measure import relative_error, slowest  # noqa: E402

# (name, M, K, N) per op and world size: Llama 3 8B's and 70B's projections and a wide shape
SHAPES = {
    "all_gather_matmul": {
        4: [("llama3-8b qkv", 8192, 4096, 1536), ("llama3-8b up+gate", 8192, 4096, 7168),
            ("llama3-70b qkv", 8192, 8192, 2560), ("llama3-70b up+gate", 8192, 8192, 14336),
            ("wide", 4096, 16384, 6656)],
        2: [("llama3-8b qkv", 8192, 4096, 3072), ("llama3-8b up+gate", 8192, 4096, 14336),
            ("llama3-70b qkv", 8192, 8192, 5120), ("llama3-70b up+gate", 8192, 8192, 28672),
            ("wide", 4096, 16384, 6656)],
        8: [("llama3-8b qkv", 8192, 4096, 768), ("llama3-8b up+gate", 8192, 4096, 3584),
            ("llama3-70b qkv", 8192, 8192, 1280), ("llama3-70b up+gate", 8192, 8192, 7168),
            ("wide", 4096, 16384, 6656)],
    },
    "matmul_reduce_scatter": {
        4: [("llama3-8b o", 8192, 1024, 4096), ("llama3-8b down", 8192, 3584, 4096),
            ("llama3-70b o", 8192, 2048, 8192), ("llama3-70b down", 8192, 7168, 8192)],
        2: [("llama3-8b o", 8192, 2048, 4096), ("llama3-8b down", 8192, 7168, 4096),
            ("llama3-70b o", 8192, 4096, 8192), ("llama3-70b down", 8192, 14336, 8192)],
        8: [("llama3-8b o", 8192, 512, 4096), ("llama3-8b down", 8192, 1792, 4096),
            ("llama3-70b o", 8192, 1024, 8192), ("llama3-70b down", 8192, 3584, 8192)],
    },
}  # fmt: skip
COLLECTIVE = {"all_gather_matmul": "all-gather", "matmul_reduce_scatter": "reduce-scatter"}
# --split: the weights an all-gather shape's N is the columns of, in the models' proportions
# (Llama 3's grouped-query Q, K, V; the FFN's up and gate), one op call over all of them as the
# models make it
WEIGHTS = {
    "llama3-8b qkv": (4, 1, 1), "llama3-8b up+gate": (1, 1),
    "llama3-70b qkv": (8, 1, 1), "llama3-70b up+gate": (1, 1),
}  # fmt: skip


def weight_columns(name: str, n: int, split: bool) -> list[int]:
    """N split as WEIGHTS says for shape ``name`` (the extra-M rows named after theirs), else
    [N]."""
    parts = WEIGHTS.get(name.split(" M=")[0]) if split else None
    return [n * p // sum(parts) for p in parts] if parts else [n]
EXTRA_MS = (2048, 16384)


def shapes_for(op: str, world: int, extra_ms: bool) -> list[tuple]:
    base = SHAPES[op].get(world, SHAPES[op][4])
    rows = list(base)
    if extra_ms:
        rows += [(f"{name} M={m}", m, k, n) for name, _, k, n in base for m in EXTRA_MS]
    return rows


def _time(runners: dict, args, device, per_round=None) -> dict:
    """Per runner: the slowest rank's median over rounds of the mean time of one call (µs).
    Rounds interleave the runners in a shuffled order; each runner starts from an idle GPU on
    every rank."""
    per_round = per_round or args.calls
    samples = {v: [] for v in runners}
    order = list(runners)
    shuffle = random.Random(0)  # the same order on every rank
    for round_ in range(args.warmup + args.rounds):
        shuffle.shuffle(order)  # no variant always follows the same one
        for vname in order:
            fn = runners[vname]
            torch.cuda.synchronize(device)
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_round):
                fn()
            end.record()
            if round_ >= args.warmup:
                samples[vname].append((start, end))
    torch.cuda.synchronize(device)
    return {
        v: slowest(statistics.median(s.elapsed_time(e) * 1e3 / args.calls for s, e in pairs), device)
        for v, pairs in samples.items()
    }


def _captured(variants: dict, calls: int) -> dict:
    """Each variant's ``calls`` calls captured in one CUDA graph (host time out of the
    picture); a variant that cannot be captured is left out on every rank."""
    graphs = {}
    for vname, fn in variants.items():
        graph = torch.cuda.CUDAGraph()
        ok = torch.ones(1, device="cuda")
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
        except Exception as e:
            print(f"rank {dist.get_rank()}: {vname} cannot be captured: {str(e)[:200]}", flush=True)
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            graphs[vname] = graph.replay
    return graphs


def _all_gather_matmul_runners(m, k, ns, device, group_name) -> tuple[dict, str]:
    """The runners of one all-gather + matmul shape over weights of ``ns`` columns (each
    runner's outputs a list, one per weight), and its choice key."""
    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import choose, dispatch

    world = dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    shard = torch.randn(m // world, k, device=device, dtype=torch.bfloat16, generator=gen)
    bs = [_weight(n, k, device, seed=7 + i).t() for i, n in enumerate(ns)]
    full = torch.empty(m, k, device=device, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(full, shard)
    args = (shard, bs, [None] * len(bs), 0, world, group_name)
    runners = {
        "mm": lambda: [torch.mm(full, b) for b in bs],
        "collective": lambda: dist.all_gather_into_tensor(full, shard),
        "nccl_cublas": lambda: agm.nccl_cublas(*args)[1],
        "torch_async_tp": lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, bs, 0, group_name)[1],
        "overlap": lambda: torch.ops.overlap.all_gather_matmul(*args)[1],
    }
    for vname, fn in agm.variants(len(bs)).items():
        if vname != "nccl_cublas":
            runners[f"overlap[{vname}]"] = lambda fn=fn: fn(*args)[1]
    shapes = dispatch.all_gather_matmul_shapes(shard.shape, bs, [None] * len(bs), 0)
    return runners, choose.shape_key(agm.KIND, world, shapes, shard.dtype)


def _matmul_reduce_scatter_runners(m, k, n, device, group_name) -> tuple[dict, str]:
    """The runners of one matmul + reduce-scatter shape, and its choice key."""
    from overlap_pass.lowering import choose, dispatch
    from overlap_pass.lowering import matmul_reduce_scatter as mrs
    from overlap_pass.templates import gemm

    world = dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    b = _weight(n, k, device).t()
    product = torch.mm(a, b)
    scattered = product.new_empty(m // world, n)
    args = ([a], [b], None, "sum", 0, world, group_name)
    runners = {
        "mm": lambda: torch.mm(a, b),
        "collective": lambda: dist.reduce_scatter_tensor(scattered, product),
        "nccl_cublas": lambda: mrs.nccl_cublas(*args),
        "torch_async_tp": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name),
        "overlap": lambda: torch.ops.overlap.matmul_reduce_scatter(*args),
    }
    for vname, fn in mrs.variants(1).items():
        if vname != "nccl_cublas":
            runners[f"overlap[{vname}]"] = lambda fn=fn: fn(*args)
    # the fused producer with the owner's sum as a kernel of its own, for comparison
    apart = functools.partial(mrs.fused, gemm_config=gemm.CONFIGS[0], reduce_in_epilogue=False)
    runners[f"overlap[fused:{gemm.CONFIGS[0]}, sum apart]"] = lambda: apart(*args)
    shapes = dispatch.matmul_reduce_scatter_shapes([a.shape], [b], False, "sum", 0)
    return runners, choose.shape_key(mrs.KIND, world, shapes, a.dtype)


FP8 = torch.float8_e4m3fn


def _float8_operands(rows, k, ns, device, recipe, gen) -> tuple:
    """float8 rows [rows, K] (values O(1), varying per rank), linears' float8 weights as [K, N]
    (column-major, the same on every rank), one per entry of ``ns``, and their scales
    (tensorwise: one value; rowwise: one per row, [1, N] for a weight)."""
    a = torch.randn(rows, k, device=device, generator=gen).to(FP8)
    rowwise = recipe == "rowwise"
    a_scale = torch.rand((rows, 1) if rowwise else (), device=device, generator=gen) + 0.5
    bs, b_scales = [], []
    for i, n in enumerate(ns):
        bs.append((_weight(n, k, device, seed=7 + i) * k**0.5).to(FP8).t())
        weight_gen = torch.Generator(device=device).manual_seed(8 + i)
        b_scales.append(torch.rand((1, n) if rowwise else (), device=device, generator=weight_gen) / k**0.5)
    return a, bs, a_scale, b_scales


def _all_gather_scaled_matmul_runners(m, k, ns, device, group_name, recipe) -> tuple[dict, str]:
    """The runners of one float8 all-gather + _scaled_mm shape over weights of ``ns`` columns
    (fast accumulation, bf16 out, as torchao's forward; outputs as lists), and its choice
    key."""
    from overlap_pass.lowering import choose, dispatch, scaled

    world = dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    shard, bs, shard_scale, b_scales = _float8_operands(m // world, k, ns, device, recipe, gen)
    full = torch.empty(m, k, device=device, dtype=torch.uint8)
    gathered_scale = shard_scale
    if recipe == "rowwise":
        gathered_scale = shard_scale.new_empty(m, 1)
        dist.all_gather_into_tensor(gathered_scale, shard_scale)
    dist.all_gather_into_tensor(full, shard.view(torch.uint8))
    full = full.view(FP8)
    bf16, count = torch.bfloat16, len(bs)
    args = (shard, shard_scale, bs, b_scales, [None] * count, 0, world, group_name, bf16, True)

    def mm():
        return [
            torch._scaled_mm(full, b, gathered_scale, s, out_dtype=bf16, use_fast_accum=True)
            for b, s in zip(bs, b_scales)
        ]

    runners = {
        "mm": mm,
        "collective": lambda: dist.all_gather_into_tensor(full.view(torch.uint8), shard.view(torch.uint8)),
        "nccl_cublas": lambda: scaled.all_gather_nccl_scaled_mm(*args)[1],
        "torch_async_tp": lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            shard, bs, shard_scale, b_scales, 0, group_name, [None] * count, [None] * count, [bf16] * count,
            [True] * count,
        )[1],
        "overlap": lambda: torch.ops.overlap.all_gather_scaled_matmul(*args)[1],
    }
    for vname, fn in scaled.variants(scaled.AG_KIND).items():
        if vname != "nccl_cublas":
            runners[f"overlap[{vname}]"] = lambda fn=fn: fn(*args)[1]
    shapes = dispatch.all_gather_scaled_matmul_shapes(
        shard, shard_scale, bs, b_scales, [None] * count, 0, bf16, True
    )
    return runners, choose.shape_key(scaled.AG_KIND, world, shapes, shard.dtype)


def _scaled_matmul_reduce_scatter_runners(m, k, n, device, group_name, recipe) -> tuple[dict, str]:
    """The runners of one float8 _scaled_mm + reduce-scatter shape (bf16 partials), and its
    choice key."""
    from overlap_pass.lowering import choose, dispatch, scaled

    world = dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    a, (b,), a_scale, (b_scale,) = _float8_operands(m, k, [n], device, recipe, gen)
    bf16 = torch.bfloat16
    product = torch._scaled_mm(a, b, a_scale, b_scale, out_dtype=bf16, use_fast_accum=True)
    scattered = product.new_empty(m // world, n)
    args = ([a], [a_scale], [b], [b_scale], None, "sum", 0, world, group_name, bf16, None, True)
    runners = {
        "mm": lambda: torch._scaled_mm(a, b, a_scale, b_scale, out_dtype=bf16, use_fast_accum=True),
        "collective": lambda: dist.reduce_scatter_tensor(scattered, product),
        "nccl_cublas": lambda: scaled.nccl_scaled_mm_reduce_scatter(*args),
        "torch_async_tp": lambda: torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            a, b, a_scale, b_scale, "sum", 0, 0, group_name, [m, n], out_dtype=bf16, use_fast_accum=True
        ),
        "overlap": lambda: torch.ops.overlap.scaled_matmul_reduce_scatter(*args),
    }
    for vname, fn in scaled.variants(scaled.RS_KIND).items():
        if vname != "nccl_cublas":
            runners[f"overlap[{vname}]"] = lambda fn=fn: fn(*args)
    shapes = dispatch.scaled_matmul_reduce_scatter_shapes(
        [a], [a_scale], [b], [b_scale], None, "sum", 0, bf16, None, True
    )
    return runners, choose.shape_key(scaled.RS_KIND, world, shapes, a.dtype)


def _weight(n, k, device, seed=7) -> torch.Tensor:
    """A linear's N x K weight, the same on every rank, scaled to keep outputs O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) / k**0.5


def _side_by_side(out) -> torch.Tensor:
    """A runner's output, its weights' outputs side by side (checked only, never timed)."""
    return torch.cat(out, dim=1) if isinstance(out, (list, tuple)) else out


def bench_shape(op, name, m, k, n, args, device, group_name) -> dict:
    from overlap_pass.lowering import choose

    gather = op == "all_gather_matmul"
    ns = weight_columns(name, n, args.split) if gather else [n]
    width = ns if gather else n  # the all-gather runners take the weights' columns
    if args.float8:
        setup = _all_gather_scaled_matmul_runners if gather else _scaled_matmul_reduce_scatter_runners
        runners, key = setup(m, k, width, device, group_name, args.float8)
    else:
        setup = _all_gather_matmul_runners if gather else _matmul_reduce_scatter_runners
        runners, key = setup(m, k, width, device, group_name)
    reference = _side_by_side(runners["nccl_cublas"]())
    errors = {  # overlap's first call: the per-shape choice happens here
        v: relative_error(_side_by_side(runners[v]()), reference) for v in ("torch_async_tp", "overlap")
    }
    us = _time(runners, args, device)
    us_graph = _time(_captured(runners, args.calls), args, device, per_round=1) if args.graph else None
    ideal = max(us["mm"], us["collective"])
    saveable = us["nccl_cublas"] - ideal

    def hidden(t):
        return (us["nccl_cublas"] - t) / saveable if saveable > 0 else float("nan")

    return {
        "op": op, "shape": name, "M": m, "K": k, "N": n, "weights": ns, "world": dist.get_world_size(), "us": us,
        "dtype": f"float8 {args.float8}" if args.float8 else "bf16",
        "us_graph": us_graph, "ideal": ideal, "chosen": choose.CHOICES.get(key, {}).get("choice"),
        "hidden_overlap": hidden(us["overlap"]), "hidden_torch_async_tp": hidden(us["torch_async_tp"]),
        "speedup_overlap": us["nccl_cublas"] / us["overlap"],
        "speedup_torch_async_tp": us["nccl_cublas"] / us["torch_async_tp"],
        "rel_error": errors,
    }  # fmt: skip


def summary_table(rows: list[dict], timings: str = "us") -> str:
    """One markdown line per shape from ``row[timings]`` ("us": eager calls, "us_graph": CUDA
    graph replays): baselines, overlap as the op runs it (its chosen variant), its best variant,
    speedups, and hidden = (NCCL+cuBLAS - t) / (NCCL+cuBLAS - ideal) for overlap and async TP."""
    head = (
        f"| shape | M | K | N | mm | {COLLECTIVE[rows[0].get('op', 'all_gather_matmul')] if rows else 'collective'} "
        "| ideal | NCCL+cuBLAS | torch async TP "
        "| overlap (chosen variant) | best overlap variant | vs NCCL+cuBLAS | vs async TP "
        "| hidden: overlap / async TP |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r[timings]
        collective = t["collective"] if "collective" in t else t["all_gather"]  # older runs' name
        ideal = max(t["mm"], collective)
        base, tp, ov = t["nccl_cublas"], t["torch_async_tp"], t["overlap"]
        saveable = base - ideal

        def hidden(x):
            return f"{(base - x) / saveable:.0%}" if saveable > 0 else "-"

        best_name, best = min(((v[8:-1], x) for v, x in t.items() if v.startswith("overlap[")), key=lambda p: p[1])
        lines.append(
            f"| {r['shape']} | {r['M']} | {r['K']} | {r['N']} | {t['mm']:.0f} | {collective:.0f} "
            f"| {ideal:.0f} | {base:.0f} | {tp:.0f} | {ov:.0f} ({r['chosen']}) | {best:.0f} ({best_name}) "
            f"| {base / ov:.2f}x | {tp / ov:.2f}x | {hidden(ov)} / {hidden(tp)} |"
        )
    return "\n".join(lines)


def print_tables(meta: dict, rows: list[dict]) -> None:
    print(json.dumps(meta))
    if meta.get("emulated"):
        print(f"\nEMULATED (one GPU, rank 0 of W={meta['world']}):\n{meta['emulated']}")
    print("\nEager calls, us per call:")
    print(summary_table(rows, "us"))
    if rows and rows[0].get("us_graph"):
        print("\nCUDA graph replay, us per call:")
        print(summary_table(rows, "us_graph"))


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["shape"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["speedup_torch_async_tp"] for r in rows], width, label="torch async TP")
    ax.bar([i + width / 2 for i in x], [r["speedup_overlap"] for r in rows], width, label="overlap")
    ax.bar(list(x), [r["us"]["nccl_cublas"] / r["ideal"] for r in rows], 0.9, fill=False, edgecolor="gray", label="ideal")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup over NCCL + cuBLAS")
    ax.set_title(f"{rows[0].get('op', 'all_gather_matmul')}, W={rows[0]['world']}, {rows[0].get('dtype', 'bf16')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=sorted(SHAPES), default="all_gather_matmul")
    parser.add_argument("--out", default="bench_ops.json")
    parser.add_argument("--png", default=None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--extra-ms", action="store_true", help="also M=2048 and M=16384 per shape")
    parser.add_argument("--only", default=None, help="shapes whose name contains one of these (comma-separated)")
    parser.add_argument("--graph", action="store_true", help="also time each variant replayed from a CUDA graph")
    parser.add_argument(
        "--split", action="store_true",
        help="all-gather shapes over the models' separate weights (WEIGHTS: Q, K, V; up, gate), one call",
    )  # fmt: skip
    parser.add_argument("--render", default=None, help="print the tables of an earlier run's JSON and exit")
    parser.add_argument(
        "--float8", choices=("tensorwise", "rowwise"), default=None,
        help="the float8 ops (e4m3 operands, these scales, fast accumulation, bf16 out) instead of bf16",
    )  # fmt: skip
    emulated.add_argument(parser)
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        print_tables(saved["meta"], saved["rows"])
        return

    import overlap_pass  # noqa: F401  (registers the ops)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    world = emulated.init_process_group(device, args.emulate)
    group_name = dist.group.WORLD.group_name
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)  # torch's async TP needs it on 2.11
    meta = {
        "device": torch.cuda.get_device_name(), "world": dist.get_world_size(),
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "rounds": args.rounds, "calls": args.calls, "dtype": f"float8 {args.float8}" if args.float8 else "bf16",
        "split": args.split, "emulated": world and world.describe(),
    }  # fmt: skip
    rows = []
    meta["op"] = args.op
    for name, m, k, n in shapes_for(args.op, dist.get_world_size(), args.extra_ms):
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        rows.append(bench_shape(args.op, name, m, k, n, args, device, group_name))
        if dist.get_rank() == 0:
            r = rows[-1]
            print(f"{name}: overlap {r['us']['overlap']:.0f} us ({r['chosen']}), NCCL+cuBLAS "
                  f"{r['us']['nccl_cublas']:.0f}, async TP {r['us']['torch_async_tp']:.0f}, "
                  f"errors {r['rel_error']}", flush=True)  # fmt: skip
            with open(args.out, "w") as f:  # after every shape: a cut-off run keeps its rows
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if dist.get_rank() == 0:
        if args.png:
            try:
                chart(rows, args.png)
            except ImportError:
                print("matplotlib is not installed: no chart")
        print_tables(meta, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
