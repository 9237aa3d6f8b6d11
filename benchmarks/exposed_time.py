"""How much of each collective's time no computation hides: per compiler, per pass (forward,
backward) and per collective, from the GPU's own timeline (torch.profiler).

    torchrun --nproc-per-node 4 -m benchmarks.exposed_time --model block --size llama3-8b --out exposed.json

The model and its compilers are benchmarks/bench_model.py's (``--model block|mlp``, ``--layout sp|plain``,
Llama 3 sizes, 8192 tokens). After warm-up steps, ``--steps`` training steps are profiled with
the GPU idle between the forward and the backward (a synchronize), so that every GPU activity of
the trace falls in one pass by its start (the ranks in step too: a barrier). In each pass:

- communication: NCCL's kernels, peer-to-peer copies (overlap's copy-engine pushes) and
  overlap's reduction of its peers' partials (a reduce-scatter's own sum, as in NCCL's kernel);
- computation: every other kernel, overlap's fused GEMMs included (they consume or produce
  chunks as they arrive: their time counts as computation, which is what hides a collective);
- a collective's **exposed** time: the part of its activity during which no computation runs on
  any stream. The pass's exposed time is the union of those parts; the table lists the pass,
  then each collective kind, and ``--per-collective`` each collective in launch order. A second
  table sums each pass's GPU time by what it runs (GEMMs, overlap's fused GEMMs, attention,
  Inductor's kernels, ...), and the JSON keeps each pass's busiest kernels by name: where a
  compiler's computation takes longer than another's.

A waiting kernel (overlap's flag waits, the barrier) is neither: a collective running beside it
alone is exposed. Times are the median over the profiled steps, in µs: rank 0's tables are
printed (``--rank`` another's), the JSON keeps every rank's (``--traces DIR``: and
each rank's GPU timeline, for Perfetto). ``--whole-step`` accounts each step as one
pass, the backward queued right behind the forward as training runs it (no idle GPU between).

``--host`` adds the host's side of each pass: how long queuing it took and the host ranges (torch
ops, Inductor's compiled graphs, overlap's ops) that took the most of it, on any thread.
``--float8 tensorwise|rowwise`` makes every linear a torchao Float8Linear, as benchmarks/bench_model.py
does.
"""

import argparse
import json
import os
import statistics
import tempfile

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import emulated  # noqa: E402

PASSES = ("forward", "backward")
MARK = "exposed_time:"  # the profiler ranges that open each pass
BETWEEN = "between passes"  # the range that closes one (what follows until the next pass is no pass's)
# NCCL kernel names by the collective they run, as NCCL names its device kernels
NCCL_KINDS = (("AllGather", "all_gather"), ("ReduceScatter", "reduce_scatter"), ("AllReduce", "all_reduce"))
# kernels that wait for a peer rather than compute (templates/signals.py)
WAITING = ("barrier_kernel", "wait_kernel", "wait_for_peers_kernel")
# overlap's kernels that are a collective's own step: the owner's sum of its peers' partials
# (templates/matmul_reduce_scatter.py), as NCCL's reduce-scatter kernel sums; the small
# all-reduce's kernel (templates/all_reduce.py), as NCCL's all-reduce kernel
OVERLAP_COLLECTIVES = (("reduce_partials", "reduce_scatter"), ("one_shot_all_reduce", "all_reduce"))


def kind_of(event: dict) -> str:
    """"all_gather", "reduce_scatter", "all_reduce", "nccl" (another NCCL kernel), "p2p_copy",
    "waiting" or "compute" for a GPU activity of a chrome trace; "" for anything else."""
    name, category = event.get("name", ""), event.get("cat", "")
    if category == "kernel":
        if name.startswith("ncclDevKernel") or name.startswith("ncclKernel"):
            return next((kind for marker, kind in NCCL_KINDS if marker in name), "nccl")
        if name.startswith("emulated_nccl_"):  # (benchmarks/emulated/nccl_kernel.py)
            return next((kind for kind in ("all_gather", "reduce_scatter", "all_reduce") if kind in name), "nccl")
        if any(marker in name for marker in WAITING):
            return "waiting"
        return next((kind for marker, kind in OVERLAP_COLLECTIVES if marker in name), "compute")
    if category == "gpu_memcpy":
        return "p2p_copy" if "PtoP" in name or "Peer" in name else "compute"
    if category == "gpu_memset":
        return "compute"
    return ""


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _uncovered(interval: tuple[float, float], covered: list[tuple[float, float]]) -> float:
    """The length of ``interval`` outside the sorted, disjoint ``covered`` intervals."""
    start, end = interval
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in covered if a < end and b > start)
    return (end - start) - inside


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "nccl", "p2p_copy")

