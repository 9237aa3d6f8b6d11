"""How long a fresh process takes to reach its first training steps under backend="overlap",
against plain Inductor: the tensor-parallel block of benchmarks/tp_models.py (sequence parallel
or plain TP) with AdamW, each step forward, loss, backward and the optimizer, compiled as a
user's job would be (overlap's first calls at a signature as users get them, config.fused_from_call).

    python3 -m benchmarks.first_step                       # CPU: 2 gloo ranks; one GPU: an emulated world of 2
    python3 -m benchmarks.first_step --world 4 --layouts sp --shapes symbolic

Each row is a job started from nothing: W processes on the CPU (gloo), or on one GPU the rank 0
of an emulated world of W (benchmarks/emulated: its own kernels, compiles and choices for real,
its peers emulated); "cold" on empty Inductor, Triton and choice caches, "warm" a second job on
the cold one's caches. Times are from the processes' spawn, the slowest rank's:
- "startup": imports, the process group, the model and its optimizer built;
- "first step": the first step alone (the compile, and at its end the step's own work);
- "to first step": spawn to the end of the first step;
- "to steady": spawn to the end of step fused_from_call + 1, the first after overlap's ops have
  chosen their variants (and measured the buckets a new shape needs);
- "steady step": the last step.
The compiles and cache counts are rank 0's (torch's counters, as benchmarks/compile_time.py).
Hardware: one GPU (Llama 3 8B widths, bf16), else the CPU (small widths; torch 2.13's
AOTAutograd fails the plain-TP block's training on symbolic sizes there, plain Inductor alike).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from benchmarks.compile_time import FIRST, add_arguments, cache_counts, cache_env, graph_compiles, run_rows

SPAWNED_AT = "OVERLAP_FIRST_STEP_SPAWNED_AT"


def _run(backend: str, layout: str, symbolic: bool, world: int) -> dict:
    """One rank of a row, in this process (spawned at os.environ[SPAWNED_AT])."""
    from tools.run_env import set_defaults

    set_defaults(fused_from_first_call=False)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks import tp_models
    from overlap_pass import config

    spawned = float(os.environ[SPAWNED_AT])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        from benchmarks import emulated

        emulated.init_process_group(torch.device(device), world)
    else:
        dist.init_process_group("gloo")
    dim, heads, hidden, kv_heads = (4096, 32, 14336, 8) if device == "cuda" else (64, 4, 128, 2)
    torch.manual_seed(0)
    block = tp_models.TransformerBlock(dim, heads, hidden, kv_heads=kv_heads).to(device).bfloat16()
    parallelize = tp_models.parallelize_block if layout == "sp" else tp_models.parallelize_block_plain
    model = parallelize(block, init_device_mesh(device, (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=backend, dynamic=None if symbolic else False)
    rows = FIRST // world if layout == "sp" else FIRST  # a rank's shard of the sequence, or all of it
    row = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    row["startup s"] = time.time() - spawned
    steps = max(config.fused_from_call, 1) + 1
    with graph_compiles() as graphs:
        try:
            for step in range(steps):
                start = time.perf_counter()
                x = torch.randn(1, rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                if symbolic and step == 0:
                    torch._dynamo.mark_dynamic(x, 1)
                compiled(x).float().pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                if step == 0:
                    row["first step s"] = time.perf_counter() - start
                    row["to first step s"] = time.time() - spawned
            row["to steady s"] = time.time() - spawned
            row["steady step s"] = time.perf_counter() - start
        except Exception as error:  # (the CPU's plain-TP training on symbolic sizes, see above)
            lines = [line for line in str(error).splitlines() if line.strip()]
            row["failed"] = " ".join(lines[:2])[:160]
    row["per graph"] = graphs
    row["steps"] = steps
    row.update(cache_counts())
    dist.destroy_process_group()
    return row


def _job(backend: str, layout: str, shapes: str, caches: str, world: int, gpu: bool) -> dict:
    """One row: the job's processes spawned now, on the caches under ``caches``; the slowest
    rank's times, rank 0's counts."""
    env = cache_env(caches)
    env[SPAWNED_AT] = repr(time.time())
    command = [sys.executable, "-m", "benchmarks.first_step", "--child", backend, layout, shapes, "--world", str(world)]
    ranks = 1 if gpu else world
    if not gpu:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(ranks)
    ]  # fmt: skip
    rows = []
    for proc in procs:
        out, err = proc.communicate()
        lines = out.strip().splitlines()
        if proc.returncode or not lines:
            return {"failed": (err.strip().splitlines() or ["no output"])[-1][:160]}
        rows.append(json.loads(lines[-1]))
    row = dict(rows[0])
    for key in ("startup s", "first step s", "to first step s", "to steady s", "steady step s"):
        if all(key in r for r in rows):
            row[key] = max(r[key] for r in rows)
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, unit="job")
    parser.add_argument("--world", type=int, default=2, help="ranks (on one GPU: an emulated world of this many)")
    args = parser.parse_args(argv)
    if args.child:
        backend, layout, shapes = args.child
        print(json.dumps(_run(backend, layout, shapes == "symbolic", args.world)))
        return 0
    import torch  # (the parent only asks which hardware the jobs get)

    gpu = torch.cuda.is_available()
    timed = {k: k for k in ("startup s", "first step s", "to first step s", "to steady s", "steady step s")}
    rows = run_rows(args, timed, lambda *row: _job(*row, args.world, gpu))
    if rows:
        where = "emulated world" if gpu else "gloo ranks"
        print(f"device: {rows[0].get('device', '?')}, {where} of {args.world}, torch {rows[0].get('torch', '?')}, "
              f"{rows[0].get('steps', '?')} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
