"""torchtitan's Llama 3 layers under tensor + sequence parallelism, compiled four ways in one
process, interleaved, on the same inputs and weights:

- inductor: plain Inductor, each TransformerBlock compiled as torchtitan's apply_compile does;
- async_tp: torchtitan's ``enable_async_tensor_parallel`` (Inductor's ``_micro_pipeline_tp``,
  symmetric memory for the TP group);
- dist_gemm: torchtitan's ``tp_gemm_backend="dist_gemm"`` model (its projections call
  torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter, forward and
  backward) under plain Inductor;
- overlap: the stock model under backend="overlap".

    torchrun --nproc-per-node 2 -m benchmarks.bench_torchtitan --sizes llama3-8b --batches 1,2,4,8 \\
        --out titan.json --png titan.png
    python3 -m benchmarks.bench_torchtitan --render a.json,b.json --png titan.png   # tables again

Hardware: W CUDA GPUs of one host (NVLink), one process per GPU under torchrun; --render runs
anywhere.

The layers are benchmarks/titan_llama3.py's copy of torchtitan 0.3.0's block and plan: torchtitan
itself needs a torch newer than 2.11 (tests/cpu check the copy against it).
Each sequence has ``--seq`` tokens (8192), so batch b runs b x 8192 tokens; the hidden state
enters the layers sharded along seq, [batch, seq / W, dim], as between torchtitan's blocks.

Per size and batch: forward (no_grad) and forward+backward step time (slowest rank, median of
interleaved rounds), host time to queue a step, each compiler's numerics against eager (output,
input grad, weight grads), the pass's counters. A size and batch that runs out of memory is
recorded as such. Dynamo is reset between points, so each compiles its own static shapes.
"""

import argparse
import json
import os

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import emulated  # noqa: E402
from benchmarks.measure import add_settle_argument, relative_error, time_interleaved  # noqa: E402

COMPILERS = ("inductor", "async_tp", "dist_gemm", "overlap")
LABELS = {
    "inductor": "plain Inductor", "async_tp": "torchtitan async TP", "dist_gemm": "torchtitan dist_gemm",
    "overlap": "overlap",
}  # fmt: skip


def _compiled(model, compiler: str):
    from benchmarks.titan_llama3 import compile_titan

    if compiler == "overlap":
        return compile_titan(model, backend="overlap")
    if compiler == "async_tp":
        return compile_titan(model, options={"_micro_pipeline_tp": True})
    return compile_titan(model)  # inductor, dist_gemm


