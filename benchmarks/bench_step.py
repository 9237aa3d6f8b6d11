"""A whole training step of a Llama 3 (embedding, torchtitan's blocks, final norm, output, loss,
backward, AdamW) under torchtitan's tensor + sequence parallel plan, alone or with FSDP2 on a
2-D mesh, compiled per block three ways in one process: plain Inductor, PyTorch's async TP
(Inductor's ``_micro_pipeline_tp``, as torchtitan's ``enable_async_tensor_parallel``) and
backend="overlap". Each compiler's step time (interleaved rounds, slowest rank, median), host
time to queue a step, device memory, and its losses against eager's.

    torchrun --nproc-per-node 4 -m benchmarks.bench_step --tp 4 --out step_tp4.json
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --tp 2 --out step_dp2_tp2.json   # FSDP2 x TP
    torchrun --nproc-per-node 4 -m benchmarks.bench_step --model hf --out step_hf.json    # Hugging Face

``--model hf``: Hugging Face's LlamaForCausalLM at the same widths (random weights saved by rank 0
and loaded with its own ``tp_plan``, as benchmarks/bench_prefill.py does), plain TP (an all-reduce
after each row-parallel linear, which overlap splits where that pays), the whole model compiled,
its own loss, AdamW.

``--profile N`` adds where each compiler's step spends its time: GPU and host time per phase
(forward with the loss, backward, optimizer; N back-to-back steps, unprofiled), then from N
profiled steps (rank 0) idle time, exposed communication and kernel time per category (GEMMs,
overlap's fused kernels, attention, Inductor's fused kernels, the optimizer, NCCL), as
benchmarks/exposed_time.py accounts it.

Hardware: W CUDA GPUs of one host (NVLink), one process per GPU under torchrun. ``--tp`` ranks
form each tensor-parallel group; W / tp is the FSDP2 (data parallel) degree, 1 meaning TP alone.

The model: benchmarks/titan_llama3.py's blocks (torchtitan 0.3.0's, which torch 2.11 cannot import),
with torchtitan's plan for the rest (models/llama3/sharding.py): the embedding rowwise with its
output Shard(1), the final norm sequence parallel, the output colwise from Shard(1) to
Shard(-1) logits, the loss under loss_parallel; each block compiled on its own, as
apply_compile does; FSDP2 (``fully_shard`` per block, then the model) on the data-parallel mesh
dimension after compile, as torchtitan orders them. Parameters are bf16 throughout (no mixed
precision policy). Attention runs Flash (Math as the fallback), as benchmarks/bench_torchtitan.py
explains.

Timing: each round opens with ``--settle`` untimed steps (default 2). A training process runs one
model, whose allocations repeat from step to step; after another compiler's round they land at
new addresses, and overlap's per-call CUDA graphs, which are kept by address, are captured again
(one step eager, then one capturing, whose host time is several times a step's). The table says
how overlap's op calls ran while timed.

Device memory: before each compiler's model is built, the caching allocator's free blocks are
released; its model is built and compiled, then runs ``--warmup`` steps (the compile and
overlap's choices included); "memory" is how much more device memory is in use after them
(torch.cuda.mem_get_info: model, optimizer state, the allocator's peak, symmetric-memory
workspaces, CUDA graphs, kernels), and "peak" adds what the process held before (CUDA context,
NCCL, the eager step's kernels). An eager step runs first, so that one-time costs every
compiler shares (communicators, cuBLAS handles) fall on none of them. Read for one compiler per
process (``--compilers X --rounds 0``, as benchmarks/whole_step.sh does): with several in one
process a later compiler's steps reuse what the earlier ones' left (at W=2 async TP read 3444 MiB
below its own process's number), so the table shows memory only for a run of one compiler.
"""

import argparse
import gc
import json
import os
import statistics
import time

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import emulated  # noqa: E402
from benchmarks.measure import add_settle_argument, op_calls_since, time_interleaved  # noqa: E402

COMPILERS = ("inductor", "async_tp", "overlap")
LABELS = {"inductor": "plain Inductor", "async_tp": "async TP", "overlap": "overlap"}
MiB = 1 << 20


class Llama(nn.Module):
    """tok_embeddings -> layers (benchmarks/titan_llama3.TitanLayers) -> norm -> output, as
    torchtitan's Llama 3 names them."""

    def __init__(self, size, n_layers: int, seq: int, vocab: int, device) -> None:
        from torch.nn.attention import SDPBackend

        from benchmarks.titan_llama3 import FLAVORS, TitanLayers

        super().__init__()
        args = FLAVORS[size] if isinstance(size, str) else size  # or a LayerArgs
        factory = {"device": device, "dtype": torch.bfloat16}
        self.tok_embeddings = nn.Embedding(vocab, args.dim, **factory)
        self.layers = TitanLayers(
            args, n_layers, seq, sdpa_backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], **factory
        )  # fmt: skip
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps, **factory)
        self.output = nn.Linear(args.dim, vocab, bias=False, **factory)
        with torch.no_grad():  # torchtitan's inits for the parts the blocks do not cover
            nn.init.normal_(self.tok_embeddings.weight)
            bound = args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=bound, a=-3 * bound, b=3 * bound)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.layers(self.tok_embeddings(tokens))))


