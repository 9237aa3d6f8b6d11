"""The bf16 SP block compiled with overlap on CUDA, forward and backward, on the fake process group
of two ranks (one GPU): Inductor's CUDA code around the overlap ops (tagged needs_exact_strides,
session 14) compiles and runs. The fake group moves no data (its outputs are uninitialized
memory), so no value is checked here: the gloo tests check numbers."""
import pathlib
import tempfile

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.cpu.fake_world import compile_and_dump, fake_world
from tools.tp_models import TransformerBlock, parallelize_block

if __name__ == "__main__":
    device = torch.device("cuda", 0)
    for batch in (1, 2):
        with fake_world(2):
            torch.manual_seed(0)
            block = TransformerBlock(dim=512, heads=8, hidden=1024).to(device=device, dtype=torch.bfloat16)
            block = parallelize_block(block, init_device_mesh("cuda", (2,)))
            x = torch.randn(batch, 128, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
            out, dump = compile_and_dump(block, (x,), pathlib.Path(tempfile.mkdtemp()), backward=True)
            ops = [c for c in dump.all_candidates() if c["rewritten"]]
            torch.cuda.synchronize()
            print(f"batch {batch}: ran, out {tuple(out.shape)}, grad {tuple(x.grad.shape)}, "
                  f"{len(ops)} rewritten: {sorted(c['kind'] for c in ops)}")
