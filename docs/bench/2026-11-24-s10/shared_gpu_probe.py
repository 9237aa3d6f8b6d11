"""Probe: can W processes share one GPU and run overlap's symmetric-memory protocol?

Each process takes cuda:0, joins a gloo group, and calls the bf16 variants directly (the
dispatcher asks for NCCL); every rank draws every shard from one seed, so the reference
needs no collective. Prints one line per (world, variant).
"""

import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(rank, world, port, out):
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ[k] = v
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from overlap_pass import config
    from overlap_pass.lowering import all_gather_matmul as agm
    from overlap_pass.lowering import matmul_reduce_scatter as mrs
    from overlap_pass.lowering import symm

    gn = dist.group.WORLD.group_name
    lines = []
    for trial in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + trial)
        batch, seq, k, n = 2, 384 * world, 512, 768
        full = torch.randn(batch, seq, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g).t()
        shard = full.chunk(world, dim=1)[rank].contiguous()
        ref = (full.float() @ w.float())
        for name, fn in agm.variants(1).items():
            if name == "nccl_cublas":
                continue
            t0 = time.time()
            try:
                with config.patch(spin_limit=1 << 26):
                    _, outs = fn(shard, [w], [None], 1, world, gn)
                torch.cuda.synchronize()
                err = float((outs[0].float() - ref).norm() / ref.norm())
                symm.check_all_timeouts()
                lines.append(f"W={world} rank {rank} trial {trial} ag {name}: err {err:.2e} {time.time()-t0:.2f}s")
            except Exception as e:
                lines.append(f"W={world} rank {rank} trial {trial} ag {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        # reduce-scatter: every rank's input is drawn from the same seed per rank
        inputs = [torch.randn(batch, seq, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(world)]
        rsref = sum(x.float() @ w.float() for x in inputs).chunk(world, dim=1)[rank]
        for name, fn in mrs.variants(1).items():
            if name == "nccl_cublas":
                continue
            t0 = time.time()
            try:
                with config.patch(spin_limit=1 << 26):
                    o = fn([inputs[rank]], [w], None, "sum", 1, world, gn)
                torch.cuda.synchronize()
                err = float((o.float() - rsref).norm() / rsref.norm())
                symm.check_all_timeouts()
                lines.append(f"W={world} rank {rank} trial {trial} rs {name}: err {err:.2e} {time.time()-t0:.2f}s")
            except Exception as e:
                lines.append(f"W={world} rank {rank} trial {trial} rs {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    out.put((rank, lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for world in [int(w) for w in sys.argv[1:]] or [2]:
        q = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=body, args=(r, world, port, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = []
        for _ in range(world):
            try:
                got.append(q.get(timeout=240))
            except Exception:
                print(f"W={world}: a rank did not answer in 240 s")
                break
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for rank, lines in sorted(got):
            print("\n".join(lines))
