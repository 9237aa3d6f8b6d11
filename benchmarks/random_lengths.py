"""Shapes that change: one compiled TP/SP block called at random token counts, every call checked.

    torchrun --nproc-per-node 2 -m benchmarks.random_lengths --calls 1000
    torchrun --nproc-per-node 2 -m benchmarks.random_lengths --size small --calls 200 --repeat 2 --profile 20

The sequence-parallel transformer block (benchmarks/tp_models, DTensor's ColwiseParallel and
RowwiseParallel, Llama 3 8B widths by default) is compiled once with backend="overlap". Each call
draws a sequence of --min-tokens to --max-tokens tokens (a multiple of W: each rank holds an
equal shard, odd counts a rank included; --layout plain: plain TP, the whole sequence on every
rank, any count, padded where W does not divide it), runs forward and backward, and compares the output and
the input's gradient with the same block run eagerly (NCCL + cuBLAS) on the same input; the
same step compiled by plain Inductor is timed beside it. From the second count on,
torch.compile runs a graph with a symbolic token dim (automatic dynamic).

Printed last: calls and mismatches; the overlap op calls and the path each took (symmetric-memory
variants eager, captured or replayed from per-call CUDA graphs; NCCL + cuBLAS where the per-shape
choice picked it); per token bucket, the step that measured its choice, the steps that ran a
step of a measurement over calls (OVERLAP_PASS_MEASURE_OVER_CALLS=1), the steps that ran no
overlap op (a count's first calls on plain Inductor's graph), the steps at counts new to the
process, at a count's second call and at its later ones (--repeat), plain Inductor's beside
each (the two compilers' steps in turns, each first at every other call), and the slowest step;
device memory in use (cudaMemGetInfo) after the first checked call and at the end; with
--profile, rank 0's host time at new counts. Exit status 1 on any mismatch.

The ops run their chosen variants from a call signature's first call (OVERLAP_PASS_FUSED_FROM_CALL
is 1 here unless set): the fused path is what each call checks. Set it to 8, the default
elsewhere, to time what a count's first calls cost a user (plain Inductor's graph at its first
seven, config.plain_graph_at_new_counts).
"""

import argparse
import collections
import contextlib
import copy
import faulthandler
import logging
import os
import random
import statistics
import time

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.measure import OVERLAP_OPS, overlap_op_calls, relative_error, slowest  # noqa: E402

# (dim, heads, K/V heads, hidden)
SIZES = {"llama3-8b": (4096, 32, 8, 14336), "small": (1024, 8, 8, 3584)}
TOLERANCE = 2e-2  # bf16, another summation order than eager's (as choose.py's check)
def _block(size: str, layout: str, mesh):
    from benchmarks.tp_models import TransformerBlock, parallelize_block, parallelize_block_plain

    dim, heads, kv_heads, hidden = SIZES[size]
    torch.manual_seed(0)  # the same full weights on every rank
    block = TransformerBlock(dim=dim, heads=heads, hidden=hidden, kv_heads=kv_heads)
    parallelize = parallelize_block if layout == "sp" else parallelize_block_plain
    return parallelize(block.to(device="cuda", dtype=torch.bfloat16), mesh), dim


def _step(model, shard: torch.Tensor, grad: torch.Tensor):
    x = shard.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    for p in model.parameters():
        p.grad = None
    return out.detach(), x.grad


