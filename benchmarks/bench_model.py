"""Benchmark of a compiled tensor/sequence-parallel model (benchmarks/tp_models, parallelized with
DTensor's ColwiseParallel / RowwiseParallel), forward and forward+backward, compiled three ways
in one process on the same inputs: plain Inductor, Inductor with ``_micro_pipeline_tp``
(PyTorch's async TP pass), and backend="overlap".

    torchrun --nproc-per-node 4 -m benchmarks.bench_model --model block --out block.json
    python3 -m benchmarks.bench_model --fake-world 8          # the floor alone at W=8, on one GPU
    python3 -m benchmarks.bench_model --emulate 8 --model block --compilers inductor,overlap,no_communication

Hardware: W CUDA GPUs of one host (NVLink), one process per GPU under torchrun; --fake-world W:
one GPU, no torchrun; --emulate W: one GPU, rank 0 of an emulated world (benchmarks/emulated/),
every time "emulated".

--model block: the transformer block (RMSNorm -> all-gather -> Q, K, V -> causal attention ->
O -> reduce-scatter -> RMSNorm -> all-gather -> gate, up -> SiLU * mul -> down ->
reduce-scatter) at Llama 3 sizes, grouped-query attention with 8 K/V heads. --model mlp: the
MLP (all-gather -> up -> gelu -> down -> reduce-scatter), at the same dim and hidden sizes.

--autocast: fp32 weights and activations, each step under torch.autocast to bf16 (the matmuls
in bf16, the backward's input gradients summed and reduce-scattered in fp32); else all bf16.
--float8 tensorwise|rowwise: every linear a torchao Float8Linear with that recipe.

--compilers ...,no_communication adds the floor: plain Inductor with every collective replaced
by a local op of its shape (benchmarks/no_comm.py), the step with no communication at all; the table
then shows how much of plain Inductor's distance to it overlap closes. --fake-world W times the
floor alone, in one process on one GPU, at world size W (rank 0 of a fake process group).

Times: the slowest rank's median over shuffled, interleaved rounds of the mean of ``--calls``
steps. Forward runs under no_grad (an inference graph); forward+backward takes the gradient of
the output with a fixed random gradient. Outputs and gradients are checked against eager.
"""

import argparse
import copy
import cProfile
import functools
import json
import os
import pstats

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import emulated  # noqa: E402
from benchmarks.measure import add_settle_argument, op_calls_since, relative_error, time_interleaved  # noqa: E402
from benchmarks.no_comm import NoCommunication  # noqa: E402

# (dim, heads, K/V heads, hidden)
SIZES = {"llama3-8b": (4096, 32, 8, 14336), "llama3-70b": (8192, 64, 8, 28672)}
COMPILERS = ("inductor", "inductor_micro_pipeline_tp", "overlap")
# backend="overlap" with a config knob changed, measured when named in --compilers (not in the
# table): what it saves. overlap_eager_ops: every op call queued eagerly (the per-call CUDA
# graphs of lowering/replay.py off); overlap_unmerged: each small all-reduce on its own
# (regions/early_all_reduces.py off); overlap_nccl_all_reduces: every all-reduce NCCL's
# (regions/small_all_reduces.py off); overlap_tail_matmuls: the weight gradients inside the
# reduce-scatter ops' tails (regions/tail_matmuls.py on); overlap_nccl_cublas: overlap's graphs
# with every op running NCCL + cuBLAS, as a token count's first calls do (config.fused_from_call);
# overlap_regather: the forward's gathers recomputed in the backward (regather.py).
# Patched around the first calls (which compile) and every call.
EXTRA_COMPILERS = {
    "overlap_eager_ops": {"op_graphs": False},
    "overlap_unmerged": {"merge_small_all_reduces": False},
    "overlap_nccl_all_reduces": {"small_all_reduce_bytes": 0},
    "overlap_tail_matmuls": {"tail_matmuls": True},
    "overlap_split_all": {"split_min_bytes": 0},
    "overlap_nccl_cublas": {"implementation": "nccl_cublas"},
    "overlap_regather": {"regather_in_backward": True},
    "overlap_dispatcher": {"direct_op_calls": False},
}
# plain Inductor with every collective replaced by a local op of its shape (benchmarks/no_comm.py):
# the step without communication, the floor of any overlap. Its results are wrong by design.
FLOOR = "no_communication"
SP_PREFIX = "sp:"


