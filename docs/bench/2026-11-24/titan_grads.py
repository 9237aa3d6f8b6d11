"""Where tools.bench_torchtitan's gradient errors come from (8B, 2 layers, W=2, batch 2): eager
against eager (the same model twice), Flash against Math attention in eager, and plain Inductor
against eager, for the input grad and the weight grads. torchrun --nproc-per-node 2."""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend

from tools.measure import relative_error
from tools.titan_llama3 import TitanLayers, compile_titan, parallelize_titan

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
device = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=device)
mesh = init_device_mesh("cuda", (2,))
batch, seq = int(os.environ.get("BATCH", 2)), 8192


def build(backends, fp32=False):
    """bf16 weights; ``fp32``: the same weights widened to fp32 (the complex RoPE cache kept)."""
    torch.manual_seed(0)
    model = TitanLayers("llama3-8b", n_layers=2, seq_len=seq, device=device, dtype=torch.bfloat16, sdpa_backends=backends)
    if fp32:
        model._apply(lambda t: t.float() if t.is_floating_point() else t)
    return parallelize_titan(model, mesh)


gen = torch.Generator(device=device).manual_seed(1 + rank)
x = torch.randn(batch, seq // 2, 4096, device=device, dtype=torch.bfloat16, generator=gen)
grad = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=gen)


def step(model, dtype=torch.bfloat16):
    inp = x.to(dtype).detach().requires_grad_()
    out = model(inp)
    out.backward(grad.to(dtype))
    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), inp.grad, grads


def compare(name, a, b):
    (oa, da, ga), (ob, db, gb) = a, b
    werr = max(relative_error(u, v) for u, v in zip(ga, gb))
    worst = max(range(len(ga)), key=lambda i: relative_error(ga[i], gb[i]))
    if rank == 0:
        print(f"{name}: out {relative_error(oa, ob):.2e} dx {relative_error(da, db):.2e} dW {werr:.2e} (param {worst})", flush=True)


flash = [SDPBackend.FLASH_ATTENTION]
eager = build(flash + [SDPBackend.MATH])
first = step(eager)
compare("eager vs eager again", step(eager), first)
reference = step(build(flash + [SDPBackend.MATH], fp32=True), torch.float32)
compare("eager bf16 vs eager fp32", first, reference)
compare("eager math bf16 vs eager fp32", step(build([SDPBackend.MATH])), reference)
compiled = compile_titan(build(flash + [SDPBackend.MATH]))
compare("inductor bf16 vs eager fp32", step(compiled), reference)
compare("inductor bf16 vs inductor again", step(compiled), step(compiled))
dist.destroy_process_group()
