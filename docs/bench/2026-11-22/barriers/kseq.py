"""Per-stream kernel sequence of one steady-state compiled forward (no_grad), overlap backend,
8B block (SIZE env), every rank. Rank 0 writes $OUT/kseq.txt: per rank, per stream, each
kernel/copy with start offset, duration and gap; and a per-name total of the main stream."""
import os, copy, json, collections
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
size = os.environ.get("SIZE", "llama3-8b")
dim, heads, kv, hidden = SIZES[size]
torch.manual_seed(0)
eager = _model("block", dim, heads, kv, hidden, mesh).to(device=dev, dtype=torch.bfloat16)
x = torch.randn(1, 8192 // W, dim, device=dev, dtype=torch.bfloat16)
m = _compile(copy.deepcopy(eager), os.environ.get("COMPILER", "overlap"))
def fwd():
    with torch.no_grad(): return m(x)
for _ in range(8): fwd()
torch.cuda.synchronize(); dist.barrier()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(4): fwd()
    torch.cuda.synchronize()
path = f"/tmp/kseq_{os.getpid()}_r{r}.json"; p.export_chrome_trace(path)
ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
streams = collections.defaultdict(list)
for e in ev: streams[e["args"].get("stream")].append(e)
main = max(streams, key=lambda s: sum(e["dur"] for e in streams[s]))
# the last forward: the main stream's kernels after its last long idle point is hard to find; take the last quarter by count
mk = streams[main]; n = len(mk) // 4; last = mk[-n:]; t0 = last[0]["ts"]; t1 = last[-1]["ts"] + last[-1]["dur"]
lines = [f"## rank {r} main stream {main}: last forward {t1 - t0:.0f} us, {n} kernels"]
prev = t0
for e in last:
    lines.append(f"  {e['ts'] - t0:8.1f} +{e['ts'] - prev:6.1f} gap  {e['dur']:7.1f} us  {e['name'][:70]}")
    prev = e["ts"] + e["dur"]
for s, es in streams.items():
    if s == main: continue
    sel = [e for e in es if t0 <= e["ts"] <= t1]
    if sel:
        lines.append(f"## rank {r} stream {s} during it: {len(sel)} ops, {sum(e['dur'] for e in sel):.0f} us busy")
        for e in sel:
            lines.append(f"  {e['ts'] - t0:8.1f}  {e['dur']:7.1f} us  {e['name'][:60]}")
text = "\n".join(lines)
got = [None] * W; dist.all_gather_object(got, text)
if r == 0:
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"kseq_{size}_{os.environ.get("TAG", "")}.txt"), "w") as f: f.write("\n\n".join(got))
    print(got[0][:6000])
dist.barrier(); dist.destroy_process_group()
