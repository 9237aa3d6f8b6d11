"""cuBLAS time of [M,K]x[K,N] as one call vs split by rows, sustained (10 calls per sample), interleaved."""
import random, statistics, torch
dev = torch.device("cuda", 0)
def run(plans, a, b, out, rounds=9, calls=10):
    samples = {k: [] for k in plans}
    order = list(plans)
    for r in range(rounds + 2):
        random.Random(r).shuffle(order)
        for k in order:
            rows = plans[k]
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                for lo, hi in rows:
                    torch.mm(a[lo:hi], b, out=out[lo:hi])
            e.record(); torch.cuda.synchronize()
            if r >= 2: samples[k].append(s.elapsed_time(e) * 1e3 / calls)
    return {k: statistics.median(v) for k, v in samples.items()}
for name, m, k, n, w in [("8b up+gate W2", 8192, 4096, 14336, 2), ("8b qkv W2", 8192, 4096, 3072, 2),
                         ("70b qkv W2", 8192, 8192, 5120, 2), ("70b up+gate W2", 8192, 8192, 28672, 2),
                         ("wide W2", 4096, 16384, 6656, 2),
                         ("8b up+gate W4", 8192, 4096, 7168, 4), ("70b qkv W4", 8192, 8192, 2560, 4),
                         ("70b up+gate W4", 8192, 8192, 14336, 4), ("wide W4", 4096, 16384, 6656, 4)]:
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64).t()
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    rows = m // w
    plans = {"full": [(0, m)], "chunks": [(i * rows, (i + 1) * rows) for i in range(w)]}
    for s in (256, 512, 1024, 2048, 3072):
        if s < rows:
            plans[f"s{s}+rest"] = [(0, s), (s, m)]
            if w > 2:  # a middle rank (1): slice at the end of its rows, rest in two calls
                plans[f"s{s}+2calls"] = [(2 * rows - s, 2 * rows), (0, 2 * rows - s), (2 * rows, m)]
    plans["own+rest"] = [(0, rows), (rows, m)]
    if w > 2:
        plans["own+2calls"] = [(rows, 2 * rows), (0, rows), (2 * rows, m)]
    t = run(plans, a, b, out)
    print(name, " ".join(f"{k}={v:.0f}" for k, v in t.items()), flush=True)
