"""Main-stream kernel sequence of the last of 4 profiled steady-state training steps (fwd+bwd)
of the compiled block (overlap), every rank; barrier durations per rank; side streams; the
variant choices with their times. Rank 0 writes $OUT/kbwd_<size>.txt and prints a summary."""
import os, copy, json, collections
os.environ.setdefault("NCCL_NVLS_ENABLE", "0"); os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
import torch, torch.distributed as dist
import overlap_pass
from overlap_pass.lowering import choose
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
x = torch.randn(1, 8192 // W, dim, device=dev, dtype=torch.bfloat16); g = torch.randn_like(x)
m = _compile(copy.deepcopy(eager), os.environ.get("COMPILER", "overlap"))
def step():
    i = x.detach().requires_grad_(); o = m(i); o.backward(g)
    for p in m.parameters(): p.grad = None
for _ in range(6): step()
torch.cuda.synchronize(); dist.barrier()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
import time
s.record(); h0 = time.perf_counter()
for _ in range(20): step()
host = (time.perf_counter() - h0) / 20 * 1e6
e.record(); torch.cuda.synchronize(); per = s.elapsed_time(e) / 20 * 1e3
dist.barrier()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(4): step()
    torch.cuda.synchronize()
path = f"/tmp/kbwd_{os.getpid()}_r{r}.json"; p.export_chrome_trace(path)
ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
streams = collections.defaultdict(list)
for e in ev: streams[e["args"].get("stream")].append(e)
main = max(streams, key=lambda s_: sum(e["dur"] for e in streams[s_]))
mk = streams[main]; n = len(mk) // 4; last = mk[-n:]; t0 = last[0]["ts"]; t1 = last[-1]["ts"] + last[-1]["dur"]
busy = sum(e["dur"] for e in last)
lines = [f"## rank {r}: {per:.0f} us/step (events, 20 steps); last profiled step {t1 - t0:.0f} us, busy {busy:.0f}, {n} kernels"]
prev = t0
for e in last:
    lines.append(f"  {e['ts'] - t0:8.1f} +{e['ts'] - prev:6.1f}  {e['dur']:7.1f}  {e['name'][:64]}")
    prev = e["ts"] + e["dur"]
for s_, es in streams.items():
    if s_ == main: continue
    sel = [e for e in es if t0 <= e["ts"] <= t1]
    if sel:
        lines.append(f"## rank {r} stream {s_}: {len(sel)} ops, {sum(e['dur'] for e in sel):.0f} us busy: "
                     + " ".join(f"{e['ts'] - t0:.0f}+{e['dur']:.0f}" for e in sel))
# per profiled step: span over every stream, union busy, gap before the next step
starts = [mk[k * n]["ts"] for k in range(4)] + [float("inf")]
steps = []
for k in range(4):
    sel = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if starts[k] <= e["ts"] < starts[k + 1])
    u, cur_s, cur_e = 0.0, None, None
    for a, b in sel:
        if cur_e is None or a > cur_e:
            if cur_e is not None: u += cur_e - cur_s
            cur_s, cur_e = a, b
        else: cur_e = max(cur_e, b)
    u += cur_e - cur_s
    end = max(b for _, b in sel)
    steps.append(f"[{end - starts[k]:.0f} span, {u:.0f} busy, gap {starts[k + 1] - end if k < 3 else 0:.0f}]")
bar = [f"{e['dur']:.0f}@{e['ts'] - t0:.0f}" for e in last if e["name"].startswith("barrier")]
summary = f"rank {r}: host {host:.0f} us/step; steps " + " ".join(steps) + f"\n  step {per:.0f} us, profiled {t1 - t0:.0f}, busy {busy:.0f}; barriers " + " ".join(bar)
got = [None] * W; dist.all_gather_object(got, ("\n".join(lines), summary))
if r == 0:
    tag = os.environ.get("TAG", "")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"kbwd_{size}_W{W}{tag}.txt"), "w") as f:
        f.write("\n\n".join(t for t, _ in got))
        f.write("\n\n## choices\n" + json.dumps(choose.CHOICES, indent=1))
    for _, s_ in got: print(s_)
    for k, v in choose.CHOICES.items():
        print(k.split(" | ")[0], " ".join(k.split(" | ")[4:]), "->", v.get("choice"), {a: round(b) for a, b in v.get("times_us", {}).items()})
dist.barrier(); dist.destroy_process_group()
