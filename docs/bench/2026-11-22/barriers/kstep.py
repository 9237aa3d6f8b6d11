"""Main-stream kernel time of one steady-state training step (fwd+bwd) of the compiled 8B block,
inductor vs overlap: per kernel name (summed), idle gaps, side-stream busy time. Rank 0 prints;
every rank's table goes into $OUT/kstep.txt."""
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
x = torch.randn(1, 8192 // W, dim, device=dev, dtype=torch.bfloat16); g = torch.randn_like(x)
texts = []
for c in ("inductor", "overlap"):
    m = _compile(copy.deepcopy(eager), c)
    def step():
        i = x.detach().requires_grad_(); o = m(i); o.backward(g)
        for p in m.parameters(): p.grad = None
    for _ in range(6): step()
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20): step()
    e.record(); torch.cuda.synchronize(); per = s.elapsed_time(e) / 20 * 1e3
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(4): step()
        torch.cuda.synchronize()
    path = f"/tmp/kstep_{c}_r{r}.json"; p.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ev.sort(key=lambda e: e["ts"])
    streams = collections.defaultdict(list)
    for e in ev: streams[e["args"].get("stream")].append(e)
    main = max(streams, key=lambda s_: sum(e["dur"] for e in streams[s_]))
    mk = streams[main]; t0, t1 = mk[0]["ts"], mk[-1]["ts"] + mk[-1]["dur"]
    busy = sum(e["dur"] for e in mk); by = collections.Counter(); cnt = collections.Counter()
    for e in mk: by[e["name"][:60]] += e["dur"] / 4; cnt[e["name"][:60]] += 1
    lines = [f"## {c} rank {r}: {per:.0f} us per step (20, events); profiled 4 steps: main stream {main} span {(t1-t0)/4:.0f} us/step, busy {busy/4:.0f}, idle {(t1-t0-busy)/4:.0f}"]
    for name, us in by.most_common(28): lines.append(f"  {us:8.1f} us/step  x{cnt[name]//4:3d}  {name}")
    for s_, es in streams.items():
        if s_ != main: lines.append(f"  stream {s_}: {sum(e['dur'] for e in es)/4:.0f} us/step busy, {len(es)//4} ops/step")
    texts.append("\n".join(lines))
    del m; torch._dynamo.reset()
got = [None] * W; dist.all_gather_object(got, "\n".join(texts))
if r == 0:
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "kstep.txt"), "w") as f: f.write("\n\n".join(got))
    print(got[0])
dist.barrier(); dist.destroy_process_group()