def _parallelized(model: Llama, mesh, compiler: str | None) -> Llama:
    """torchtitan's order: TP (the plan), compile per block, FSDP2 on the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from benchmarks.titan_llama3 import compile_titan, parallelize_titan

    tp_mesh = mesh["tp"]
    parallelize_titan(model.layers, tp_mesh)
    parallelize_module(
        model, tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )  # fmt: skip
    if compiler is not None:
        compile_titan(model.layers, **COMPILE_KWARGS[compiler])
    if mesh["dp"].size() > 1:
        for block in model.layers.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _used(device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _released(device) -> int:
    """Device bytes in use once garbage and the allocator's free blocks are released."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return _used(device)


def _no_phase(name: str) -> None:
    """A step's phases ("forward": the model and its loss, "backward", "optimizer") are marked
    by calling its ``phase`` with each name as it starts: here, unmarked."""


# torch.compile's arguments per compiler (the Hugging Face model is compiled whole)
COMPILE_KWARGS = {"inductor": {}, "async_tp": {"options": {"_micro_pipeline_tp": True}}, "overlap": {"backend": "overlap"}}


def _titan_recipe(args, mesh, device):
    """(build(compiler) -> (model, optimizer), step(model, optimizer) -> loss) for torchtitan's
    Llama 3 (None: eager)."""
    from torch.distributed.tensor.parallel import loss_parallel

    dp_rank = mesh["dp"].get_local_rank()
    gen = torch.Generator(device=device).manual_seed(1 + dp_rank)  # the same tokens across a TP group
    tokens = torch.randint(args.vocab, (args.batch, args.seq), device=device, generator=gen)
    labels = torch.randint(args.vocab, (args.batch, args.seq), device=device, generator=gen)

    def build(compiler):
        torch.manual_seed(0)  # the same weights in every model
        model = _parallelized(Llama(args.size, args.layers, args.seq, args.vocab, device), mesh, compiler)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(model, optimizer, phase=_no_phase):
        optimizer.zero_grad(set_to_none=True)
        phase("forward")
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())  # (torchtitan's loss is fp32)
            phase("backward")
            loss.backward()
        phase("optimizer")
        optimizer.step()
        return loss.detach()

    return build, step


def _hf_recipe(args, device):
    """The same pair for Hugging Face's Llama loaded with its own tp_plan (plain TP: every rank
    holds every token), compiled whole; its loss is the model's own (labels shifted inside)."""
    from benchmarks.bench_prefill import load_model, saved_model

    folder = saved_model(args.size, args.layers, args.vocab, args.seq + 1, device)
    gen = torch.Generator(device=device).manual_seed(1)  # the same tokens on every rank
    tokens = torch.randint(args.vocab, (args.batch, args.seq), device=device, generator=gen)

    def build(compiler):
        model = load_model(folder, device, train=True)
        if compiler is not None:
            model = torch.compile(model, **COMPILE_KWARGS[compiler])
        # (its parameters mix DTensors and plain tensors, which the foreach kernels refuse)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step(model, optimizer, phase=_no_phase):
        optimizer.zero_grad(set_to_none=True)
        phase("forward")
        loss = model(input_ids=tokens, labels=tokens).loss
        phase("backward")
        loss.backward()
        phase("optimizer")
        optimizer.step()
        return loss.detach()

    return build, step


