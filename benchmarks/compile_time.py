"""How long torch.compile takes under backend="overlap" against plain Inductor, and what a call
at a new token count costs: the tensor-parallel block of benchmarks/tp_models.py (sequence parallel
or plain TP), forward and backward, on a fake process group of 2 ranks (nothing is
communicated: compile time only). Each row is a process of its own with empty Inductor and
Triton caches, as a first run on a machine.

    python3 -m benchmarks.compile_time                   # both compilers, both layouts, static and symbolic
    python3 -m benchmarks.compile_time --layouts plain --shapes symbolic

Each row runs twice: cold (empty caches) and warm (a second process on the first one's caches:
Inductor's FX graph cache, AOTAutograd's cache, the Triton cache), counting Inductor's graph
compiles and each cache's hits, misses and bypasses, and printing below it each graph's compile
(forward or backward, seconds, and whether the FX graph cache had it); ``--cold-only`` skips the
warm run.

Each run calls the compiled block at 4096 tokens (the first call: the compile), again at 4096,
then at 2048: with ``symbolic``, the input's token dim is marked dynamic before the first call,
so the call at 2048 compiles nothing unless a guard on the count fails (Dynamo then compiles
the frame again: "frames" counts them); ``static`` recompiles there. "pass" is the time inside
overlap's graph passes. Hardware: one GPU (Llama 3 8B widths, bf16), else the CPU (small
widths; there torch 2.13's AOTAutograd fails the plain-TP block's training on symbolic sizes,
plain Inductor's compile alike, and the row says so).
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

BACKENDS = ("inductor", "overlap")
LAYOUTS = ("sp", "plain")
SHAPES = ("static", "symbolic")
FIRST, OTHER = 4096, 2048  # tokens of the first calls and of the call at another count


def _run(backend: str, layout: str, symbolic: bool) -> dict:
    """One row, in this process (whose caches the parent made empty)."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import compilation_time_metrics
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks import tp_models
    from overlap_pass.pipeline import passes

    in_passes = [0.0]
    for cls in (passes.OverlapPass, passes.RegatherPass):
        cls.__call__ = _timed(cls.__call__, in_passes)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dim, heads, hidden, kv_heads = (4096, 32, 14336, 8) if device == "cuda" else (64, 4, 128, 2)
    torch.manual_seed(0)
    block = tp_models.TransformerBlock(dim, heads, hidden, kv_heads=kv_heads).to(device).bfloat16()
    parallelize = tp_models.parallelize_block if layout == "sp" else tp_models.parallelize_block_plain
    model = parallelize(block, init_device_mesh(device, (2,)))
    compiled = torch.compile(model, backend=backend, dynamic=None if symbolic else False)

    def call(tokens: int, first: bool) -> float:
        rows = tokens // 2 if layout == "sp" else tokens  # a rank's shard of the sequence, or all of it
        x = torch.randn(1, rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        if symbolic and first:
            torch._dynamo.mark_dynamic(x, 1)
        start = time.perf_counter()
        compiled(x).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    row = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    with graph_compiles() as graphs:
        try:
            row["first s"] = call(FIRST, True)
            row["same count s"] = call(FIRST, False)
            row["other count s"] = call(OTHER, False)
        except Exception as error:  # (the CPU's plain-TP training on symbolic sizes, see above)
            lines = [line for line in str(error).splitlines() if line.strip()]  # (past a backend's "raised:")
            row["failed"] = " ".join(lines[:2])[:160]
    row["per graph"] = graphs
    row["pass s"] = in_passes[0]
    # (torch's own timers of its compile stages: seconds summed over the compiles of the row)
    row["phases"] = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
    row.update(cache_counts())
    dist.destroy_process_group()
    return row


def _fx_cache_counts() -> dict[str, int]:
    """The FX graph cache's hits, misses and bypasses so far (torch's counters)."""
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}


def cache_counts() -> dict:
    """This process's compiles so far: Dynamo's frames, Inductor's graphs, and the FX graph
    cache's and AOTAutograd cache's hits, misses and bypasses (torch's own counters)."""
    from torch._dynamo.utils import counters

    counts = {"frames": counters["stats"]["unique_graphs"]}
    counts["graphs"] = sum(_fx_cache_counts().values())
    for cache, prefix in (("fx", "inductor:fxgraph_cache_"), ("aot", "aot_autograd:autograd_cache_")):
        group, _, name = prefix.partition(":")
        counts[cache] = {k: counters[group][f"{name}{k}"] for k in ("hit", "miss", "bypass")}
    return counts


