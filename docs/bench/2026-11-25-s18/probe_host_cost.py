"""Host time of one float8 op call as a compiled model makes it (torch.ops.overlap.* -> the CUDA
dispatch's fast path -> replay.py's per-call graph replayed), in the simulated world at W=2 on
one GPU (tests/sim_world.py), next to eager launches of what NCCL + cuBLAS would queue for the
matmul part (one _scaled_mm per weight), at small shapes (below). The question it answers: whether overlap's float8 ops,
now replaying graphs, cost the host much more than the plain graph's kernels (session 15 read
its W=2 float8 run as host-bound). Not a GPU timing: the ranks share one GPU.

    PYTHONPATH=$PWD python3 docs/bench/2026-11-25-s18/probe_host_cost.py

The op's choice is fixed here (dispatch._resolve patched to the named variant: sim groups are
not process groups); everything after it runs as in a model.
"""

import cProfile
import pstats
import statistics
import sys
import time

import torch

from overlap_pass import config, scaled_ops  # noqa: F401  (scaled_ops registers the ops)
from overlap_pass.lowering import dispatch, replay, scaled
from tests import sim_world
from tests.sim_world import SimWorld

FP8 = torch.float8_e4m3fn
ROUNDS, WARMUP = 60, 4


def _pinned_choice(name):
    def resolve(kind, fast_key, group_name, world_size, variants, shapes, dtype, device, args):
        run = dispatch.variant_calls(kind, fast_key, variants)[name]
        dispatch._RESOLVED[fast_key] = run
        return run

    return resolve


def _host_us(world, op_call):
    """Median host µs of rank 0's call over ROUNDS rounds (every rank calls each round; the
    outputs dropped between rounds, so the next round's land where these did)."""
    world.run(op_call)  # its warm-up loads every kernel first (tests/sim_world.py), then a checked round
    samples = []
    for round_ in range(WARMUP + ROUNDS):
        spent = []

        def call(rank, group_name):
            start = time.perf_counter()
            out = op_call(rank, group_name)
            spent.append(time.perf_counter() - start)
            return out

        with config.patch(spin_limit=sim_world.SPIN_LIMIT):  # as world.run calls
            results = world._queue(call)
        torch.cuda.synchronize()
        del results
        if round_ >= WARMUP:
            samples.append(spent[0] * 1e6)
    return statistics.median(samples)


def main():
    torch.manual_seed(0)
    world = SimWorld(2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # Llama 3 8B's Q, K, V proportions, small: one simulated rank's persistent kernel must leave
    # SMs free for the other's work (a sim-world limit, not a real one); host time barely
    # depends on the shapes
    dim, seq, ns = 512, 256, (256, 128, 128)
    shards = [torch.randn(1, seq, dim, generator=gen, device="cuda").to(FP8) for _ in range(2)]
    shard_scales = [torch.rand(1, seq, 1, generator=gen, device="cuda") + 0.5 for _ in range(2)]
    mat2s = [torch.randn(n, dim, generator=gen, device="cuda").to(FP8).t() for n in ns]
    mat2_scales = [torch.rand(1, n, generator=gen, device="cuda") + 0.5 for n in ns]
    # the backward's input gradient of Q, K, V: their gradients (every rank's rows) times the weights
    grads = [[torch.randn(1, 2 * seq, n, generator=gen, device="cuda").to(FP8) for n in ns] for _ in range(2)]
    grad_scales = [[torch.rand(1, 2 * seq, 1, generator=gen, device="cuda") + 0.5 for _ in ns] for _ in range(2)]
    weights = [torch.randn(dim, n, generator=gen, device="cuda").to(FP8).t() for n in ns]  # [n, dim] as K x N
    weight_scales = [torch.rand(1, dim, generator=gen, device="cuda") + 0.5 for _ in ns]
    bf16 = torch.bfloat16

    def gather(rank, g):
        return torch.ops.overlap.all_gather_scaled_matmul(
            shards[rank], shard_scales[rank], mat2s, mat2_scales, [None] * 3, 1, 2, g, bf16, True
        )

    def scatter_sum(rank, g):
        return torch.ops.overlap.scaled_matmul_reduce_scatter(
            grads[rank], grad_scales[rank], weights, weight_scales, None, "sum", 1, 2, g, bf16, None, False
        )

    rows = []
    gluon = next(n for n in scaled.variants(scaled.AG_KIND) if "gluon" in n)
    for label, op_call, variant in (
        ("all_gather_scaled_matmul, Q K V, Gluon", gather, gluon),
        ("all_gather_scaled_matmul, Q K V, copy engine", gather, "copy_engine_cublas"),
        ("scaled_matmul_reduce_scatter, Q+K+V grad sum, exact, Gluon", scatter_sum, gluon),
        ("scaled_matmul_reduce_scatter, Q+K+V grad sum, exact, copy engine", scatter_sum, "copy_engine_cublas"),
    ):
        dispatch._RESOLVED.clear()
        dispatch._resolve = _pinned_choice(variant)
        before = dict(replay.stats)
        us = _host_us(world, op_call)
        replayed = replay.stats["replayed"] - before.get("replayed", 0)
        rows.append((label, us, f"{replayed} replayed of {2 * (WARMUP + ROUNDS)} calls"))
        if "--profile" in sys.argv and variant == gluon:  # where the host time goes, both ranks' calls
            profile = cProfile.Profile()
            profile.enable()
            _host_us(world, op_call)
            profile.disable()
            print(f"== {label}: {2 * (WARMUP + ROUNDS)} calls (and the probe's loop)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(18)

    gathered = torch.cat(shards, dim=1).view(-1, dim)
    scale = torch.cat(shard_scales, dim=1).view(-1, 1)

    def cublas():
        return [torch._scaled_mm(gathered, m, scale, s, out_dtype=bf16, use_fast_accum=True) for m, s in zip(mat2s, mat2_scales)]

    for _ in range(WARMUP):
        cublas()
    torch.cuda.synchronize()
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        outs = cublas()
        samples.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        del outs
    rows.append(("3 x _scaled_mm, eager (the matmuls NCCL + cuBLAS queue)", statistics.median(samples), ""))
    for ws in world._workspaces:
        ws.check_timeouts()  # no wait gave up: the calls timed did their work
    world.close()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call, rank 0, median of {ROUNDS}")
    print("| call | host µs | |\n|---|---|---|")
    for label, us, note in rows:
        print(f"| {label} | {us:.0f} | {note} |")


if __name__ == "__main__":
    main()
