"""One GPU, rank 0 of a fake process group of 2: does torchao's Float8 SP block (Llama 3 8B
sizes, tensorwise and rowwise) compile with backend="overlap" on CUDA, forward and backward, and
what does the pass decide there? A compile check: the fake group moves nothing and the ops run
their reference decomposition.

    python3 docs/bench/2026-11-24-s9/float8_fake_world.py
"""

import glob
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import overlap_pass  # noqa: F401
from overlap_pass import config
from tools.tp_models import TransformerBlock, parallelize_block

dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
torch.cuda.set_device(0)
device = torch.device("cuda", 0)
mesh = init_device_mesh("cuda", (2,))
for recipe in ("tensorwise", "rowwise"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = TransformerBlock(dim=4096, heads=32, hidden=14336, kv_heads=8).to(device=device, dtype=torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))
    block = parallelize_block(block, mesh)
    folder = tempfile.mkdtemp()
    x = torch.randn(2, 4096 // 2, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    with config.patch(debug_dir=folder):
        out = torch.compile(block, backend="overlap")(x)
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    for path in sorted(glob.glob(os.path.join(folder, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        for c in record["candidates"]:
            if c["kind"] == "all_reduce_split":
                continue
            print(recipe, record["graph"], c["kind"], c["collective"]["name"], c["rewritten"], c["reason"] or c.get("split", {}).get("cost", ""), flush=True)
dist.destroy_process_group()