def _compile(model, compiler, mode=None):
    # options make a backend of their own, so Dynamo does not hand one model's compiled code
    # to another (a config patched around the first call would not)
    if compiler in EXTRA_COMPILERS:
        # a backend object of its own too: under one backend Dynamo hands a frame compiled for
        # one model to any other model of the same code (its guards do not check which module),
        # so two overlap compilers named "overlap" would both run the first one's graphs
        from overlap_pass import overlap_backend

        return torch.compile(model, backend=functools.partial(overlap_backend, mode=mode))
    if compiler.startswith("overlap"):
        return torch.compile(model, backend="overlap", mode=mode)
    if compiler == "inductor":
        return torch.compile(model, mode=mode)
    if compiler == FLOOR:
        options = {"post_grad_custom_pre_pass": NoCommunication()}
    elif compiler == "inductor_micro_pipeline_tp":
        options = {"_micro_pipeline_tp": True}
    else:
        raise ValueError(f"unknown compiler {compiler!r}")
    if mode == "reduce-overhead":
        options["triton.cudagraphs"] = True  # what the mode sets; options and mode exclude each other
    return torch.compile(model, options=options)


def _model(kind, dim, heads, kv_heads, hidden, mesh, layout="sp", float8=None):
    """The model, its linears made torchao Float8Linears with the ``float8`` recipe if given,
    parallelized."""
    from benchmarks.tp_models import (
        MLP,
        TransformerBlock,
        parallelize_block,
        parallelize_block_plain,
        parallelize_mlp,
    )

    if kind == "mlp":
        model, parallelize = MLP(dim, hidden, bias=False), parallelize_mlp
    else:
        model = TransformerBlock(dim, heads, hidden, bias=False, kv_heads=kv_heads)
        parallelize = parallelize_block_plain if layout == "plain" else parallelize_block
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8))
    return parallelize(model, mesh)


def _layout_of(compiler: str, args) -> tuple[str, str]:
    """(layout, compiler): "sp:<compiler>" runs the sequence-parallel block (next to a plain-TP
    run, the comparison the plain-TP issue asks for)."""
    if compiler.startswith(SP_PREFIX):
        return "sp", compiler[len(SP_PREFIX):]
    return args.layout, compiler


@torch.no_grad()
def _draw_local_weights(model) -> None:
    """A fake group's scatter moves nothing, so sharded weights hold whatever their memory did
    (often zeros, which a GPU multiplies faster than data). Draws each shard as nn.Linear
    draws its weights, from the global fan-in."""
    for param in model.parameters():
        if hasattr(param, "to_local") and param.dim() == 2:
            bound = param.shape[1] ** -0.5
            param.to_local().uniform_(-bound, bound)


def _rewrites(reset: bool = False) -> dict:
    """overlap's counters since the last reset: candidates rewritten and skipped, per kind, and
    how many graphs, of any compiler in the run, torch's FX graph cache served. The pass does
    not run on a cached graph of overlap's (its rewrite is in the cached code), so where that
    number is above 0 the counters may count fewer candidates than the graphs have."""
    from torch._dynamo.utils import counters

    found = dict(counters["overlap_pass"])
    cached = counters["inductor"]["fxgraph_cache_hit"]  # (also counted under an AOTAutograd cache hit)
    if cached:
        found["graphs_from_cache"] = cached
    if reset:
        counters["overlap_pass"].clear()
        counters["inductor"].pop("fxgraph_cache_hit", None)
    return found