# what a kernel's time goes to, by its name (first match wins): where a step's GPU time goes
CATEGORIES = (
    ("overlap_fused", ("all_gather_matmul", "matmul_reduce_scatter")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "triton_tem_")),
    ("attention", ("flash", "fmha", "cudnn", "attention")),
    ("optimizer", ("multi_tensor_apply", "foreach", "adam")),
    ("inductor_fused", ("triton_",)),
)


def category_of(event: dict) -> str:
    """What a GPU activity's time goes to: a communication kind (``kind_of``'s), "waiting",
    one of ``CATEGORIES`` or "other" (an activity ``kind_of`` counts; "" for anything else)."""
    kind = kind_of(event)
    if kind != "compute":
        return kind
    name = event.get("name", "").lower()
    return next((c for c, markers in CATEGORIES if any(m in name for m in markers)), "other")


def account(events: list[dict]) -> dict:
    """One pass's account from its GPU activities (chrome trace events with ts and dur in µs):
    its span, communication and computation time (unions), the exposed communication time, the
    exposed time per collective kind, and each collective activity (kind, µs, exposed µs) in
    start order."""
    spans = [(e["ts"], e["ts"] + e["dur"], kind) for e in events if (kind := kind_of(e))]
    if not spans:
        return {
            "span_us": 0.0, "busy_us": 0.0, "communication_us": 0.0, "computation_us": 0.0, "exposed_us": 0.0,
            "by_kind": {}, "by_category": {}, "collectives": [],
        }  # fmt: skip
    compute = _union([(s, e) for s, e, k in spans if k == "compute"])
    comm = [(s, e, k) for s, e, k in sorted(spans) if k in COLLECTIVES]
    comm_union = _union([(s, e) for s, e, _ in comm])
    by_kind: dict[str, float] = {}
    for kind in COLLECTIVES:
        mine = _union([(s, e) for s, e, k in comm if k == kind])
        if mine:
            by_kind[kind] = sum(_uncovered(i, compute) for i in mine)
    by_category: dict[str, float] = {}
    for event in events:
        if category := category_of(event):
            by_category[category] = by_category.get(category, 0.0) + event["dur"]
    return {
        "span_us": max(e for _, e, _ in spans) - min(s for s, _, _ in spans),
        "busy_us": sum(e - s for s, e in _union([(s, e) for s, e, _ in spans])),
        "communication_us": sum(e - s for s, e in comm_union),
        "computation_us": sum(e - s for s, e in compute),
        "exposed_us": sum(_uncovered(i, compute) for i in comm_union),
        "by_kind": by_kind,
        "by_category": by_category,
        "collectives": [(k, e - s, _uncovered((s, e), compute)) for s, e, k in comm],
    }


def _busiest(events: list[dict], count: int) -> list[tuple[str, float, int]]:
    """The ``count`` names (cut to 90 characters) whose events took the most time in all:
    (name, µs, calls)."""
    totals: dict[str, list[float]] = {}
    for event in events:
        entry = totals.setdefault(event["name"][:90], [0.0, 0])
        entry[0] += event["dur"]
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [(name, us, int(calls)) for name, (us, calls) in ranked]


def top_kernels(events: list[dict], count: int) -> list[tuple[str, float, int]]:
    """The ``count`` GPU activities that took the most time in all, by name: (name, µs, calls)."""
    return _busiest([e for e in events if kind_of(e)], count)


def _marks(events: list[dict]) -> list[tuple[float, float, str]]:
    """The ``MARK`` ranges of a trace in time order: (start, host µs it was open, pass name)."""
    return sorted(
        (e["ts"], e.get("dur", 0.0), e["name"][len(MARK):]) for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(MARK)
    )  # fmt: skip


def split_passes(trace: dict, passes: tuple[str, ...] = PASSES) -> list[dict[str, list[dict]]]:
    """The GPU activities of a chrome trace per profiled step and pass: each pass opens at its
    ``MARK`` range (a user annotation on the host, after the GPU went idle) and takes what starts
    on the GPU from there to the next mark (a ``BETWEEN`` mark closes it); a step opens at its
    first pass's mark."""
    events = trace.get("traceEvents", [])
    marks = _marks(events)
    gpu = [e for e in events if e.get("ph") == "X" and kind_of(e)]
    steps: list[dict[str, list[dict]]] = []
    for i, (start, _, name) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        if name == passes[0]:
            steps.append({p: [] for p in passes})
        if steps and name in passes:
            steps[-1][name] = [e for e in gpu if start <= e["ts"] < end]
    return steps


