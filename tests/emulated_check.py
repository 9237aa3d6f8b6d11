"""The emulated world's ops against what they must compute, in a process of its own (the world
replaces process-wide kernels and makes the default process group):

    python3 -m tests.emulated_check W        # exits 0 when every check passes

Rank 0 of W: every symmetric-memory variant of overlap's two ops (called directly, and through
the op, whose later calls replay per-call CUDA graphs), NCCL + cuBLAS and PyTorch's async TP,
against the emulated world's values (benchmarks/emulated/timeline.py: gathered = the shard W
times, reduce-scattered = the sum of the W chunks of the full product, all-reduced = W times
the input), on fresh random inputs,
outputs poisoned first, calls back to back, batch 1 and 2 (one block of rows per chunk, and a
block per batch); the same calls' rank 0 outputs in the simulated-ranks world (tests/sim_world.py),
every rank given rank 0's inputs; and a lower bound on a communication-bound call's time, the
link's time for the W - 1 chunks that reach rank 0, which only a paced emulation meets."""

import sys
import traceback

from tools.run_env import set_defaults

set_defaults()  # (before torch and overlap_pass read the environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory  # noqa: E402, F401  (defines torch.ops.symm_mem)

from tests.sim_world import SimWorld  # noqa: E402  (before the emulated world replaces symm.Workspace)

from benchmarks import emulated  # noqa: E402
from overlap_pass.lowering import all_gather_matmul as agm  # noqa: E402
from overlap_pass.lowering import matmul_reduce_scatter as mrs  # noqa: E402

SEQ, K, N = 256, 512, 384
POISON = float("nan")


def check(name: str, got: torch.Tensor, want: torch.Tensor, failures: list) -> None:
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    ok = err < 2e-2  # bf16 outputs, fp32 references
    print(f"{'ok ' if ok else 'BAD'} {name}: relative error {err:.2e}", flush=True)
    if not ok:
        failures.append(name)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(POISON)