def bench_size(name, args, device, mesh) -> dict:
    dim, heads, kv_heads, hidden = SIZES[name]
    world = dist.get_world_size()
    _rewrites(reset=True)
    torch._dynamo.reset()  # each size compiles anew, static: a recompile could mark dims dynamic
    torch.manual_seed(0)
    dtype = torch.float32 if args.autocast else torch.bfloat16
    compilers = args.compilers.split(",")
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=args.autocast)

    def forward(model, x):
        if args.mode:  # CUDA graph trees: a new step may overwrite the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), autocast():
            return model(x)

    def step(model, x, grad):
        if args.mode:
            torch.compiler.cudagraph_mark_step_begin()
        inp = x.detach().requires_grad_()
        with autocast():
            out = model(inp)
        out.backward(grad)
        return out, inp.grad

    # per layout: the eager model (the same weights in each), its input, output grad and results
    layouts = {}
    for layout in dict.fromkeys(_layout_of(c, args)[0] for c in compilers):
        torch.manual_seed(0)
        eager = _model(args.model, dim, heads, kv_heads, hidden, mesh, layout, args.float8).to(device=device, dtype=dtype)
        if args.fake_world or args.emulate:
            _draw_local_weights(eager)
        # [batch, seq, dim]: sequence parallel shards seq (with batch > 1 each rank's rows are not
        # one block of the gathered tensor); plain TP gives every rank the whole, the same values
        sharded = layout == "sp"
        seq = args.tokens // args.batch // (world if sharded else 1)
        gen = torch.Generator(device=device).manual_seed(1 + (dist.get_rank() if sharded else 0))
        x = torch.randn(args.batch, seq, dim, device=device, dtype=dtype, generator=gen)
        grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
        layouts[layout] = (eager, x, grad)
    models = {}
    for c in compilers:
        layout, compiler = _layout_of(c, args)
        models[c] = _compile(copy.deepcopy(layouts[layout][0]), compiler, args.mode)
    # (after the copies, which would carry the eager weight grads along)
    layouts = {layout: (*held, step(*held)) for layout, held in layouts.items()}

    def weight_grads(model):
        params = getattr(model, "_orig_mod", model).parameters()
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]

    def zero(model):
        for p in getattr(model, "_orig_mod", model).parameters():
            p.grad = None

    errors = {}
    for c, model in list(models.items()):
        eager, x, grad, (out_e, dx_e) = layouts[_layout_of(c, args)[0]]
        try:  # first calls compile: forward-only and forward+backward graphs
            with _config_of(c):
                fwd = forward(model, x).clone()
                out, dx = step(model, x, grad)
        except RuntimeError as error:  # every rank fails alike (e.g. a compiler under a mode)
            errors[c] = f"failed: {str(error).splitlines()[0]}"
            if dist.get_rank() == 0:
                print(f"== {c} failed on {name}:\n{error}", flush=True)
            del models[c]
            continue
        out = out.clone()  # (with CUDA graphs, the next step reuses the output's memory)
        errors[c] = "not checked: no communication" if c == FLOOR else {
            "forward": relative_error(fwd, out_e),
            "output": relative_error(out, out_e),
            "input grad": relative_error(dx, dx_e),
            "weight grads": max(relative_error(g, e) for g, e in zip(weight_grads(model), weight_grads(eager))),
        }
        zero(model)
    runners = {}
    for c, model in models.items():
        _, x, grad, _ = layouts[_layout_of(c, args)[0]]
        runners[(c, "forward")] = lambda m=model, x=x: forward(m, x)
        runners[(c, "forward+backward")] = lambda m=model, x=x, g=grad: (step(m, x, g), zero(m))
    for key in [k for k in runners if k[0] in EXTRA_COMPILERS]:
        runners[key] = functools.partial(_patched, key[0], runners[key])
    from overlap_pass.lowering import choose, replay

    before = dict(replay.stats)
    timed, host = time_interleaved(runners, device, args.rounds, args.calls, args.warmup, settle=args.settle)
    calls_timed = op_calls_since(before)  # warm-up and settle calls included
    if args.profile and "overlap" in models:
        for mode in ("forward", "forward+backward"):
            report = _host_profile(runners[("overlap", mode)], args.profile, device)
            if dist.get_rank() == 0:
                print(f"== host profile, overlap {mode}, {name}, {args.profile} calls, rank 0\n{report}", flush=True)
    us = {f"{c} {mode}": t for (c, mode), t in timed.items()}
    host_us = {f"{c} {mode}": t for (c, mode), t in host.items()}
    return {
        "model": args.model, "layout": args.layout, "size": name, "dim": dim, "heads": heads, "kv_heads": kv_heads, "hidden": hidden,
        "tokens": args.tokens, "batch": args.batch, "autocast": args.autocast, "float8": args.float8, "world": world,
        "us": us, "host_us": host_us,
        "errors": errors, "overlap_pass": _rewrites(),
        "op_calls": dict(replay.stats),  # rank 0's, since the process started: eager, captured, replayed
        "op_calls_timed": calls_timed,
        # each op shape's variant and the times it was picked on: every size benched so far in this process
        "choices": {key: dict(entry) for key, entry in choose.CHOICES.items()},
    }  # fmt: skip