def gpu_timeline(trace: dict) -> dict:
    """A chrome trace of ``trace``'s GPU activities and pass marks alone (a small file: the
    ranks of one host share its clock, so their timelines line up)."""
    kept = [
        e for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and (kind_of(e) or str(e.get("name", "")).startswith(MARK))
    ]  # fmt: skip
    return {"traceEvents": kept}


HOST_CATEGORIES = ("cpu_op", "user_annotation")  # the host's ranges: torch ops and marked regions


def host_passes(trace: dict, passes: tuple[str, ...] = PASSES, count: int = 15) -> list[dict[str, dict]]:
    """The host side of each profiled step's passes: how long each pass's mark range was open
    (the host's time to queue the pass: its ``with mark(...)`` block) and the ``count`` host
    ranges that took the most time inside it on any thread (the backward runs on autograd's),
    by name: (name, µs inclusive of what they call, calls)."""
    events = trace.get("traceEvents", [])
    marks = _marks(events)
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and not e["name"].startswith(MARK)]
    steps: list[dict[str, dict]] = []
    for start, dur, name in marks:
        if name == passes[0]:
            steps.append({})
        if not steps or name not in passes:
            continue
        inside = [e for e in ranges if start <= e["ts"] < start + dur]
        steps[-1][name] = {"host_us": dur, "ops": _busiest(inside, count)}
    return steps


def summarize_host(steps: list[dict[str, dict]], passes: tuple[str, ...] = PASSES) -> dict:
    """Per pass: the median host time over steps and the first step's busiest host ranges."""
    out = {}
    for name in passes:
        found = [step[name] for step in steps if name in step]
        if found:
            out[name] = {"host_us": statistics.median(f["host_us"] for f in found), "ops": found[0]["ops"]}
    return out


def host_table(results: dict, count: int = 8) -> str:
    lines = ["| compiler | pass | host (µs) | busiest host ranges: inclusive µs (calls) |", "|---|---|---|---|"]
    for compiler, passes in results.items():
        for name, r in passes.items():
            ops = "; ".join(f"{n} {us:.0f} ({calls})" for n, us, calls in r["ops"][:count])
            lines.append(f"| {compiler} | {name} | {r['host_us']:.0f} | {ops} |")
    return "\n".join(lines)


def summarize(steps: list[dict[str, list[dict]]], passes: tuple[str, ...] = PASSES) -> dict:
    """Per pass: the median over steps of each number of ``account``; the collectives of the
    first step."""
    out = {}
    for name in passes:
        accounts = [account(step[name]) for step in steps if step.get(name)]
        if not accounts:
            continue
        out[name] = {
            key: statistics.median(a[key] for a in accounts)
            for key in ("span_us", "busy_us", "communication_us", "computation_us", "exposed_us")
        }
        for key in ("by_kind", "by_category"):
            names = sorted({k for a in accounts for k in a[key]})
            out[name][key] = {k: statistics.median(a[key].get(k, 0.0) for a in accounts) for k in names}
        out[name]["collectives"] = accounts[0]["collectives"]
        first = next(step[name] for step in steps if step.get(name))
        out[name]["top_kernels"] = top_kernels(first, TOP_KERNELS)
    return out


TOP_KERNELS = 25  # the busiest GPU activities of a pass kept in the JSON, by name


def category_table(results: dict) -> str:
    """Where each pass's GPU time goes: the summed durations of its activities by
    ``category_of`` (streams overlap: the column can add up past the span), µs."""
    categories = sorted({k for passes in results.values() for r in passes.values() for k in r["by_category"]})
    lines = ["| compiler | pass | " + " | ".join(categories) + " |", "|---|---|" + "---|" * len(categories)]
    for compiler, passes in results.items():
        for name, r in passes.items():
            cells = " | ".join(f"{r['by_category'].get(k, 0.0):.0f}" for k in categories)
            lines.append(f"| {compiler} | {name} | {cells} |")
    return "\n".join(lines)


def table(results: dict, per_collective: bool) -> str:
    lines = [
        "| compiler | pass | span | communication | hidden | exposed | exposed by kind |",
        "|---|---|---|---|---|---|---|",
    ]
    for compiler, passes in results.items():
        for name, r in passes.items():
            hidden = r["communication_us"] - r["exposed_us"]
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in r["by_kind"].items())
            lines.append(
                f"| {compiler} | {name} | {r['span_us']:.0f} | {r['communication_us']:.0f} | {hidden:.0f} | "
                f"{r['exposed_us']:.0f} | {kinds} |"
            )
            if per_collective:
                for i, (kind, us, exposed) in enumerate(r["collectives"]):
                    lines.append(f"| | {name} #{i} | | {kind} {us:.0f} | | {exposed:.0f} | |")
    return "\n".join(lines)


