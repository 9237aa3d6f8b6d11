"""Per-kernel timeline of one replayed op call (rank 0 and the slowest), plus mm alone vs per-chunk mms alone,
current code, any W. torchrun --nproc-per-node W .scratch/tl.py"""
import os, statistics
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from overlap_pass.lowering import all_gather_matmul as agm
from overlap_pass.lowering import matmul_reduce_scatter as mrs
OUT = os.environ.get("OUT", "/tmp")

def timed(fn, n=20):
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts[3:])

def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])); torch.cuda.set_device(dev)
    gname = dist.group.WORLD.group_name
    gen = torch.Generator(device=dev).manual_seed(rank)
    cases = []
    only = os.environ.get("ONLY", "")
    for name, m, k, n in [("8b qkv", 8192, 4096, 6144 // world), ("8b up+gate", 8192, 4096, 28672 // world),
                          ("70b qkv", 8192, 8192, 10240 // world), ("70b up+gate", 8192, 8192, 57344 // world)]:
        if only and name not in only: continue
        shard = torch.randn(m // world, k, device=dev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen).t() / 64
        args = (shard, [b], [None], 0, world, gname)
        outputs = agm.allocate(*args)
        cases.append((f"AG {name}", lambda a=args, o=outputs: agm.copy_engine_cublas(*a, outputs=o)))
        full = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        chunks = [full[i * m // world : (i + 1) * m // world] for i in range(world)]
        t_full = timed(lambda: torch.mm(full, b)); t_chunks = timed(lambda: [torch.mm(c, b) for c in chunks])
        if rank == 0: print(f"AG {name}: mm full {t_full:.1f} us, {world} chunk mms {t_chunks:.1f} us", flush=True)
    for name, m, k, n in [("8b o", 8192, 4096 // world, 4096), ("8b down", 8192, 14336 // world, 4096),
                          ("70b o", 8192, 8192 // world, 8192)]:
        if only and name not in only: continue
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen).t() / 64
        args = ([a], [b], None, "sum", 0, world, gname)
        out = mrs.allocate(*args)
        cases.append((f"RS {name}", lambda a_=args, o=out: mrs.copy_engine_cublas(*a_, outputs=o)))
        chunks = [a[i * m // world : (i + 1) * m // world] for i in range(world)]
        t_full = timed(lambda: torch.mm(a, b)); t_chunks = timed(lambda: [torch.mm(c, b) for c in chunks])
        if rank == 0: print(f"RS {name}: mm full {t_full:.1f} us, {world} chunk mms {t_chunks:.1f} us", flush=True)
    for label, fn in cases:
        for _ in range(3): fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph): fn()
        for _ in range(5): graph.replay()
        torch.cuda.synchronize(); dist.barrier()
        t = timed(graph.replay, 30)
        tt = torch.tensor([t], device=dev); dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3): graph.replay()
            torch.cuda.synchronize()
        dist.barrier()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: e.time_range.start)
        starts = [i for i, e in enumerate(events) if "barrier" in e.name]
        call = events[starts[-1]:] if starts else events
        t0 = call[0].time_range.start
        lines = [f"\n== {label}: replay {tt.item():.1f} us (slowest rank), rank {rank} ({t:.1f} us) timeline of one call:"]
        for e in call:
            lines.append(f"  {e.time_range.start - t0:8.1f} .. {e.time_range.end - t0:8.1f}  ({e.time_range.end - e.time_range.start:7.1f})  {e.name[:70]}")
        with open(f"{OUT}/tl_r{rank}.txt", "a") as f: f.write("\n".join(lines) + "\n")
        if rank == 0: print("\n".join(lines), flush=True)
    dist.barrier(); dist.destroy_process_group()

if __name__ == "__main__":
    main()