def bench(args, build, step, device) -> dict:
    """Eager's losses, then per compiler: its memory and losses after ``--warmup`` steps, and
    the compilers' steps timed interleaved (``build`` and ``step``: a recipe's)."""
    from torch._dynamo.utils import counters

    from overlap_pass.lowering import replay, symm
    from benchmarks.measure import slowest

    def losses(model, optimizer, count):
        return [_value(step(model, optimizer)) for _ in range(count)]

    eager = build(None)
    eager_losses = losses(*eager, args.warmup)
    del eager
    before = _released(device)
    held_before = slowest(before / MiB, device)
    results, models = {}, {}
    for compiler in args.compilers.split(","):
        start = _released(device)
        torch.cuda.reset_peak_memory_stats(device)
        counters["overlap_pass"].clear()
        try:
            models[compiler] = build(compiler)
            got = losses(*models[compiler], args.warmup)
        except (RuntimeError, torch.OutOfMemoryError) as error:  # every rank fails alike
            results[compiler] = {"failed": str(error).splitlines()[0][:200]}
            models.pop(compiler, None)
            continue
        torch.cuda.synchronize(device)
        grown = slowest((_used(device) - start) / MiB, device)
        results[compiler] = {
            "memory_mib": round(grown), "peak_mib": round(grown + held_before),
            # the caching allocator's part: what it reserves, and the most its tensors took
            "allocator_reserved_mib": round(slowest(torch.cuda.memory_reserved(device) / MiB, device)),
            "allocator_peak_mib": round(slowest(torch.cuda.max_memory_allocated(device) / MiB, device)),
            "losses": got, "loss_vs_eager": max(abs(a - b) / abs(b) for a, b in zip(got, eager_losses)),
            "overlap_pass": dict(counters["overlap_pass"]),
        }
        if compiler == "overlap":
            results[compiler]["held"] = {
                "symmetric_mib": {k: round(v / MiB) for k, v in symm.bytes_held().items()},
                "op_graphs": replay.graphs_held()[0],
            }
    if args.rounds:
        runners = {c: (lambda m=m, o=o: step(m, o)) for c, (m, o) in models.items()}
        before = dict(replay.stats)
        timed, host = time_interleaved(runners, device, args.rounds, args.calls, 1, settle=args.settle)
        for compiler in models:
            results[compiler].update(step_us=round(timed[compiler]), host_us=round(host[compiler]))
        if "overlap" in results:  # settle steps included
            results["overlap"]["op_calls_timed"] = op_calls_since(before)
    if args.profile:
        for compiler, (model, optimizer) in models.items():
            for _ in range(args.settle):
                step(model, optimizer)
            before = dict(replay.stats)
            results[compiler]["phases"] = _phase_times(lambda phase, m=model, o=optimizer: step(m, o, phase), args.profile, device)
            results[compiler]["profile"] = _gpu_time(lambda m=model, o=optimizer: step(m, o), args.profile, device)
            if compiler == "overlap":
                results[compiler]["op_calls_profiled"] = op_calls_since(before)
    return {"eager_losses": eager_losses, "held_before_mib": round(held_before), "compilers": results}


PHASES = ("forward", "backward", "optimizer")


