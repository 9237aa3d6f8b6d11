"""The overlap demo: a tensor-parallel / sequence-parallel transformer block compiled with
backend="overlap", against plain Inductor.

    python3 -m tools.demo                      # all GPUs (NCCL), or 2 gloo ranks on CPU
    python3 -m tools.demo --world-size 4 --dim 512

Starts its own ranks. Prints which collective -> matmul patterns were rewritten (and why any were
not), the compiled block's numerics against eager, and its training-step time against plain
Inductor, timed as a training loop runs: rounds of back-to-back steps (forward, backward,
gradients dropped), the two compilers' rounds interleaved, the median round of the slowest rank.

- Two GPUs or more: the block is Llama 3 8B's (grouped-query attention) over 8192 tokens, as in
  docs/benchmarks.md; with --batch above 1 each sequence has 8192 / batch tokens.
- CPU (gloo): a small block; the ops run their reference decomposition over point-to-point
  messages, which shows the rewrite and its numerics, not a speedup.
- Exactly one GPU: the CPU demo, then both ops' CUDA variants on that GPU at W=2 with the ranks
  simulated in one process (tests/sim_world.py, from a checkout), each checked against an fp32
  reference and timed against cuBLAS doing the same matmuls.
"""

import argparse
import os
import socket
import statistics
import tempfile
import time
import warnings

from tools.run_env import set_defaults  # noqa: E402

set_defaults()  # NVLink multicast off, bounded waits (before torch and overlap_pass read them)
# torch imports numpy where it is installed and warns where it is not ("Failed to initialize
# NumPy", from torch/_subclasses/functional_tensor.py at compile time); the demo needs no numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.measure import relative_error, slowest  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _per_call(fn, calls: int, device: torch.device) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``, the device idle before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _errors_against_eager(model, out, dx, eager, out_e, dx_e) -> tuple[float, float, float]:
    """||x - eager|| / ||eager|| of the output, the input grad and (worst) weight grad."""
    params = getattr(model, "_orig_mod", model).parameters()
    weights = max(relative_error(_local(p.grad), _local(q.grad)) for p, q in zip(params, eager.parameters()))
    return relative_error(out, out_e), relative_error(dx, dx_e), weights


