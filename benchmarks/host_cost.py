"""Host time of one op call: overlap's fused ops against what plain Inductor's code calls for the
same work (NCCL collective, wait, cuBLAS matmul) and PyTorch's async TP ops, and where overlap's
call spends its time, layer by layer; and overlap::all_reduce against NCCL's all-reduce and wait
of the same small tensor (an amax per token row, as float8's).

    torchrun --nproc-per-node 2 -m benchmarks.host_cost --tokens 512 --dim 4096 --out host.json

A step is host-bound when queuing its work takes longer than the GPU takes to run it (small
token counts, float8, many layers): then each microsecond of Python per op call is a
microsecond of step time. Each row is the median over rounds of the host time to queue
``--calls`` back-to-back calls (the GPU idle at the start of each round, so the launch queue
never fills and blocks the host), the slowest rank's, with the GPU time next to it.

overlap's layers, outermost first (each row calls the next one down directly, so the
difference between two rows is what that layer costs):
    op:         torch.ops.overlap.<op>.default, through torch's dispatcher (as Inductor's
                generated code calls it with config.direct_op_calls off, and eager code)
    op, registered bare: the same entry point as the CUDA kernel of an op with nothing else
                registered (no tags, fake or reference kernel, no below-autograd guard)
    direct call: overlap_pass/pipeline/direct_calls.py, as Inductor's generated code calls the op
                (the CUDA kernel under its below-autograd guard, no torch dispatcher)
    dispatch:   lowering/dispatch.py's entry point
    resolved:   the variant kept for the call's signature (no signature key)
    replay:     replay.call with the outputs made beforehand (no allocation)
    workspace:  the workspace's replay (timeout checks) of the call's graph
    graph:      the CUDA graph's replay alone

The last column counts rank 0's overlap calls during the timed rounds by path (lowering/replay.py):
a call that finds no per-call graph at its tensors' addresses runs its host steps eagerly, and a
layer whose calls do so costs that much more.
"""

import argparse
import collections
import json
import os
import statistics
import time

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.measure import slowest  # noqa: E402


def _time(run, device, rounds: int, calls: int) -> tuple[float, float]:
    """(host µs, GPU µs) per call: medians over rounds, each round started on an idle GPU."""
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        for _ in range(calls):
            run()
        host.append((time.perf_counter() - begin) * 1e6 / calls)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / calls)
    return slowest(statistics.median(host), device), slowest(statistics.median(gpu), device)


def _resolved_run():
    """The variant dispatch resolved for the newest call signature."""
    from overlap_pass.lowering import dispatch

    return next(reversed(dispatch._RESOLVED.values()))


def _layers(kind: str, args, device) -> dict:
    """overlap's call of the op ``kind`` at each layer (see the module's docstring), as
    functions of no arguments."""
    from overlap_pass import config
    from overlap_pass.pipeline import direct_calls
    from overlap_pass.lowering import dispatch, replay, symm
    from overlap_pass.ops import registry

    op, entry = registry.overload(kind), getattr(dispatch, kind)
    for _ in range(3):  # measured (or cached), then captured, then replayed
        op(*args)
    run = _resolved_run()
    layers = {
        "op": lambda: op(*args),
        "direct call": lambda: direct_calls.call(kind, *args),
        "dispatch": lambda: entry(*args),
        "resolved": lambda: run(*args),
    }
    if not isinstance(run, dispatch._GraphedCall):  # the baseline: no per-call graph below
        return layers
    variant, signature = run.run, run.signature
    allocate, workspace_kind, tensors_of = dispatch._GRAPHED_KINDS[kind]
    outputs = allocate(*args)
    tensors, group_name, _ = tensors_of(args, outputs)
    ws = symm.workspace(workspace_kind, group_name, device)
    layers["replay"] = lambda: replay.call(signature, variant, args, outputs, tensors, ws)
    for _ in range(3):
        layers["replay"]()
    graph = replay._SIGNATURES[signature].graphs.get(replay.graph_key(ws, tensors, config.hot().spin_limit))
    if graph is not None:
        layers["workspace"] = lambda: ws.replay(graph)
        layers["graph"] = graph.replay
    return layers


def _op_of(name: str, schema: str, kernel):
    """An op of ``schema`` with ``kernel`` as its CUDA kernel and nothing else registered (no
    tags, fake or reference kernel)."""
    torch.library.define(f"overlap_host_cost::{name}", schema)
    torch.library.impl(f"overlap_host_cost::{name}", "CUDA", kernel)
    return getattr(torch.ops.overlap_host_cost, name).default


def _empty_op(name: str, schema: str, outputs):
    """An op of ``schema`` whose CUDA kernel returns ``outputs`` and does nothing else: what
    torch's dispatcher alone costs a Python kernel of that schema."""
    return _op_of(name, schema, lambda *args, **kwargs: outputs)


def _bare(layers: dict, op_call) -> dict:
    """``layers`` with, after "op", the same entry point under a bare registration (_op_of): what
    overlap's registration (tags, fake and reference kernels, the below-autograd guard) adds."""
    first, *rest = layers.items()
    return dict([first, ("op, registered bare", op_call), *rest])


