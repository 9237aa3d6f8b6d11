"""Every GPU kernel and copy of one steady-state training step (fwd+bwd) of the compiled block,
all streams, every rank: $OUT/kcat_<compiler>_r<rank>.json as [stream, start us, dur us, name].
Steps are separated by torch.cuda._sleep marker kernels; the third of three profiled steps."""
import os, copy, json
os.environ.setdefault("NCCL_NVLS_ENABLE", "0"); os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
import torch, torch.distributed as dist
import overlap_pass
from tools.bench_model import SIZES, _compile, _model
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import profile, ProfilerActivity
torch._dynamo.config.recompile_limit = 64
r = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(r); dev = torch.device("cuda", r)
dist.init_process_group("nccl", device_id=dev); W = dist.get_world_size()
mesh = init_device_mesh("cuda", (W,))
size = os.environ.get("SIZE", "llama3-8b"); comp = os.environ.get("COMPILER", "overlap")
dim, heads, kv, hidden = SIZES[size]
torch.manual_seed(0)
eager = _model("block", dim, heads, kv, hidden, mesh).to(device=dev, dtype=torch.bfloat16)
x = torch.randn(1, 8192 // W, dim, device=dev, dtype=torch.bfloat16); g = torch.randn_like(x)
m = _compile(copy.deepcopy(eager), comp)
def step():
    i = x.detach().requires_grad_(); o = m(i); o.backward(g)
    for p in m.parameters(): p.grad = None
for _ in range(8): step()
torch.cuda.synchronize(); dist.barrier()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(3):
        torch.cuda._sleep(100000); step()
    torch.cuda.synchronize()
path = f"/tmp/kcat_{os.getpid()}.json"; p.export_chrome_trace(path)
ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
marks = [e["ts"] + e["dur"] for e in ev if "spin" in e["name"].lower() or "sleep" in e["name"].lower()]
t0 = marks[-1]
last = [[e["args"].get("stream"), e["ts"] - t0, e["dur"], e["name"]] for e in ev if e["ts"] >= t0]
with open(os.path.join(os.environ["OUT"], f"kcat_{comp}_{size}_r{r}.json"), "w") as f:
    json.dump(last, f)
print(r, comp, len(marks), "marks", len(last), "events; span", max(a[1] + a[2] for a in last))
dist.barrier(); dist.destroy_process_group()