def _models(size: str, seq: int, layers: int, mesh, device, compilers) -> tuple:
    """The eager stock model and {compiler: compiled model}, every one built from the same seed,
    so with the same weights. Attention runs Flash (Math as the fallback), not torchtitan's
    cuDNN-first order: torch 2.11's cuDNN attention returns wrong gradients to a later call of
    the same shapes whose output gradient is laid out otherwise (benchmarks/titan_llama3.py), which
    the stock and dist_gemm models, and eager and compiled ones, are."""
    from torch.nn.attention import SDPBackend

    from benchmarks.titan_llama3 import TitanLayers, parallelize_titan

    def build(gemm_backend: str):
        torch.manual_seed(0)  # the same full weights on every rank and in every model
        model = TitanLayers(
            size, n_layers=layers, seq_len=seq, gemm_backend=gemm_backend, device=device,
            dtype=torch.bfloat16, sdpa_backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
        )  # fmt: skip
        return parallelize_titan(model, mesh)

    eager = build("default")
    models = {c: _compiled(build("dist_gemm" if c == "dist_gemm" else "default"), c) for c in compilers}
    return eager, models


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def bench_point(size: str, batch: int, args, mesh, device) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters["overlap_pass"].clear()
    world = dist.get_world_size()
    compilers = args.compilers.split(",")
    eager, models = _models(size, args.seq, args.layers, mesh, device, compilers)
    dim = eager.args.dim
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randn(batch, args.seq // world, dim, device=device, dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=gen)

    def forward(model):
        with torch.no_grad():
            return model(x)

    def step(model):
        inp = x.detach().requires_grad_()
        out = model(inp)
        out.backward(grad)
        return out, inp.grad

    def weight_grads(model):
        return [_local(p.grad) for p in model.parameters()]

    def zero(model):
        for p in model.parameters():
            p.grad = None

    out_e, dx_e = step(eager)
    errors = {}
    for compiler, model in models.items():
        fwd = forward(model).clone()
        out, dx = step(model)
        errors[compiler] = {
            "forward": relative_error(fwd, out_e),
            "output": relative_error(out, out_e),
            "input grad": relative_error(dx, dx_e),
            "weight grads": max(relative_error(g, e) for g, e in zip(weight_grads(model), weight_grads(eager))),
        }
        zero(model)
    zero(eager)
    runners = {}
    for compiler, model in models.items():
        runners[(compiler, "forward")] = lambda m=model: forward(m)
        runners[(compiler, "forward+backward")] = lambda m=model: (step(m), zero(m))
    timed, host = time_interleaved(runners, device, args.rounds, args.calls, args.warmup, settle=args.settle)
    return {
        "size": size, "batch": batch, "seq": args.seq, "tokens": batch * args.seq, "layers": args.layers,
        "us": {f"{c} {mode}": t for (c, mode), t in timed.items()},
        "host_us": {f"{c} {mode}": t for (c, mode), t in host.items()},
        "errors": errors, "overlap_pass": dict(counters["overlap_pass"]),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """Step times in µs and each compiler's speedup over plain Inductor."""
    head = "| size | batch | pass | " + " | ".join(LABELS[c] for c in COMPILERS) + " | " + " | ".join(
        f"{LABELS[c]} vs Inductor" for c in COMPILERS[1:]
    ) + " | overlap vs best other |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['size']} | {r['batch']} | {r['failed']} |")
            continue
        for mode in ("forward", "forward+backward"):
            t = {c: r["us"].get(f"{c} {mode}", float("nan")) for c in COMPILERS}
            others = min(t[c] for c in COMPILERS[:-1])
            lines.append(
                f"| {r['size']} | {r['batch']} | {mode} | " + " | ".join(f"{t[c]:.0f}" for c in COMPILERS)
                + " | " + " | ".join(f"{t['inductor'] / t[c]:.2f}x" for c in COMPILERS[1:])
                + f" | {others / t['overlap']:.2f}x |"
            )  # fmt: skip
    return "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    """Speedup over plain Inductor per batch, one panel per size and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in rows if "failed" not in r})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(10, 3.5 * len(sizes)), squeeze=False)
    for i, size in enumerate(sizes):
        points = [r for r in rows if r["size"] == size and "failed" not in r]
        for j, mode in enumerate(("forward", "forward+backward")):
            ax = axes[i][j]
            for c in COMPILERS[1:]:
                ys = [r["us"][f"inductor {mode}"] / r["us"][f"{c} {mode}"] for r in points]
                ax.plot([r["batch"] for r in points], ys, marker="o", label=LABELS[c])
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"{size}, {mode}")
            ax.set_xlabel(f"batch (sequences of {points[0]['seq']} tokens)")
            ax.set_ylabel("speedup over plain Inductor")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="llama3-8b,llama3-70b")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    add_settle_argument(parser)
    parser.add_argument("--out", default="bench_torchtitan.json")
    parser.add_argument("--png", default=None)
    parser.add_argument("--render", default=None, help="JSON files of earlier runs (commas): print their table, draw --png")
    emulated.add_argument(parser)
    args = parser.parse_args()
    if args.render:
        rows = []
        for path in args.render.split(","):
            with open(path) as f:
                rows += json.load(f)["rows"]
        rows.sort(key=lambda r: (r["size"], r["batch"]))
        print(table(rows))
        if args.png:
            chart(rows, args.png)
        return
    unknown = set(args.compilers.split(",")) - set(COMPILERS)
    if unknown:
        parser.error(f"unknown compilers {sorted(unknown)}; choose from {','.join(COMPILERS)}")

    import overlap_pass  # noqa: F401  (registers the backend)
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.device_mesh import init_device_mesh

    # a model compiled per block, four ways, forward-only and training: more than Dynamo's
    # default 8 compiles of the block's forward
    torch._dynamo.config.recompile_limit = 64
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    world_params = emulated.init_process_group(device, args.emulate)
    if args.seq % dist.get_world_size():
        parser.error("seq must be divisible by the world size")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # async TP and dist_gemm, as torchtitan does
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    meta = {
        "device": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__,
        "emulated": world_params and world_params.describe(),
        "triton": __import__("triton").__version__, "rounds": args.rounds, "calls": args.calls,
        "model": "benchmarks/titan_llama3.py (torchtitan 0.3.0's Llama 3 block and TP/SP plan)",
    }  # fmt: skip
    rows = []
    for size in args.sizes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                rows.append(bench_point(size, batch, args, mesh, device))
            except torch.OutOfMemoryError as error:  # every rank runs the same sizes
                rows.append({"size": size, "batch": batch, "failed": f"out of memory: {str(error).splitlines()[0][:120]}"})
                torch.cuda.empty_cache()
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
                with open(args.out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if dist.get_rank() == 0:
        print(json.dumps(meta))
        print(table(rows))
        if args.png:
            chart(rows, args.png)
    torch._dynamo.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
