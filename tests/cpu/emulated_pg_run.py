"""The emulated world's process group on the CPU (benchmarks/emulated/nccl.py), in a process of
its own (it replaces torch's c10d kernels process-wide): groups, device meshes, the classic API,
the functional ops and DTensor at W = 2, 4 and 8, each collective's values the mirror's
(timeline.py). Prints one line per world and exits 0 when all hold.

    python3 -m tests.cpu.emulated_pg_run
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from benchmarks.emulated import defaults, nccl


def check_world(world: int) -> dict:
    collectives = nccl.Collectives(defaults.parameters(world))
    collectives.install()
    dist.init_process_group(nccl.BACKEND, rank=0, world_size=world, store=dist.HashStore())
    gen = torch.Generator().manual_seed(world)
    x = torch.randn(3, 5, generator=gen)
    full = torch.randn(world * 3, 5, generator=gen)
    chunk_sum = full.view(world, 3, 5).sum(0)

    out = torch.empty(world * 3, 5)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x.repeat(world, 1)), "all-gather: the shard W times"
    scattered = torch.empty(3, 5)
    dist.reduce_scatter_tensor(scattered, full)
    torch.testing.assert_close(scattered, chunk_sum, msg="reduce-scatter: the sum of the chunks")
    for op, want in ((dist.ReduceOp.SUM, x * world), (dist.ReduceOp.AVG, x), (dist.ReduceOp.MAX, x)):
        for async_op in (False, True):
            t = x.clone()
            work = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                work.wait()
            torch.testing.assert_close(t, want, msg=f"all-reduce {op}")

    f = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    assert torch.equal(f.wait_tensor(f.all_gather_into_tensor(x, world, name)), x.repeat(world, 1))
    torch.testing.assert_close(f.wait_tensor(f.reduce_scatter_tensor(full, "sum", world, name)), chunk_sum)

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    local = torch.randn(4, 6, generator=gen)
    sharded = distribute_tensor(local, tp, [Shard(0)])  # a fake scatter: each rank's shard is its own
    gathered = sharded.redistribute(tp, [Replicate()]).to_local()
    assert gathered.shape == (4, 6) and torch.equal(gathered, sharded.to_local().repeat(tp.size(), 1))

    @torch.compile(backend="inductor")
    def compiled(a):
        g = torch.distributed._functional_collectives.all_gather_tensor(a, 0, (dist.group.WORLD))
        return torch.distributed._functional_collectives.reduce_scatter_tensor(g * 2, "sum", 0, dist.group.WORLD)

    torch.testing.assert_close(compiled(x), x * 2 * world)
    calls = dict(collectives.calls)
    dist.destroy_process_group()
    collectives.uninstall()
    return calls


def main() -> int:
    nccl.register_backend()
    for world in (2, 4, 8):
        calls = check_world(world)
        print(f"W={world}: {calls}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
