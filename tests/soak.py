"""Soak of the CUDA variants on one GPU: many calls of every symmetric-memory variant of both
ops (bf16 and float8, one matmul and sums of two; one block config per fused kernel), at random
shapes, eager and replayed from per-call CUDA graphs interleaved, on W ranks simulated in one
process (tests/sim_world.py), every rank's result of every call checked against an fp32
reference computed from every rank's operands (tests/gpu/variant_cases.py: new random operands
per call, outputs and workspaces poisoned before it).

    python3 -m tests.soak --calls 1000 --world 2
"""

import argparse
import collections
import random
import sys
import time

# hidden, FFN, Q width, and K's and V's width each (Llama 3 8B and 70B)
LLAMA = {"8B": (4096, 14336, 4096, 1024), "70B": (8192, 28672, 8192, 1024)}
TOKENS = (64, 96, 128, 256)  # rows per rank of the aligned calls (batch 2)
KEPT = 24  # problems kept for replayed calls (a replay needs the addresses of an earlier call)
REPEAT = 0.75  # share of replayed calls made on a kept problem (the others make a new one)
FAILURES_SHOWN = 20

DESCRIPTION = """\
Soak of every symmetric-memory CUDA variant of all_gather_matmul, matmul_reduce_scatter and
their float8 forms (bf16 and float8 rowwise with fast accumulation; one block config per fused
kernel: the Triton TMA and pointer-load kernels, the Gluon ones on Hopper), eager and replayed
from per-call CUDA graphs interleaved, on W ranks simulated in one process. Needs one CUDA GPU
(float8: one with float8 tensor cores); NCCL's own variant is not run (it needs NCCL ranks)."""

EPILOG = """\
Shapes: the tensor-parallel matmuls of Llama 3 8B and 70B (all-gather: QKV and gate+up, K the
hidden size, N their widths / W; reduce-scatter: O and down, K their widths / W, N the hidden
size; sums of two: the input gradients of Q with K+V and of gate with up), every width divided
by --scale (default 16, so 1000 calls take a few minutes, Triton compilation included) and
rounded down to a multiple of 16 (at least 64). Aligned calls: batch 2, 64 to 256 tokens per
rank, every size a multiple of 16 (the quick GPU tier's kernels serve them). Ragged calls
(--ragged of them, default a quarter): batch 1, tokens per rank not a multiple of 16, and for
bf16 N and K 8 below a multiple of 16 (float8 keeps them multiples of 16, as _scaled_mm and TMA
need). A call counts once for all W ranks. Exit status 1 on any mismatch or timeout."""


