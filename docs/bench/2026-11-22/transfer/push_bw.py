"""Experiment: how fast can one rank's shard reach every peer? torchrun --nproc-per-node W.

Variants: copy-engine pushes serial on one stream / concurrent on W-1 streams, pulls likewise,
an SM copy kernel with P programs, NCCL all_gather_into_tensor. Per-rank medians, slowest rank.
Also the arrival profile of the serial pushes (end of each copy, from the start).

Eager calls: a variant of several copies or stream switches includes whatever host time its
launches take beyond the GPU's. The logs of 2026-11-22 were printed before the GB/s column's
formula was fixed (it printed 0.0); docs/PERF.md computes the rates from sizes and times."""

import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from overlap_pass.lowering import symm


@triton.jit
def sm_push_kernel(src, dst_ptrs, n_elems, rank, W: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nblocks = tl.cdiv(n_elems, BLOCK)
    for item in range(pid, (W - 1) * nblocks, nprog):
        step = item % (W - 1) + 1
        blk = item // (W - 1)
        peer = (rank - step + W) % W
        dst = tl.load(dst_ptrs + peer).to(tl.pointer_type(tl.bfloat16))
        idx = blk * BLOCK + tl.arange(0, BLOCK)
        m = idx < n_elems
        v = tl.load(src + idx, mask=m)
        tl.store(dst + rank * n_elems + idx, v, mask=m)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    group_name = dist.group.WORLD.group_name
    ws = symm.workspace("bw_test", group_name, dev)
    streams = [torch.cuda.Stream(dev) for _ in range(world - 1)]
    for rows, k in [(2048, 4096), (8192 // world, 8192), (512, 4096), (4096, 4096)]:
        shard = torch.randn(rows, k, device=dev, dtype=torch.bfloat16) * (rank + 1)
        n = shard.numel()
        ws.reserve(2 * world * n * 2)
        # pull sources: every rank's shard at its own slot of its own data, upper half
        def slot(peer, j, half=0):
            return ws.peer_rows(peer, (2 * world * rows, k), torch.bfloat16, (half * world + j) * rows, (half * world + j + 1) * rows)

        slot(rank, rank, 1).copy_(shard)
        torch.cuda.synchronize()
        dist.barrier()
        dst_ptrs = torch.tensor(
            [slot(p, 0).data_ptr() for p in range(world)], dtype=torch.int64, device=dev
        )
        main_stream = torch.cuda.current_stream()

        def serial_push():
            for s in range(1, world):
                p = (rank - s) % world
                slot(p, rank).copy_(shard)

        def par_push():
            for s in range(1, world):
                p = (rank - s) % world
                st = streams[s - 1]
                st.wait_stream(main_stream)
                with torch.cuda.stream(st):
                    slot(p, rank).copy_(shard)
            for st in streams:
                main_stream.wait_stream(st)

        def serial_pull():
            for s in range(1, world):
                p = (rank + s) % world
                slot(rank, p).copy_(slot(p, p, 1))

        def par_pull():
            for s in range(1, world):
                p = (rank + s) % world
                st = streams[s - 1]
                st.wait_stream(main_stream)
                with torch.cuda.stream(st):
                    slot(rank, p).copy_(slot(p, p, 1))
            for st in streams:
                main_stream.wait_stream(st)

        def split_par_push(parts=4):
            # sub-chunk s of every peer before sub-chunk s+1: progressive arrival, W-1 streams
            step_rows = (rows + parts - 1) // parts
            for part in range(parts):
                r0, r1 = part * step_rows, min(rows, (part + 1) * step_rows)
                for s in range(1, world):
                    p = (rank - s) % world
                    st = streams[s - 1]
                    if part == 0:
                        st.wait_stream(main_stream)
                    with torch.cuda.stream(st):
                        slot(p, rank)[r0:r1].copy_(shard[r0:r1])
            for st in streams:
                main_stream.wait_stream(st)

        def sm_push(progs):
            def run():
                sm_push_kernel[(progs,)](shard, dst_ptrs, n, rank, W=world, BLOCK=4096, num_warps=8)
            return run

        gathered = torch.empty(world * rows, k, device=dev, dtype=torch.bfloat16)

        def nccl():
            dist.all_gather_into_tensor(gathered, shard)

        variants = {
            "serial_push": serial_push, "par_push": par_push, "serial_pull": serial_pull,
            "par_pull": par_pull, "split4_par_push": split_par_push,
            "sm_push_8": sm_push(8), "sm_push_16": sm_push(16), "sm_push_32": sm_push(32),
            "sm_push_132": sm_push(132), "nccl": nccl,
        }
        times = {name: [] for name in variants}
        profile = []
        for it in range(40):
            for name, fn in variants.items():
                ws.barrier(10**8)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                if it >= 5:
                    times[name].append(a.elapsed_time(b) * 1000)
            # arrival profile of the serial push
            ws.barrier(10**8)
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(world)]
            evs[0].record()
            for s in range(1, world):
                slot((rank - s) % world, rank).copy_(shard)
                evs[s].record()
            torch.cuda.synchronize()
            if it >= 5:
                profile.append([evs[0].elapsed_time(e) * 1000 for e in evs[1:]])
        # correctness of the pushed slots: after serial_push etc. every slot j holds rank j's shard
        dist.all_gather_into_tensor(gathered, shard)
        torch.cuda.synchronize()
        dist.barrier()
        ws.barrier(10**8)
        torch.cuda.synchronize()
        mine = ws.peer_rows(rank, (2 * world * rows, k), torch.bfloat16, 0, world * rows).clone()
        mine[rank * rows : (rank + 1) * rows] = shard
        ok = torch.equal(mine, gathered)
        med = torch.tensor([statistics.median(times[nm]) for nm in variants], device=dev)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        prof = torch.tensor([statistics.median(c) for c in zip(*profile)], device=dev)
        dist.all_reduce(prof, op=dist.ReduceOp.MAX)
        if rank == 0:
            mb = n * 2 / 1e6
            print(f"\nshard {rows}x{k} bf16 = {mb:.1f} MB, W={world}, pushed total {(world-1)*mb:.1f} MB, slots ok={ok}")
            for nm, t in zip(variants, med.tolist()):
                print(f"  {nm:18s} {t:8.1f} us   {(world-1)*mb/t*1e3 if t else 0:6.1f} GB/s out per rank")
            print("  serial arrival profile (us):", [round(x, 1) for x in prof.tolist()])
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