@contextlib.contextmanager
def graph_compiles():
    """Yields a list that gets, per Inductor graph compiled inside (forward, backward or
    inference, in their order), its seconds and what the FX graph cache did for it (hit, miss,
    bypass; "none" where the cache was not asked)."""
    from torch._inductor import compile_fx

    graphs: list[dict] = []
    inner = getattr(compile_fx, "_compile_fx_inner", None)  # (each graph's compile, where torch has it)
    if inner is None:
        yield graphs
        return

    def timed(gm, example_inputs, **kwargs):
        before = _fx_cache_counts()
        start = time.perf_counter()
        try:
            return inner(gm, example_inputs, **kwargs)
        finally:
            after = _fx_cache_counts()
            outcome = next((k for k, n in before.items() if after[k] > n), "none")
            kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
            graphs.append({"graph": kind, "s": round(time.perf_counter() - start, 3), "fx cache": outcome})

    compile_fx._compile_fx_inner = timed
    try:
        yield graphs
    finally:
        compile_fx._compile_fx_inner = inner


def describe_graphs(row: dict) -> str:
    """A row's graphs as "forward 3.21 s miss, backward 4.02 s miss"."""
    return ", ".join(f"{g['graph']} {g['s']:.2f} s {g['fx cache']}" for g in row.get("per graph", []))


def cache_env(caches: str) -> dict:
    """The environment of a process whose Inductor, Triton and choice caches are under ``caches``."""
    return {
        **os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
        "OVERLAP_PASS_CHOICE_CACHE": os.path.join(caches, "choices.json"),
    }  # fmt: skip


def _timed(method, spent: list):
    def call(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    return call


def _child(backend: str, layout: str, shapes: str, caches: str) -> dict:
    """One row in a process of its own, on the caches under ``caches``."""
    command = [sys.executable, "-m", "benchmarks.compile_time", "--child", backend, layout, shapes]
    done = subprocess.run(command, env=cache_env(caches), capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"failed": (done.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    return json.loads(lines[-1])


def _hits(row: dict) -> str:
    """The caches' counts as "fx 3/0/1, aot 1/0/0" (hits / misses / bypasses)."""
    if "fx" not in row:
        return "-"
    return ", ".join(f"{c} " + "/".join(str(row[c][k]) for k in ("hit", "miss", "bypass")) for c in ("fx", "aot"))


def add_arguments(parser, unit: str = "run") -> None:
    """The arguments of a table of rows (run_rows), and the hidden one of a row's process."""
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--cold-only", action="store_true", help=f"no warm {unit} on the cold {unit}'s caches")
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)


def run_rows(args, timed: dict, job, after_row=None) -> list:
    """A row per layout, token counts and compiler of ``args``, cold then warm on one set of
    caches: ``job(backend, layout, shapes, caches)`` measures it. Prints the table as it goes
    (``timed``: a row's keys of seconds -> their columns' names; ``after_row(row)`` prints more),
    writes the rows to ``args.out``, and returns them."""
    print(f"| compiler | layout | token counts | caches | {' | '.join(timed.values())} | frames | Inductor graphs |"
          " cache hits / misses / bypasses |")
    print("|---" * (len(timed) + 7) + "|")
    rows = []
    runs = ("cold",) if args.cold_only else ("cold", "warm")
    for layout in args.layouts.split(","):
        for shapes in args.shapes.split(","):
            for backend in args.backends.split(","):
                with tempfile.TemporaryDirectory() as caches:
                    for run in runs:
                        row = {"compiler": backend, "layout": layout, "token counts": shapes, "caches": run}
                        row.update(job(backend, layout, shapes, caches))
                        rows.append(row)
                        cells = " | ".join(f"{row[k]:.2f}" if k in row else "-" for k in timed)
                        tail = f" ({row['failed']})" if "failed" in row else ""
                        print(
                            f"| {backend} | {layout} | {shapes} | {run} | {cells} | {row.get('frames', '-')} | "
                            f"{row.get('graphs', '-')} | {_hits(row)}{tail} |", flush=True,
                        )
                        if row.get("per graph"):
                            print(f"    graphs: {describe_graphs(row)}", flush=True)
                        if after_row is not None:
                            after_row(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--phases", action="store_true", help="also print torch's timers of each compile stage")
    args = parser.parse_args(argv)
    if args.child:
        backend, layout, shapes = args.child
        print(json.dumps(_run(backend, layout, shapes == "symbolic")))
        return 0

    def phases(row: dict) -> None:
        if args.phases:
            top = sorted(row.get("phases", {}).items(), key=lambda kv: -kv[1])[:12]
            print("    phases s: " + ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)

    timed = {"first s": "first call s", "same count s": "same count s", "other count s": "other count s",
             "pass s": "in overlap's passes s"}  # fmt: skip
    rows = run_rows(args, timed, _child, phases)
    if rows:
        print(f"device: {rows[0].get('device', '?')}, torch {rows[0].get('torch', '?')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