def _memory_in_use() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", choices=sorted(SIZES), default="llama3-8b")
    parser.add_argument("--layout", choices=("sp", "plain"), default="sp",
                        help="sequence parallel, or plain TP (the whole sequence on every rank, any token count)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="calls at each drawn count (the later ones steady)")
    parser.add_argument("--profile", type=int, default=0,
                        help="profile rank 0's compiled steps at counts new to it (up to this many calls), printed last")  # fmt: skip
    parser.add_argument("--progress-every", type=int, default=50, help="calls between two progress lines (rank 0)")
    parser.add_argument("--no-inductor", action="store_true", help="check overlap's steps only (no plain Inductor beside)")
    parser.add_argument("--stacks-after", type=float, default=0, help="dump every thread's stack after this many s")
    args = parser.parse_args()
    if args.stacks_after:
        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("overlap_pass").setLevel(logging.INFO)  # choices measured, variants out

    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_pass.lowering import choose, dispatch, replay, symm

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    eager, dim = _block(args.size, args.layout, init_device_mesh("cuda", (world,)))
    compiled = torch.compile(copy.deepcopy(eager), backend="overlap")
    inductor = torch.compile(copy.deepcopy(eager), backend="inductor")  # the same step, plain
    counting = contextlib.ExitStack()
    # counted: each op call, each call signature resolved (a new shape's variant), their host time
    op_calls = counting.enter_context(overlap_op_calls(also=("_first_call",)))

    draw = random.Random(args.seed)  # the same counts on every rank
    # tokens a rank (sp), or a sequence (plain: any count, W need not divide it)
    low, high = (-(-args.min_tokens // world), args.max_tokens // world) if args.layout == "sp" else (args.min_tokens, args.max_tokens)
    mismatches, memory = [], {}
    # bucket -> kind of call -> (overlap's step times, plain Inductor's), ms
    kinds = ("measured", "trial steps", "plain graph", "new count", "second call", "later calls")
    times = collections.defaultdict(lambda: {kind: ([], []) for kind in kinds})
    calls_at = collections.Counter()  # token count -> its calls so far
    host = collections.defaultdict(list)  # kind of call -> host ms in overlap's ops a step (rank 0)
    seen = set()  # token counts run so far
    profiles = []  # rank 0's host time of steps at counts new to it, their bucket's choice known
    start = time.perf_counter()
    for call in range(args.calls):
        if rank == 0 and call % args.progress_every == 0:
            print(f"call {call}: {time.perf_counter() - start:.0f} s, {len(mismatches)} mismatches", flush=True)
        if call % max(args.repeat, 1) == 0:
            rows = draw.randint(low, high)
        calls_at[rows] += 1
        gen = torch.Generator(device="cuda").manual_seed(args.seed * 100003 + call)
        if args.layout == "sp":
            full = torch.randn(args.batch, rows * world, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            shard = full.chunk(world, dim=1)[rank].contiguous()
        else:  # the whole sequence on every rank (the same generator seed)
            shard = torch.randn(args.batch, rows, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        grad = torch.randn(shard.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        # eager first: the libraries' per-shape setup that every compiler pays alike (cuDNN
        # attention's plans: 100 ms to 1 s at a new count, H100) is not charged to whichever runs first
        ref_out, ref_grad = _step(eager, shard, grad)
        measured_before = sum(c.get("source") == "measured" for c in choose.CHOICES.values())
        trial_steps_before = choose.stats["trial steps"]
        graphs_before, resolved_before = counters["stats"]["unique_graphs"], op_calls["_first_call"]
        host_before = op_calls["host s"]
        ops_before = sum(op_calls[name] for name in OVERLAP_OPS)
        # rank 0 slowed by the profiler at a compile would leave its peers' waits to give up
        past_compiles = call >= 2 * max(args.repeat, 1)
        profiler = None
        if rank == 0 and past_compiles and len(profiles) < args.profile:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)

        def timed_overlap():
            torch.cuda.synchronize()
            begin = time.perf_counter()
            with profiler or contextlib.nullcontext():
                result = _step(compiled, shard, grad)
                torch.cuda.synchronize()
            return slowest(time.perf_counter() - begin, device), result

        def timed_inductor():
            if args.no_inductor:
                return float("nan")
            torch.cuda.synchronize()
            begin = time.perf_counter()
            _step(inductor, shard, grad)
            torch.cuda.synchronize()
            return slowest(time.perf_counter() - begin, device)

        # each compiler first at every other call: neither always in the slot after eager's step
        if call % 2:
            plain = timed_inductor()
            took, (out, x_grad) = timed_overlap()
        else:
            took, (out, x_grad) = timed_overlap()
            plain = timed_inductor()
        errors = (relative_error(out, ref_out), relative_error(x_grad, ref_grad))
        if not all(e < TOLERANCE for e in errors):  # NaN fails too
            mismatches.append((call, rows, errors))
        shard_rows = rows * args.batch if args.layout == "sp" else -(-rows * args.batch // world)  # (padded)
        bucket = choose.token_bucket(shard_rows)
        if counters["stats"]["unique_graphs"] != graphs_before:
            seen.add(rows)
            continue  # a compile: not an op's cost
        new = rows not in seen
        seen.add(rows)
        if sum(c.get("source") == "measured" for c in choose.CHOICES.values()) > measured_before:
            kind = "measured"  # a bucket's choice measured in this call (or decided, over calls)
        elif choose.stats["trial steps"] > trial_steps_before:
            kind = "trial steps"  # an op's call ran a step of its choice's measurement over calls
        elif sum(op_calls[name] for name in OVERLAP_OPS) == ops_before:
            kind = "plain graph"  # a count's first calls, on plain Inductor's graph (new_counts.py)
        else:
            kind = "new count" if new else "second call" if calls_at[rows] == 2 else "later calls"
            if new and op_calls["_first_call"] > resolved_before and profiler is not None:
                profiles.append(profiler)
        host[kind].append((op_calls["host s"] - host_before) * 1e3)
        times[bucket][kind][0].append(took * 1e3)
        times[bucket][kind][1].append(plain * 1e3)
        if "after_first" not in memory:
            memory["after_first"] = _memory_in_use()
    memory["end"] = _memory_in_use()
    memory["reserved"] = torch.cuda.memory_reserved()
    memory["symmetric"] = symm.bytes_held()
    memory["graphs"] = replay.graphs_held()
    counting.close()
    failed = int(slowest(len(mismatches), device))
    if rank == 0:
        _report(args, world, op_calls, replay.stats, times, host, memory, len(dispatch._RESOLVED), mismatches, failed)
        if profiles:
            _print_profile(profiles)
    dist.destroy_process_group()
    return 1 if failed else 0


def _print_profile(profiles: list) -> None:
    print(f"\nrank 0's host time in {len(profiles)} compiled steps at counts new to the process (their buckets'")
    print("choices known, no compile), by op (torch.profiler), the first step's then the last's:")
    for profiler in (profiles[0], profiles[-1]):
        table = profiler.key_averages(group_by_stack_n=8).table(sort_by="self_cpu_time_total", row_limit=12)
        print(table)


def _report(args, world, op_calls, paths, times, host, memory, kept, mismatches, failed) -> None:
    print(f"\n{args.calls} calls at W={world}, {args.min_tokens}-{args.max_tokens} tokens, batch {args.batch}, "
          f"{args.size}, {args.layout}, forward+backward, every output and input gradient against eager")  # fmt: skip
    for call, rows, errors in mismatches[:20]:
        print(f"  MISMATCH call {call}: {rows} tokens a rank, relative errors {errors[0]:.3g} / {errors[1]:.3g}")
    print(f"mismatches: {failed} (slowest rank); rank 0: {len(mismatches)}")
    resolved = op_calls.pop("_first_call", 0)
    op_calls.pop("host s", None)
    print(f"overlap op calls: {dict(op_calls)}, {resolved} of them a signature's first; symmetric-memory "
          f"variant calls: {dict(paths)} (the rest ran NCCL + cuBLAS, as chosen); signatures kept: {kept}")  # fmt: skip
    print("Steps (forward+backward, slowest rank, ms, median) compiled by overlap | by plain Inductor, by what")
    print("the call was: one that measured a bucket's choice (or decided it, measured over calls), one")
    print("whose ops ran steps of such a measurement (median / max), one that ran no overlap op (a count's")
    print("first calls, on plain Inductor's graph), or else the first at its token count (its bucket's choice,")
    print("or a bucket's next to it), a count's second call, or a later one (--repeat).")
    print("| tokens (bucket) | measured: calls, overlap max | Inductor | trial steps: calls, overlap median / max "
          "| Inductor | plain graph: calls, overlap | Inductor | new count: calls, overlap | Inductor "
          "| second call: calls, overlap | Inductor | later calls: calls, overlap | Inductor |")  # fmt: skip
    print("|" + "---|" * (1 + 2 * len(next(iter(times.values())))))
    for bucket in sorted(times):
        cells = []
        for kind, (ours, plain) in times[bucket].items():
            if not ours:
                cells += ["0", ""]
                continue
            mine = f"{statistics.median(ours):.1f}"
            mine = {"measured": f"{max(ours):.1f}", "trial steps": f"{mine} / {max(ours):.1f}"}.get(kind, mine)
            plain = [t for t in plain if t == t]  # (NaN: --no-inductor)
            cells += [f"{len(ours)}, {mine}", f"{statistics.median(plain):.1f}" if plain else ""]
        print(f"| <= {bucket} | " + " | ".join(cells) + " |")
    took, bucket, kind = max((max(ours), b, k) for b in times for k, (ours, _) in times[b].items() if ours)
    print(f"overlap's slowest step (no compile): {took:.1f} ms, {kind} at <= {bucket} tokens")
    print("Host time in overlap's op calls a step (rank 0, ms, median): " + ", ".join(
        f"{kind} {statistics.median(ms):.1f}" for kind, ms in host.items() if ms))  # fmt: skip
    print(f"device memory in use: {memory.get('after_first', 0) / 2**20:.0f} MiB after the first checked call, "
          f"{memory['end'] / 2**20:.0f} MiB at the end (rank 0), {memory['reserved'] / 2**20:.0f} MiB of it reserved "
          "by the caching allocator (the three compiles' activations, which grow with the largest count so far)")  # fmt: skip
    symmetric, (graphs, signatures) = memory["symmetric"], memory["graphs"]
    print(f"overlap holds: symmetric workspaces {symmetric['in use'] / 2**20:.0f} MiB in use, "
          f"{symmetric['retired'] / 2**20:.0f} MiB retired by growth; {graphs} per-call CUDA graphs of "
          f"{signatures} call signatures")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