def _phase_times(step, steps: int, device) -> dict:
    """Per phase of ``steps`` back-to-back steps (the host free to run ahead, as when timed):
    its GPU time (between CUDA events queued as it starts) and its host time, µs, the median over
    steps of the slowest rank."""
    from benchmarks.measure import slowest

    stamps: list[tuple[str, float, torch.cuda.Event]] = []

    def phase(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        stamps.append((name, time.perf_counter(), event))

    for _ in range(steps):
        step(phase)
    phase("end")
    torch.cuda.synchronize(device)
    gpu: dict[str, list[float]] = {name: [] for name in PHASES}
    host: dict[str, list[float]] = {name: [] for name in PHASES}
    for (name, t0, e0), (_, t1, e1) in zip(stamps, stamps[1:]):
        gpu[name].append(e0.elapsed_time(e1) * 1e3)
        host[name].append((t1 - t0) * 1e6)
    return {
        f"{name} {what}": round(slowest(statistics.median(values[name]), device))
        for name in PHASES
        for what, values in (("gpu_us", gpu), ("host_us", host))
    }


def _gpu_time(step, steps: int, device) -> dict:
    """Where one step's GPU time goes (benchmarks/exposed_time.py's account of the whole step, this
    rank's, the median over ``steps`` profiled steps): span, busy, exposed communication, kernel
    time per category, and the kernels that took the most time (of the first step)."""
    from benchmarks import exposed_time

    def marked(mark):
        with mark("step"):
            step()

    trace = exposed_time._profiled(marked, steps, device)
    found = exposed_time.summarize(exposed_time.split_passes(trace, ("step",)), ("step",))["step"]
    found.pop("collectives")
    return found


def profile_table(report: dict) -> str:
    """Per compiler, where a step's GPU time goes (µs, rank 0): its span, idle time, exposed
    communication and kernel time per category (kernels on several streams add up past the span)."""
    results = {c: r["profile"] for c, r in report["result"]["compilers"].items() if "profile" in r}
    if not results:
        return ""
    categories = sorted({k for r in results.values() for k in r["by_category"]})
    lines = ["| GPU time (µs) | " + " | ".join(LABELS[c] for c in results) + " |", "|---|" + "---|" * len(results)]
    rows = [("span", lambda r: r["span_us"]), ("idle", lambda r: r["span_us"] - r["busy_us"]),
            ("exposed communication", lambda r: r["exposed_us"])]  # fmt: skip
    rows += [(k, lambda r, k=k: r["by_category"].get(k, 0.0)) for k in categories]
    for name, value in rows:
        lines.append(f"| {name} | " + " | ".join(f"{value(r):.0f}" for r in results.values()) + " |")
    phases = [report["result"]["compilers"][c].get("phases", {}) for c in results]
    for key in phases[0]:
        lines.append(f"| {key.replace('_us', '')} (unprofiled) | " + " | ".join(str(p.get(key, "-")) for p in phases) + " |")
    return "\n".join(lines)


def _value(loss: torch.Tensor) -> float:
    """A loss (a Replicate DTensor under loss_parallel) as a float."""
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def table(report: dict) -> str:
    meta, results = report["meta"], report["result"]["compilers"]
    layout = f"TP {meta['tp']}" + (f" x FSDP2 {meta['dp']}" if meta["dp"] > 1 else "")
    model = "Hugging Face Llama, tp_plan" if meta.get("model") == "hf" else "torchtitan Llama 3"
    head = (
        f"{model}, {meta['size']}, {meta['layers']} layers, vocab {meta['vocab']}, batch {meta['batch']} x {meta['seq']} tokens, "
        f"{layout} (W={meta['world']}); {meta['device']}, torch {meta['torch']}, triton {meta['triton']}"
    )
    alone = len(results) == 1  # memory is exact for one compiler per process only
    memory = " memory (MiB) | peak (MiB) |" if alone else ""
    lines = [head, "", f"| compiler | step (µs) | vs plain Inductor | host (µs) |{memory} loss vs eager |"]
    lines.append("|---|---|---|---|" + ("---|---|" if alone else "") + "---|")
    base = results.get("inductor", {}).get("step_us")
    for c, r in results.items():
        if "failed" in r:
            lines.append(f"| {LABELS[c]} | failed: {r['failed']} |")
            continue
        speedup = f"{base / r['step_us']:.2f}x" if base and "step_us" in r else "-"
        held = f" {r['memory_mib']} | {r['peak_mib']} |" if alone else ""
        lines.append(
            f"| {LABELS[c]} | {r.get('step_us', '-')} | {speedup} | {r.get('host_us', '-')} |{held} "
            f"{r['loss_vs_eager']:.1e} |"
        )
    calls = results.get("overlap", {}).get("op_calls_timed")
    if calls:
        paths = ", ".join(f"{calls.get(k, 0)} {k}" for k in ("replayed", "captured", "eager"))
        lines.append(f"\noverlap's op calls while timed (rank 0, settle steps included): {paths}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", choices=("titan", "hf"), default="titan",
        help="torchtitan's Llama 3 (TP/SP plan, FSDP2 with --tp below W), or Hugging Face's with its tp_plan (TP alone)",
    )  # fmt: skip
    parser.add_argument("--size", default="llama3-8b", choices=("llama3-8b", "llama3-70b"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel degree (default: every rank)")
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--warmup", type=int, default=3, help="steps before memory is read (compile, choices)")
    parser.add_argument("--rounds", type=int, default=5, help="0: memory alone (one compiler per process is exact)")
    parser.add_argument("--calls", type=int, default=5)
    add_settle_argument(parser)
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps per compiler: where GPU time goes")
    parser.add_argument("--out", default="bench_step.json")
    emulated.add_argument(parser)
    args = parser.parse_args()
    unknown = set(args.compilers.split(",")) - set(COMPILERS)
    if unknown:
        parser.error(f"unknown compilers {sorted(unknown)}; choose from {','.join(COMPILERS)}")
    import triton
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.device_mesh import init_device_mesh

    import overlap_pass  # noqa: F401  (registers the backend)

    torch._dynamo.config.recompile_limit = 64  # blocks compiled by three compilers
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    world_params = emulated.init_process_group(device, args.emulate)
    world = dist.get_world_size()
    tp = args.tp or world
    if world % tp or args.seq % tp:
        parser.error(f"--tp {tp} must divide the world size {world} and --seq {args.seq}")
    if args.model == "hf" and tp != world:
        parser.error("--model hf runs tensor parallelism alone: --tp is the world size")
    mesh = init_device_mesh("cuda", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # async TP needs it, as torchtitan does
        symm_mem.enable_symm_mem_for_group(mesh["tp"].get_group().group_name)
    meta = {
        "model": args.model, "size": args.size, "layers": args.layers, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
        "tp": tp, "dp": world // tp, "world": world, "device": torch.cuda.get_device_name(device),
        "emulated": world_params and world_params.describe(),
        "torch": torch.__version__, "triton": triton.__version__, "rounds": args.rounds, "calls": args.calls,
    }  # fmt: skip
    recipe = _hf_recipe(args, device) if args.model == "hf" else _titan_recipe(args, mesh, device)
    report = {"meta": meta, "result": bench(args, *recipe, device)}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(table(report), flush=True)
        if args.profile:
            print("\n" + profile_table(report), flush=True)
    torch._dynamo.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