def _config_of(compiler: str):
    """overlap's config as ``compiler`` runs it (EXTRA_COMPILERS)."""
    from overlap_pass import config

    return config.patch(**EXTRA_COMPILERS.get(compiler, {}))


def _patched(compiler: str, run):
    with _config_of(compiler):
        run()


def _host_profile(runner, calls: int, device, lines: int = 25) -> str:
    """Where the host time of ``calls`` calls goes: cProfile's functions by own time, in µs per
    call (the GPU runs behind; syncs before and after keep waits for it out)."""
    torch.cuda.synchronize(device)
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        runner()
    profile.disable()
    torch.cuda.synchronize(device)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, calls, own, cumulative, callers)
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:lines]
    rows = ["  own us | cum us | calls | function (per call of the model)"]
    for (path, line, name), (_, count, own, cumulative, _) in top:
        where = f"{os.path.basename(path)}:{line}({name})" if line else name
        rows.append(f"{own / calls * 1e6:8.1f} | {cumulative / calls * 1e6:6.0f} | {count / calls:5.1f} | {where}")
    return "\n".join(rows)


def table(rows: list[dict]) -> str:
    """The markdown table of a run; with the no-communication floor measured, also the floor
    and the share of plain Inductor's distance to it that overlap closes; with the
    sequence-parallel block measured next to a plain-TP one, its times under each compiler and
    overlap's speedup over it."""
    floor = any(f"{FLOOR} forward" in r["us"] for r in rows)
    sp = sorted({k.split(" ")[0] for r in rows for k in r["us"] if k.startswith(SP_PREFIX)}, key=str)
    head = (
        "| size | batch | pass | plain Inductor | Inductor + micro_pipeline_tp | overlap "
        "| overlap vs Inductor | overlap vs micro_pipeline_tp |"
    ) + (" no communication | gap closed |" if floor else "")
    head += "".join(f" SP block, {c[len(SP_PREFIX):]} | overlap vs it |" for c in sp)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for mode in ("forward", "forward+backward"):
            t = [r["us"].get(f"{c} {mode}", float("nan")) for c in COMPILERS]  # nan: it failed
            line = (
                f"| {r['size']} | {r.get('batch', 1)} | {mode} | {t[0]:.0f} | {t[1]:.0f} | {t[2]:.0f} "
                f"| {t[0] / t[2]:.2f}x | {t[1] / t[2]:.2f}x |"
            )
            if floor:
                # over 100% where overlap beats the floor (whose stand-ins cost a little)
                bound = r["us"].get(f"{FLOOR} {mode}", float("nan"))
                closed = (t[0] - t[2]) / (t[0] - bound) if t[0] != bound else float("nan")
                line += f" {bound:.0f} | {closed:.0%} |"
            for c in sp:
                other = r["us"].get(f"{c} {mode}", float("nan"))
                line += f" {other:.0f} | {other / t[2]:.2f}x |"
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("block", "mlp"), default="block")
    parser.add_argument(
        "--layout", choices=("sp", "plain"), default="sp",
        help="sequence parallel (activations sharded along seq) or plain TP (replicated, all-reduces); "
        f"a compiler named {SP_PREFIX}<compiler> runs the sequence-parallel block in a plain run",
    )  # fmt: skip
    parser.add_argument("--out", default="bench_model.json")
    parser.add_argument("--mode", choices=("reduce-overhead",), default=None, help="torch.compile mode, for every compiler")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="sequences of tokens / batch each")
    parser.add_argument("--autocast", action="store_true", help="fp32 model, steps under autocast to bf16")
    parser.add_argument(
        "--float8", choices=("tensorwise", "rowwise"), default=None,
        help="torchao Float8Linears with this recipe (needs torchao)",
    )  # fmt: skip
    parser.add_argument("--sizes", default=",".join(SIZES))
    known = COMPILERS + tuple(EXTRA_COMPILERS) + (FLOOR,)
    parser.add_argument("--compilers", default=",".join(COMPILERS), help="a subset of " + ",".join(known))
    # the median of 5 rounds of 20 calls (with a handful of calls,
    # the start of each round, the GPU waiting for the first launch, weighs in)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    add_settle_argument(parser)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many overlap calls per pass (host time)")
    parser.add_argument(
        "--fake-world", type=int, default=0,
        help=f"one process, rank 0 of a fake process group of this size: times {FLOOR} alone at that world size",
    )  # fmt: skip
    emulated.add_argument(parser)
    args = parser.parse_args()
    if args.tokens % (args.batch * (args.fake_world or args.emulate or int(os.environ.get("WORLD_SIZE", 1)))):
        parser.error("tokens must be divisible by batch x world size")
    if args.fake_world:  # a fake group moves no data: nothing but the floor means anything
        args.compilers = FLOOR
    unknown = {c.removeprefix(SP_PREFIX) for c in args.compilers.split(",")} - set(known)
    if unknown:
        parser.error(f"unknown compilers {sorted(unknown)}; choose from {','.join(known)}")

    import overlap_pass  # noqa: F401  (registers the backend)

    # three or more compilers x (no_grad forward, training step) recompile one forward more
    # than the default limit of 8 allows; past it Dynamo would silently run eager
    torch._dynamo.config.recompile_limit = 64
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=args.fake_world, store=FakeStore())
    world = None if args.fake_world else emulated.init_process_group(device, args.emulate)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group") and not args.fake_world:
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)  # _micro_pipeline_tp needs it
    meta = {
        "device": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "rounds": args.rounds, "calls": args.calls, "mode": args.mode,
        "autocast": args.autocast, "fake_world": args.fake_world, "float8": args.float8,
        "emulated": world and world.describe(),
    }  # fmt: skip
    rows = []
    for name in args.sizes.split(","):
        rows.append(bench_size(name, args, device, mesh))
        if dist.get_rank() == 0:
            row = rows[-1]
            print(f"{name}: {json.dumps(row['us'])}\n  host {json.dumps(row['host_us'])}", flush=True)
            print(f"  errors {json.dumps(row['errors'])}\n  {json.dumps(row['overlap_pass'])}", flush=True)
            print(f"  op calls {json.dumps(row['op_calls'])}, while timed {json.dumps(row['op_calls_timed'])}", flush=True)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if dist.get_rank() == 0 and not args.fake_world:  # (the floor alone is printed above)
        print(json.dumps(meta))
        if world:
            print(f"EMULATED (one GPU, rank 0 of W={world.world}):\n{world.describe()}")
        print(table(rows))
    # CUDA graphs that captured NCCL collectives (reduce-overhead) must go before the
    # communicators, or destroying them waits forever (pytorch/pytorch#115388)
    torch._dynamo.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
