"""One GPU, rank 0 of a fake process group of 2: does the plain-TP block (Llama 3 8B sizes) compile
with backend="overlap" on CUDA, forward and backward, and what does the pass decide at real
sizes? The fake group moves no data and the ops run their reference decomposition (point-to-point
transfers, weight-gradient contractions accumulated in fp32 chunk by chunk), so the times say
nothing about the CUDA variants: a compile check.

    python3 docs/bench/2026-11-24-s8/plain_fake_world.py
"""

import copy
import glob
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import overlap_pass
from overlap_pass import config
from tools.bench_model import SIZES, _draw_local_weights, _model
from tools.measure import time_interleaved

dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
torch.cuda.set_device(0)
device = torch.device("cuda", 0)
mesh = init_device_mesh("cuda", (2,))
torch._dynamo.config.recompile_limit = 64
for batch in (1, 4):
    torch._dynamo.reset()  # else the second batch recompiles with dynamic dims, which the pass skips
    torch.manual_seed(0)
    eager = _model("block", *SIZES["llama3-8b"], mesh, layout="plain").to(device=device, dtype=torch.bfloat16)
    _draw_local_weights(eager)
    folder = tempfile.mkdtemp()
    x = torch.randn(batch, 8192 // batch, 4096, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    models = {
        "inductor": torch.compile(copy.deepcopy(eager)),
        "overlap": torch.compile(copy.deepcopy(eager), backend="overlap"),
    }

    def step(model):
        inp = x.detach().requires_grad_()
        model(inp).backward(grad)

    with config.patch(debug_dir=folder):
        for model in models.values():
            step(model)
    for path in sorted(glob.glob(os.path.join(folder, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        for c in record["candidates"]:
            print(batch, record["graph"], c["kind"], c["collective"]["name"], c["rewritten"], c["reason"] or c.get("split", {}).get("cost", ""))
    runners = {(name, "forward+backward"): (lambda m=m: step(m)) for name, m in models.items()}
    timed, _ = time_interleaved(runners, device, 5, 10, 2)
    print("batch", batch, {k[0]: round(v) for k, v in timed.items()}, "us (fake group: compute only)", flush=True)
dist.destroy_process_group()