def _width(value: int, world: int, scale: int) -> int:
    return max(64, value // scale // world // 16 * 16)


def llama_matmuls(world: int, scale: int) -> dict[str, list[tuple[tuple[int, ...], int]]]:
    """Per kind of op ("all_gather", "reduce_scatter", "sum"), the (Ks, N) of each of Llama 3's
    tensor-parallel matmuls on ``world`` ranks, every width divided by ``scale``."""
    matmuls = collections.defaultdict(list)
    for hidden, ffn, q, kv in LLAMA.values():
        h = _width(hidden, 1, scale)
        matmuls["all_gather"] += [((h,), _width(q + 2 * kv, world, scale)), ((h,), _width(2 * ffn, world, scale))]
        matmuls["reduce_scatter"] += [((_width(q, world, scale),), h), ((_width(ffn, world, scale),), h)]
        matmuls["sum"] += [
            ((_width(q, world, scale), _width(2 * kv, world, scale)), h),
            ((_width(ffn, world, scale),) * 2, h),
        ]  # fmt: skip
    return matmuls


def draw_shape(rng: random.Random, op: str, matmuls: dict, ragged: float):
    """A random shape of ``op`` (a variant_cases.tables() key)."""
    from tests.gpu.variant_cases import Shape

    if op.endswith(":sum"):
        ks, n = rng.choice(matmuls["sum"])
    else:
        ks, n = rng.choice(matmuls["all_gather" if op.startswith("all_gather") else "reduce_scatter"])
    if rng.random() >= ragged:
        return Shape(2, rng.choice(TOKENS), ks, n)
    tokens = rng.choice([t for t in range(17, 256) if t % 16])
    if "scaled" in op:
        return Shape(1, tokens, ks, n)
    return Shape(1, tokens, tuple(k - 8 for k in ks), n - 8)


def _captures(count: int) -> str:
    return f"{count} rank calls captured in its rounds"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.soak", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--calls", type=int, default=1000, help="calls to make (each on every rank; default 1000)")
    parser.add_argument("--world", type=int, default=2, help="simulated ranks (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shapes, variants and operands")
    parser.add_argument("--scale", type=int, default=16, help="Llama 3's widths divided by this (default 16)")
    parser.add_argument("--ragged", type=float, default=0.25, help="share of ragged calls (default 0.25)")
    parser.add_argument(
        "--checked-captures", action="store_true",
        help="check the round in which a replayed call's new tensors are captured (by default it is a warm-up "
        "round: in one process the capture of one rank can outlast the bound its peer's graph spins for)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: no limit)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("tests.soak needs a CUDA GPU", file=sys.stderr)
        return 2
    from overlap_pass.lowering import replay, symm

    from tests.gpu import variant_cases as cases
    from tests.sim_world import SimWorld

    device = torch.device("cuda", torch.cuda.current_device())
    variants = collections.defaultdict(list)  # op -> [(name, variant)]
    for op, kind, name in cases.quick_variants():
        if name != cases.BASELINE and cases.unusable(op, kind, device) is None:
            variants[op].append((name, cases.tables()[op][name]))
    ops = sorted(variants)
    matmuls = llama_matmuls(args.world, args.scale)
    rng = random.Random(args.seed)
    world = SimWorld(args.world)
    kept = []  # (op, name, variant, problem) that replayed calls repeat
    warmed = set()  # shapes (eager) and problems (replayed) called before: no warm-up round
    counts, per_variant = collections.Counter(), collections.Counter()
    failures, refusals = [], set()
    replayed_before = replay.stats["replayed"]
    start = time.perf_counter()
    print(f"soak: {args.calls} calls on {args.world} simulated ranks, {torch.cuda.get_device_name(device)}", flush=True)
    for index in range(args.calls):
        if args.seconds and time.perf_counter() - start > args.seconds:
            print(f"soak: stopped after {args.seconds:.0f} s (--seconds)")
            break
        mode = rng.choice(cases.MODES)
        if mode == "replayed" and kept and rng.random() < REPEAT:
            op, name, variant, problem = rng.choice(kept)
        else:
            op = rng.choice(ops)
            name, variant = rng.choice(variants[op])
            shape = draw_shape(rng, op, matmuls, args.ragged)
            avg = "reduce_scatter" in op and rng.random() < 0.5
            problem = cases.make(op, shape, args.world, device, seed=rng.randrange(1 << 31), avg=avg)
            if mode == "replayed":
                kept.append((op, name, variant, problem))
                if len(kept) > KEPT:
                    old_op, old_name, _, old = kept.pop(0)
                    cases.forget(old, old_name, world.group_names)
                    warmed.discard((old_op, old_name, id(old)))  # its id may be reused
        # A new shape gets SimWorld's warm-up round. New tensors of a replayed call get two:
        # replay.py's first sighting, then its capture, which in one process happens on the host
        # while the peer rank's graph, launched right after its own capture, already spins.
        key = (op, name, problem.shape) if mode == "eager" else (op, name, id(problem))
        warm_up = 0 if key in warmed else 1 if mode == "eager" or args.checked_captures else 2
        label = f"call {index}: {op} {name} {mode} {problem.shape} {problem.reduce_op}"
        captured = replay.stats["captured"]
        try:
            bad = cases.run_in(world, problem, name, variant, mode, warm_up=warm_up)
        except NotImplementedError as refused:  # before the barrier, on every rank alike
            counts["refused"] += 1
            refusals.add(f"{op} {name}: {refused}")
            continue
        except symm.ChunkTimeout as timeout:  # the world refuses calls from then on: a new one
            counts["timeouts"] += 1
            failures.append(f"{label}, {_captures(replay.stats['captured'] - captured)}: {timeout}")
            for _, old_name, _, old in kept:
                cases.forget(old, old_name, world.group_names)
            kept.clear()
            warmed.clear()
            world.close()
            world = SimWorld(args.world)
            continue
        warmed.add(key)
        counts["calls"] += 1
        counts[mode] += 1
        counts["ragged"] += problem.shape.batch == 1
        per_variant[(op, name)] += 1
        if any(bad.values()):
            counts["mismatches"] += 1
            failures.append(f"{label}, {_captures(replay.stats['captured'] - captured)}: {bad}")
        if (index + 1) % 100 == 0:
            print(
                f"  {index + 1} calls: {counts['mismatches']} mismatches, {counts['timeouts']} timeouts, "
                f"{time.perf_counter() - start:.0f} s", flush=True,
            )  # fmt: skip
    elapsed = time.perf_counter() - start
    world.close()
    for failure in failures[:FAILURES_SHOWN]:
        print("FAIL", failure)
    for refusal in sorted(refusals):
        print("refused", refusal)
    for op in ops:
        names = ", ".join(f"{name} {per_variant[(op, name)]}" for name, _ in variants[op])
        print(f"  {op}: {names}")
    replays = replay.stats["replayed"] - replayed_before
    print(
        f"soak: {counts['calls']} calls in {elapsed:.1f} s ({counts['eager']} eager, {counts['replayed']} replayed, "
        f"{replays} rank calls replayed from a graph; {counts['ragged']} ragged): {counts['mismatches']} mismatches, "
        f"{counts['timeouts']} timeouts, {counts['refused']} refused"
    )  # fmt: skip
    return 1 if counts["mismatches"] or counts["timeouts"] else 0


if __name__ == "__main__":
    sys.exit(main())