def _rank_main(rank: int, args, port: int, dump_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import overlap_pass
    from tools import inspect_dump
    from benchmarks.tp_models import TransformerBlock, parallelize_block

    use_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=args.world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        **({"device_id": device} if use_cuda else {}),
    )
    world = args.world_size
    dtype = torch.bfloat16 if use_cuda else torch.float32
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    block = TransformerBlock(args.dim, args.heads, args.hidden, bias=args.bias, kv_heads=args.kv_heads)
    block = parallelize_block(block.to(device=device, dtype=dtype), mesh)
    eager = block
    inductor = torch.compile(copy.deepcopy(block))
    with overlap_pass.config.patch(debug_dir=dump_dir):
        overlapped_model = copy.deepcopy(block)
        overlapped = torch.compile(overlapped_model, backend="overlap")

        torch.manual_seed(1 + rank)
        x = torch.randn(args.batch, args.seq // world, args.dim, device=device, dtype=dtype)
        grad = torch.randn_like(x)

        def step(model, inp):
            inp = inp.detach().requires_grad_()
            out = model(inp)
            out.backward(grad)
            return out, inp.grad

        # First calls compile (forward and backward) and give the numbers to compare.
        out_e, dx_e = step(eager, x)
        out_o, dx_o = step(overlapped, x)
    out_i, dx_i = step(inductor, x)
    errors = {
        name: {
            "overlap": _errors_against_eager(overlapped_model, out_o, dx_o, eager, out_e, dx_e)[i],
            "inductor": _errors_against_eager(inductor, out_i, dx_i, eager, out_e, dx_e)[i],
        }
        for i, name in enumerate(("output", "input grad", "weight grads"))
    }

    def train_step(model):
        step(model, x)
        for p in model.parameters():  # as optimizer.zero_grad() does
            p.grad = None

    compiled = {"inductor": inductor, "overlap": overlapped}
    times = {name: [] for name in compiled}
    for round_ in range(args.warmup + args.rounds):
        for name, model in compiled.items():  # interleaved, so drift hits both alike
            seconds = _per_call(lambda: train_step(model), args.calls, device)
            if round_ >= args.warmup:
                times[name].append(seconds)
    times = {name: slowest(statistics.median(t), device) for name, t in times.items()}

    if rank == 0:
        print(
            f"\noverlap demo: TP/SP transformer block, world size {world} "
            f"({'NCCL on ' + torch.cuda.get_device_name(device) if use_cuda else 'gloo on CPU'}), "
            f"{str(dtype).replace('torch.', '')}, batch {args.batch}, seq {args.seq}, dim {args.dim}, "
            f"hidden {args.hidden}, heads {args.heads} (K/V {args.kv_heads}), bias {args.bias}"
        )
        print(f"torch {torch.__version__}\n\nPatterns (dump: {dump_dir}/rank0):")
        print(inspect_dump.format_table(inspect_dump.rows(os.path.join(dump_dir, "rank0"))))
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        print(f"\nNumerics against eager, ||x - eager|| / ||eager|| (tolerance {tol:g}):")
        print(f"  {'':<13} {'overlap':>9}  {'plain Inductor':>14}")
        for name, err in errors.items():
            verdict = "ok" if err["overlap"] <= tol else "MISMATCH"
            print(f"  {name:<13} {err['overlap']:9.2e}  {err['inductor']:14.2e}  {verdict}")
        inductor_ms, overlap_ms = times["inductor"] * 1e3, times["overlap"] * 1e3
        print(f"\nTraining step (forward+backward), median of {args.rounds} rounds of {args.calls} steps, slowest rank:")
        print(f"  plain Inductor       {inductor_ms:9.3f} ms")
        print(f"  backend=\"overlap\"    {overlap_ms:9.3f} ms  ({inductor_ms / overlap_ms:.2f}x)")
        if not use_cuda:
            print(
                "  (on CPU the ops run the reference decomposition over gloo point-to-point "
                "messages: it shows the schedule, not a speedup)"
            )
    mismatch = rank == 0 and any(err["overlap"] > tol for err in errors.values())
    # tear down together: a rank that destroyed its gloo group while rank 0 still printed once
    # aborted at exit ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    if mismatch:
        raise SystemExit("numerics mismatch")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _simulated_ranks_on_one_gpu(world: int = 2, tokens: int = 1024, K: int = 1024, N: int = 1024) -> bool:
    """Both ops' CUDA variants at ``world`` ranks simulated on this one GPU (tests/sim_world.py),
    on one shape: each checked against an fp32 reference and timed against cuBLAS running the
    same matmuls for every rank. The ranks share the GPU, so a ratio is what the protocol costs
    here, not a speedup. A small shape: one simulated rank's spinning kernels hold SMs the other
    needs, and at 2048 tokens and more some waits outlast the simulated world's spin limit on an
    H100. Returns whether every variant matched its reference."""
    try:
        from tests.sim_world import SimWorld
    except ImportError:  # an installed copy, without the repository's tests
        print("\n(one GPU: run the demo from a checkout to see the ops' CUDA variants on it)")
        return True
    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import matmul_reduce_scatter as mrs

    gen = torch.Generator(device="cuda").manual_seed(0)
    full = torch.randn(1, tokens, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(N, K, generator=gen, device="cuda", dtype=torch.bfloat16).t()  # a linear's
    shards = full.chunk(world, dim=1)
    inputs = [torch.randn(1, tokens, K, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    gathered_ref = full.float() @ weight.float()
    scattered_ref = sum(x.float() @ weight.float() for x in inputs).chunk(world, dim=1)
    problems = {  # op -> (variants, call of one rank, that rank's error, cuBLAS on every rank)
        "all_gather_matmul": (
            agm.variants(1),
            lambda v, r, g: v(shards[r].contiguous(), [weight], [None], 1, world, g, False, (), (), ()),
            lambda r, out: relative_error(out[1][0], gathered_ref),
            lambda: [full @ weight for _ in range(world)],
        ),
        "matmul_reduce_scatter": (
            mrs.variants(1),
            lambda v, r, g: v([inputs[r]], [weight], None, "sum", 1, world, g),
            lambda r, out: relative_error(out, scattered_ref[r]),
            lambda: [x @ weight for x in inputs],
        ),
    }
    sleep_cycles = 20_000_000  # the GPU waits this long (some ms) while the host queues every rank

    def gpu_us(queue, repeats: int = 5) -> float:
        """Median GPU time (µs) of the work ``queue(start, end)`` queues between its two events,
        the GPU held back by a sleep until the host has queued it all."""
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            queue(start, end)
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def cublas(matmuls):
        def queue(start, end):
            start.record()
            matmuls()
            end.record()

        return queue

    def ranks(sim, variant, call):
        """Every simulated rank's call, between an event on rank 0's stream before its call and
        one on the last rank's stream once it has joined every rank's work (queued in rank order,
        so the others' calls are all queued by then)."""

        def queue(start, end):
            def timed(r, g):
                if r == 0:
                    start.record()
                out = call(variant, r, g)
                if r == world - 1:
                    for other in sim.streams[:-1]:
                        torch.cuda.current_stream().wait_stream(other)
                    end.record()
                return out

            sim.run(timed, warm_up=False)

        return queue

    print(
        f"\nOne GPU ({torch.cuda.get_device_name()}): the ops' CUDA variants at W={world}, ranks simulated in one "
        f"process, {tokens} tokens, K {K}, N {N}, bf16.\nBoth ranks share this GPU: the time is every rank's "
        "work on it, against cuBLAS running the same matmuls (what the protocol costs here, not a speedup)."
    )  # fmt: skip
    print(f"  {'op':<22} {'variant':<28} {'error':>8}  {'µs':>7}  {'cuBLAS µs':>9}  {'ratio':>5}")
    ok = True
    for op, (variants, call, error, matmuls) in problems.items():
        cublas_us = gpu_us(cublas(matmuls))
        for name, variant in variants.items():
            if name == "nccl_cublas":  # NCCL needs real ranks
                continue
            sim = SimWorld(world)  # a fresh world each: one whose wait gave up refuses later calls
            try:
                outs = sim.run(lambda r, g: call(variant, r, g))
                worst = max(error(r, out) for r, out in enumerate(outs))
                us = gpu_us(ranks(sim, variant, call))
            except Exception as failure:
                print(f"  {op:<22} {name:<28} FAILED: {str(failure).splitlines()[0][:100]}")
                ok = False
                continue
            finally:
                sim.close()
            verdict = "ok" if worst < 2e-2 else "MISMATCH"
            ok &= verdict == "ok"
            print(f"  {op:<22} {name:<28} {worst:8.1e}  {us:7.0f}  {cublas_us:9.0f}  {us / cublas_us:5.2f}  {verdict}")
    return ok


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument(
        "--world-size", type=_positive, default=None,
        help="ranks (default: on GPUs the largest power of two of them, which the Llama sizes divide; 2 on CPU)",
    )  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if gpus >= 2 else "cpu")
    parser.add_argument("--batch", type=_positive, default=1)
    parser.add_argument("--seq", type=int, default=None, help="global sequence length")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (grouped-query attention)")
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default: 2 on GPUs, 1 on CPU)")
    parser.add_argument("--rounds", type=_positive, default=None, help="timed rounds (default: 5 on GPUs, 3 on CPU)")
    parser.add_argument("--calls", type=_positive, default=None, help="training steps per round (default: 10 on GPUs, 2 on CPU)")
    parser.add_argument("--dump-dir", default=None, help="where the pass's dumps go")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    if args.world_size is None:
        args.world_size = max(1 << (gpus.bit_length() - 1), 2) if gpu and gpus else 2
    # Defaults: Llama 3 8B's block over 8192 tokens on GPUs, a small one on CPU, where the timing
    # shows the schedule, not a speedup, so a few steps do.
    if args.warmup is None:
        args.warmup = 2 if gpu else 1
    args.rounds = args.rounds or (5 if gpu else 3)
    args.calls = args.calls or (10 if gpu else 2)
    args.seq = args.seq or (8192 // args.batch if gpu else 128 * args.world_size)
    args.dim = args.dim or (4096 if gpu else 128)
    args.hidden = args.hidden or (14336 if gpu else 4 * args.dim)
    args.heads = args.heads or (32 if gpu else 8)
    if not args.kv_heads:  # Llama 3's 8 K/V heads (one per rank beyond 8 ranks) where they fit
        grouped = max(8, args.world_size)
        args.kv_heads = grouped if gpu and args.heads % grouped == 0 else args.heads
    sizes = {"seq": args.seq, "heads": args.heads, "kv-heads": args.kv_heads, "hidden": args.hidden}
    uneven = [name for name, size in sizes.items() if size % args.world_size]
    if uneven:
        parser.error(
            f"{', '.join(f'{n} {sizes[n]}' for n in uneven)} not divisible by the world size {args.world_size}"
            + (" (seq defaults to 8192 / batch)" if gpu and "seq" in uneven else "")
        )
    if args.heads % args.kv_heads:
        parser.error("heads must be a multiple of kv-heads")
    if gpu and args.world_size > gpus:
        parser.error(f"--world-size {args.world_size} needs that many GPUs; this machine has {gpus}")
    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="overlap-demo-")
    mp.spawn(_rank_main, args=(args, _free_port(), dump_dir), nprocs=args.world_size)
    if not gpu and gpus == 1 and not _simulated_ranks_on_one_gpu():
        raise SystemExit("a CUDA variant failed on the simulated ranks")


if __name__ == "__main__":
    main()