def _profiled(step, steps: int, device) -> dict:
    """A chrome trace of ``steps`` calls of ``step(mark)``, which opens each pass with mark(name)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def mark(name: str):
        torch.cuda.synchronize(device)  # the GPU idle: the pass's activities all start after this
        if dist.is_initialized():  # and the ranks in step: a peer's lag is not a collective's time
            with record_function(MARK + BETWEEN):  # (the barrier's own kernel in no pass)
                dist.barrier(device_ids=[device.index])
                torch.cuda.synchronize(device)
        return record_function(MARK + name)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(mark)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("block", "mlp"), default="block")
    parser.add_argument("--layout", choices=("sp", "plain"), default="sp")
    parser.add_argument("--size", default="llama3-8b", choices=("llama3-8b", "llama3-70b"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--compilers", default="inductor,inductor_micro_pipeline_tp,overlap")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-collective", action="store_true", help="a row per collective, in launch order")
    parser.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None, help="torchao Float8 linears")
    parser.add_argument("--host", action="store_true", help="also each pass's host time and its busiest host ranges")
    parser.add_argument(
        "--whole-step", action="store_true",
        help="one pass per step, the backward queued right after the forward (as training runs it)",
    )  # fmt: skip
    parser.add_argument(
        "--traces", default=None, metavar="DIR",
        help="also write each rank's GPU timeline (and the pass marks) as DIR/<compiler>_rank<r>.json, for Perfetto",
    )  # fmt: skip
    parser.add_argument("--rank", type=int, default=0, help="the rank whose tables are printed (the JSON has every rank's)")
    parser.add_argument("--out", default="exposed_time.json")
    emulated.add_argument(parser)
    args = parser.parse_args()

    import overlap_pass  # noqa: F401  (registers the backend)
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.bench_model import SIZES, _compile, _config_of, _model

    torch._dynamo.config.recompile_limit = 64
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    world_params = emulated.init_process_group(device, args.emulate)
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)  # _micro_pipeline_tp needs it
    dim, heads, kv_heads, hidden = SIZES[args.size]
    sharded = args.layout == "sp"
    gen = torch.Generator(device=device).manual_seed(1 + (dist.get_rank() if sharded else 0))
    x = torch.randn(1, args.tokens // (world if sharded else 1), dim, device=device, dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=gen)
    passes = ("step",) if args.whole_step else PASSES
    results, host = {}, {}
    for compiler in args.compilers.split(","):
        torch.manual_seed(0)
        model = _model(args.model, dim, heads, kv_heads, hidden, mesh, args.layout, args.float8)
        model = model.to(device=device, dtype=torch.bfloat16)
        model = _compile(model, compiler)

        def step(mark, model=model, compiler=compiler):
            inp = x.detach().requires_grad_()
            with _config_of(compiler):  # (bench_model's compilers with a config knob changed)
                if args.whole_step:
                    with mark("step"):
                        model(inp).backward(grad)
                else:
                    with mark("forward"):
                        out = model(inp)
                    with mark("backward"):
                        out.backward(grad)
            for p in model.parameters():
                p.grad = None

        nothing = lambda name: torch.autograd.profiler.record_function("warm-up")  # noqa: E731
        for _ in range(args.warmup):
            step(nothing)
        trace = _profiled(step, args.steps, device)
        results[compiler] = summarize(split_passes(trace, passes), passes)
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            with open(os.path.join(args.traces, f"{compiler}_rank{dist.get_rank()}.json"), "w") as f:
                json.dump(gpu_timeline(trace), f)
        host[compiler] = summarize_host(host_passes(trace, passes), passes)
    every_rank = [None] * world
    dist.all_gather_object(every_rank, {"results": results, "host": host})
    if dist.get_rank() == 0:
        meta = {
            "model": args.model, "layout": args.layout, "size": args.size, "tokens": args.tokens, "world": world,
            "float8": args.float8, "whole_step": args.whole_step, "printed_rank": args.rank,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "emulated": world_params and world_params.describe(),
            "triton": __import__("triton").__version__,
        }  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "ranks": every_rank}, f, indent=1)
        printed = every_rank[args.rank]
        print(json.dumps(meta))
        print(table(printed["results"], args.per_collective), flush=True)
        print("\nGPU time by category (µs, summed over streams):\n" + category_table(printed["results"]), flush=True)
        if args.host:
            print("\n" + host_table(printed["host"]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