def all_gather_cases(world: int, sim: SimWorld, group: str, failures: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(world)
    for batch in (1, 2):
        weight = torch.randn(N, K, generator=gen, device="cuda", dtype=torch.bfloat16).t()
        for call in range(2):  # back to back, fresh inputs
            shard = torch.randn(batch, SEQ, K, generator=gen, device="cuda", dtype=torch.bfloat16)
            want = (shard.repeat(1, world, 1).float() @ weight.float())
            args = (shard, [weight], [None], 1, world, group)
            for name, variant in agm.variants(1).items():
                outs = agm.allocate(*args)
                poisoned(outs[1][0])
                got = variant(*args, outputs=outs)[1][0] if name != "nccl_cublas" else variant(*args)[1][0]
                check(f"W{world} all_gather_matmul {name} batch {batch} call {call}", got, want, failures)
            got = torch.ops.overlap.all_gather_matmul(*args)[1][0]
            check(f"W{world} all_gather_matmul op batch {batch} call {call}", got, want, failures)
            if batch == 1:
                flat = shard.view(SEQ, K)
                got = torch.ops.symm_mem.fused_all_gather_matmul(flat, [weight], 0, group)[1][0]
                check(f"W{world} async TP all-gather call {call}", got, want.view(-1, N), failures)
            sim_args = lambda rank, name: (shard, [weight], [None], 1, world, name)  # noqa: E731
            fused = agm.variants(1)[next(n for n in agm.variants(1) if n.startswith("fused"))]
            got = sim.run(lambda rank, name: fused(*sim_args(rank, name))[1][0])[0]
            check(f"W{world} all_gather_matmul simulated ranks batch {batch} call {call}", got, want, failures)


def reduce_scatter_cases(world: int, sim: SimWorld, group: str, failures: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(100 + world)
    for batch in (1, 2):
        weight = torch.randn(N, K, generator=gen, device="cuda", dtype=torch.bfloat16).t()
        for call in range(2):
            a = torch.randn(batch, SEQ * world, K, generator=gen, device="cuda", dtype=torch.bfloat16)
            product = a.float() @ weight.float()
            want = product.view(batch, world, SEQ, N).sum(1)  # the sum of the W chunks along seq
            args = ([a], [weight], None, "sum", 1, world, group)
            for name, variant in mrs.variants(1).items():
                if name == "nccl_cublas":
                    got = variant(*args)
                else:
                    got = variant(*args, outputs=poisoned(mrs.allocate(*args)))
                check(f"W{world} matmul_reduce_scatter {name} batch {batch} call {call}", got, want, failures)
            got = torch.ops.overlap.matmul_reduce_scatter(*args)
            check(f"W{world} matmul_reduce_scatter op batch {batch} call {call}", got, want, failures)
            if batch == 1:
                flat = a.view(-1, K)
                got = torch.ops.symm_mem.fused_matmul_reduce_scatter(flat, weight, "sum", 0, group)
                check(f"W{world} async TP reduce-scatter call {call}", got, want.view(-1, N), failures)
            # simulated ranks: rank p holds rank 0's chunks rotated by p, so that its partial of
            # chunk 0 is the partial the emulated peer p sends (rank 0's of chunk -p)
            chunks = a.view(batch, world, SEQ, K)
            inputs = [torch.roll(chunks, shifts=rank, dims=1).reshape(batch, world * SEQ, K) for rank in range(world)]
            fused = mrs.variants(1)[next(n for n in mrs.variants(1) if n.startswith("fused"))]
            got = sim.run(lambda rank, name: fused([inputs[rank]], [weight], None, "sum", 1, world, name))[0]
            check(f"W{world} matmul_reduce_scatter simulated ranks batch {batch} call {call}", got, want, failures)


def all_reduce_cases(world: int, group: str, failures: list) -> None:
    """The one-shot all-reduce (all peers' stores mirrored at once): W times the input, for a
    few sizes (a program's elements and several programs'), back to back."""
    from overlap_pass.lowering import all_reduce as ar

    gen = torch.Generator(device="cuda").manual_seed(200 + world)
    for numel in (5, 3000, 70_000):
        for dtype in (torch.float32, torch.bfloat16):
            for call in range(2):
                inp = torch.randn(numel, generator=gen, device="cuda").to(dtype)
                got = ar.one_shot(inp, "sum", world, group, outputs=poisoned(torch.empty_like(inp)))
                check(f"W{world} all_reduce one_shot {numel} {dtype} call {call}", got, inp.float() * world, failures)


def paced(world: int, group: str, params, failures: list) -> None:
    """A communication-bound all-gather (a matmul of 64 columns) takes at least the link's time
    for the chunks of the W - 1 peers, one after another, at rank 0."""
    shard = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16).t()
    args = (shard, [weight], [None], 0, world, group)
    variant = agm.variants(1)["copy_engine_cublas"]
    for _ in range(3):
        variant(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        variant(*args)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / 10
    bound = (world - 1) * params.push.us(shard.numel() * shard.element_size())
    ok = us >= 0.95 * bound
    print(f"{'ok ' if ok else 'BAD'} W{world} paced all-gather: {us:.0f} us a call, link bound {bound:.0f} us", flush=True)
    if not ok:
        failures.append("paced")


def main() -> int:
    world = int(sys.argv[1])
    torch.cuda.set_device(0)
    sim = SimWorld(world)
    params = emulated.init_process_group(torch.device("cuda", 0), world)
    group = dist.group.WORLD.group_name
    failures: list = []
    cases = (
        ("all-gather", lambda: all_gather_cases(world, sim, group, failures)),
        ("reduce-scatter", lambda: reduce_scatter_cases(world, sim, group, failures)),
        ("all-reduce", lambda: all_reduce_cases(world, group, failures)),
        ("pacing", lambda: paced(world, group, params, failures)),
    )
    for name, run in cases:
        try:
            run()
        except Exception:  # the others still run: one GPU run reports every family
            traceback.print_exc()
            print(f"BAD W{world} {name}: raised", flush=True)
            failures.append(name)
    sim.close()
    print(f"{len(failures)} failed: {failures}" if failures else "every check passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
