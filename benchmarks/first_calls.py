"""What a shape's first measurement spends compiling: the first call of every fused GEMM config
of both bf16 ops (all_gather_matmul, matmul_reduce_scatter), or with ``--float8`` of both
float8 ops (rowwise scales: the Triton kernels' float8 configs and, on Hopper, the Gluon
ones), one after another as
lowering/choose.py makes them, from an empty Triton cache, with compiling ahead
(config.compile_ahead: the other configs compiled on threads at the first one's compile) and
without. Each run is a process of its own with a Triton cache of its own; the modes alternate.

    python3 -m benchmarks.first_calls                      # W=2, 8192 x 4096 x 7168, 2 runs a mode
    python3 -m benchmarks.first_calls --rows 2048 --runs 1
    python3 -m benchmarks.first_calls --float8 --rows 1024 --k 512 --n 768

Hardware: one CUDA GPU (Hopper for the TMA configs); the ranks are simulated in one process
(tests/sim_world.py). Every call's outputs are checked against an fp32 reference; the error is
printed beside each time.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time


def _bf16_ops(world: int, rows: int, k: int, n: int, gen) -> list:
    """Per op: its variants, one rank's call of a variant, and a call's worst error over the ranks."""
    import torch

    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import matmul_reduce_scatter as mrs

    full = torch.randn(1, rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / 64).t()
    shards = [s.contiguous() for s in full.chunk(world, dim=1)]
    gathered_ref = full.float() @ weight.float()
    inputs = [torch.randn(1, rows, n, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    back = (torch.randn(k, n, generator=gen, device="cuda", dtype=torch.bfloat16) / 64).t()
    scattered_ref = sum(x.float() @ back.float() for x in inputs).chunk(world, dim=1)
    return [
        ("all_gather_matmul", agm.variants(1), lambda v, r, g: v(shards[r], [weight], [None], 1, world, g),
         lambda results: max(_error(outs[0], gathered_ref) for _, outs in results)),
        ("matmul_reduce_scatter", mrs.variants(1), lambda v, r, g: v([inputs[r]], [back], None, "sum", 1, world, g),
         lambda results: max(_error(out, scattered_ref[r]) for r, out in enumerate(results))),
    ]  # fmt: skip


def _float8_ops(world: int, rows: int, k: int, n: int, gen) -> list:
    """_bf16_ops for the float8 ops, e4m3 with rowwise scales and fast accumulation (torchao's
    rowwise forward): the Triton kernels' float8 configs and, on Hopper, the Gluon ones."""
    import torch

    from overlap_pass.ops import scaled_ops
    from overlap_pass.lowering import scaled

    fp8 = torch.float8_e4m3fn

    def scale(*shape):
        return torch.rand(shape, generator=gen, device="cuda") + 0.25

    full = torch.randn(1, rows, k, generator=gen, device="cuda").to(fp8)
    full_scale = scale(1, rows, 1)
    shards = [s.contiguous() for s in full.chunk(world, dim=1)]
    shard_scales = [s.contiguous() for s in full_scale.chunk(world, dim=1)]
    weight, weight_scale = torch.randn(n, k, generator=gen, device="cuda").to(fp8).t(), scale(1, n)
    gathered_ref = scaled_ops.scaled_mm_rows(full, full_scale, weight, weight_scale, None, torch.bfloat16, True).float()
    inputs = [torch.randn(1, rows, n, generator=gen, device="cuda").to(fp8) for _ in range(world)]
    input_scales = [scale(1, rows, 1) for _ in range(world)]
    back, back_scale = torch.randn(k, n, generator=gen, device="cuda").to(fp8).t(), scale(1, k)
    scattered_ref = sum(
        scaled_ops.scaled_mm_rows(x, s, back, back_scale, None, torch.bfloat16, True).float()
        for x, s in zip(inputs, input_scales)
    ).chunk(world, dim=1)

    def gather(v, r, g):
        rows_scale = shard_scales[r]
        return v(shards[r], rows_scale, [weight], [weight_scale], [None], 1, world, g, torch.bfloat16, True, False, [])

    def scatter(v, r, g):
        rows_scale = input_scales[r]
        return v([inputs[r]], [rows_scale], [back], [back_scale], None, "sum", 1, world, g, torch.bfloat16, None, True)

    return [
        (scaled.AG_KIND, scaled.variants(scaled.AG_KIND), gather,
         lambda results: max(_error(outs[0], gathered_ref) for _, outs, _ in results)),
        (scaled.RS_KIND, scaled.variants(scaled.RS_KIND, 1), scatter,
         lambda results: max(_error(out, scattered_ref[r]) for r, out in enumerate(results))),
    ]  # fmt: skip


def _error(got, want) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def _first_calls(ahead: bool, float8: bool, world: int, rows: int, k: int, n: int) -> list[tuple[str, float, float]]:
    """(op and variant, seconds of its first call, relative error) for every fused config."""
    import torch

    from overlap_pass.templates.launch import compiling_ahead
    from tests.sim_world import SimWorld

    gen = torch.Generator(device="cuda").manual_seed(0)
    sim = SimWorld(world)
    ops = (_float8_ops if float8 else _bf16_ops)(world, rows, k, n, gen)
    found = []
    with compiling_ahead(ahead):
        for op, variants, call, worst in ops:
            for name, variant in variants.items():
                if name.startswith("fused"):
                    start = time.perf_counter()
                    results = sim.run(prepare=sim.poison, call=functools.partial(call, variant))
                    found.append((f"{op} {name}", time.perf_counter() - start, worst(results)))
    return found


def _run_child(ahead: bool, args) -> list:
    """One run in a process of its own, with an empty Triton cache."""
    command = [
        sys.executable, "-m", "benchmarks.first_calls", "--child", "on" if ahead else "off", "--world", str(args.world),
        "--rows", str(args.rows), "--k", str(args.k), "--n", str(args.n), *(["--float8"] if args.float8 else []),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run(command, env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a run failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="simulated ranks")
    parser.add_argument("--rows", type=int, default=8192, help="gathered rows (tokens), a multiple of --world")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=7168)
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode")
    parser.add_argument("--float8", action="store_true", help="the float8 ops (e4m3, rowwise scales)")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_first_calls(args.child == "on", args.float8, args.world, args.rows, args.k, args.n)))
        return 0
    runs = {False: [], True: []}
    for _ in range(args.runs):
        for ahead in (False, True):
            runs[ahead].append(_run_child(ahead, args))
    dtype = "float8" if args.float8 else "bf16"
    print(f"first calls, seconds (runs side by side), W={args.world}, {args.rows} x {args.k} x {args.n} {dtype}")
    print(f"{'op and variant':48s} {'one after another':>20s} {'compiling ahead':>20s}  max error")
    for i, (name, _, _) in enumerate(runs[False][0]):
        cells = [" / ".join(f"{run[i][1]:.2f}" for run in runs[ahead]) for ahead in (False, True)]
        worst = max(run[i][2] for ahead in (False, True) for run in runs[ahead])
        print(f"{name:48s} {cells[0]:>20s} {cells[1]:>20s}  {worst:.2e}")
    totals = [" / ".join(f"{sum(t for _, t, _ in run):.1f}" for run in runs[ahead]) for ahead in (False, True)]
    print(f"{'total':48s} {totals[0]:>20s} {totals[1]:>20s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
