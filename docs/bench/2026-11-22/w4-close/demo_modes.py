"""Why the demo's step time differs from bench_model's: per-step sync vs back-to-back, grads kept vs zeroed, MHA vs GQA."""
import copy, os, statistics, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import overlap_pass
from tools.tp_models import TransformerBlock, parallelize_block
from tools.measure import slowest

rank = int(os.environ["LOCAL_RANK"]); world = int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", rank); torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
mesh = init_device_mesh("cuda", (world,))
kv = int(sys.argv[1]) if len(sys.argv) > 1 else 32
torch.manual_seed(0)
block = parallelize_block(TransformerBlock(4096, 32, 14336, bias=False, kv_heads=kv).to(device=device, dtype=torch.bfloat16), mesh)
models = {"inductor": torch.compile(copy.deepcopy(block)), "overlap": torch.compile(copy.deepcopy(block), backend="overlap")}
torch.manual_seed(1 + rank)
x = torch.randn(2, 4096 // world, 4096, device=device, dtype=torch.bfloat16)
grad = torch.randn_like(x)

def step(m, zero):
    inp = x.detach().requires_grad_()
    out = m(inp); out.backward(grad)
    if zero:
        for p in m.parameters(): p.grad = None

for name, m in models.items():
    for _ in range(5): step(m, False)
torch.cuda.synchronize()
res = {}
for r in range(8):
    for name, m in models.items():
        for zero in (False, True):
            for calls in (1, 10):
                torch.cuda.synchronize(); dist.barrier()
                t = time.perf_counter(); h = None
                for _ in range(calls): step(m, zero)
                h = time.perf_counter() - t
                torch.cuda.synchronize(); t = time.perf_counter() - t
                res.setdefault((name, zero, calls), []).append((slowest(t / calls, device), slowest(h / calls, device)))
if rank == 0:
    print(f"kv_heads {kv}, world {world}")
    for k, v in res.items():
        print(k, "step %.3f ms  host %.3f ms" % (statistics.median(a for a, _ in v) * 1e3, statistics.median(b for _, b in v) * 1e3))
dist.destroy_process_group()