def bench(args, device, group) -> list[dict]:
    import torch.distributed._symmetric_memory  # noqa: F401  registers torch.ops.symm_mem

    import overlap_pass  # noqa: F401  registers torch.ops.overlap
    from overlap_pass.lowering import dispatch, replay

    world, name = group.size(), group.group_name
    rank = group.rank()
    gen = torch.Generator(device=device).manual_seed(rank)
    dtype = torch.bfloat16
    rows = args.tokens // world
    shard = torch.randn(rows, args.dim, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(args.hidden, args.dim, device=device, dtype=dtype, generator=gen)  # a linear's [N, K]
    cols = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=gen)
    weight_rs = torch.randn(args.dim, args.hidden, device=device, dtype=dtype, generator=gen)
    c10d = torch.ops._c10d_functional
    ag_args = (shard, [weight.t()], [None], 0, world, name, False, [], [], [])
    rs_args = ([cols], [weight_rs.t()], None, "sum", 0, world, name, None)
    amax = torch.rand(args.tokens, device=device, generator=gen)
    ar_args = (amax, "max", world, name)

    def inductor_ag():
        gathered = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(shard, world, name))
        return torch.mm(gathered, weight.t())

    def inductor_rs():
        partial = torch.mm(cols, weight_rs.t())
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(partial, "sum", world, name))

    from overlap_pass.ops import all_reduce_op
    from overlap_pass.ops import matmul_ops as overlap_ops

    empty_ag = _empty_op("all_gather_matmul", overlap_ops.SCHEMAS["all_gather_matmul"], (None, [torch.mm(shard, weight.t())]))
    empty_rs = _empty_op("matmul_reduce_scatter", overlap_ops.SCHEMAS["matmul_reduce_scatter"], shard.clone())
    empty_ar = _empty_op("all_reduce", all_reduce_op.SCHEMAS["all_reduce"], amax.clone())
    bare_ag = _op_of("all_gather_matmul_bare", overlap_ops.SCHEMAS["all_gather_matmul"], dispatch.all_gather_matmul)
    bare_rs = _op_of("matmul_reduce_scatter_bare", overlap_ops.SCHEMAS["matmul_reduce_scatter"], dispatch.matmul_reduce_scatter)
    bare_ar = _op_of("all_reduce_bare", all_reduce_op.SCHEMAS["all_reduce"], dispatch.all_reduce)
    ops = {
        "all_gather -> matmul": {
            "torch dispatcher alone (an empty op of the schema)": lambda: empty_ag(*ag_args),
            "plain Inductor (NCCL + cuBLAS)": inductor_ag,
            "async TP": lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight.t()], 0, name),
            **{
                f"overlap {layer}": run
                for layer, run in _bare(_layers("all_gather_matmul", ag_args, device), lambda: bare_ag(*ag_args)).items()
            },
        },
        "matmul -> reduce_scatter": {
            "torch dispatcher alone (an empty op of the schema)": lambda: empty_rs(*rs_args),
            "plain Inductor (NCCL + cuBLAS)": inductor_rs,
            "async TP": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(cols, weight_rs.t(), "sum", 0, name),
            **{
                f"overlap {layer}": run
                for layer, run in _bare(_layers("matmul_reduce_scatter", rs_args, device), lambda: bare_rs(*rs_args)).items()
            },
        },
        "all_reduce (max, fp32, an element per token)": {
            "torch dispatcher alone (an empty op of the schema)": lambda: empty_ar(*ar_args),
            "plain Inductor (NCCL)": lambda: c10d.wait_tensor.default(c10d.all_reduce.default(amax, "max", name)),
            **{
                f"overlap {layer}": run
                for layer, run in _bare(_layers("all_reduce", ar_args, device), lambda: bare_ar(*ar_args)).items()
            },
        },
    }
    rows_out = []
    for op, runs in ops.items():
        for run in runs.values():  # warm every path up (NCCL, async TP's workspace)
            run()
        for label, run in runs.items():
            before = collections.Counter(replay.stats)
            host, gpu = _time(run, device, args.rounds, args.calls)
            # calls that found no per-call graph at their addresses ran their host steps eagerly
            paths = dict(collections.Counter(replay.stats) - before)
            rows_out.append({"op": op, "path": label, "host_us": round(host, 1), "gpu_us": round(gpu, 1), "calls": paths})
    return rows_out


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"W={meta['world']}, {meta['tokens']} tokens, dim {meta['dim']}, hidden {meta['hidden']}, bf16; "
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}",
        "overlap's variants: "
        + (", ".join(sorted(set(meta["choices"].values()))) or f"{meta['implementation']} (forced)"),
        "",
        "| op | path | host µs / call | GPU µs / call | overlap calls: replayed / captured / eager |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['op']} | {r['path']} | {r['host_us']:.1f} | {r['gpu_us']:.1f} | "
        + " / ".join(str(r["calls"].get(k, 0)) for k in ("replayed", "captured", "eager"))
        + " |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="gathered rows (all ranks)")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096, help="the column-parallel output's width per rank")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--implementation", default="auto", help="overlap's config.implementation (e.g. fused)")
    parser.add_argument("--out", default="host_cost.json")
    args = parser.parse_args()
    import triton

    from overlap_pass import config

    config.implementation = args.implementation
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)  # async TP's ops need it
    rows = bench(args, device, group)
    from overlap_pass.lowering import choose

    meta = {
        "world": group.size(), "tokens": args.tokens, "dim": args.dim, "hidden": args.hidden,
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "implementation": args.implementation, "choices": {k: v["choice"] for k, v in choose.CHOICES.items()},
    }  # fmt: skip
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(table(rows, meta), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
