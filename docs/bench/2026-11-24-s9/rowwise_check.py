import torch, torch.distributed as dist, traceback
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
import overlap_pass
from overlap_pass import config
from tools.tp_models import TransformerBlock, parallelize_block
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
torch.cuda.set_device(0); device = torch.device("cuda", 0); mesh = init_device_mesh("cuda", (2,))
import sys
from overlap_pass import float8
if "nofold" in sys.argv:
    float8.fold_rowwise_epilogues = lambda graph: 0
for name, backend, patches in [("overlap-nothing", "overlap", dict(quantize_before_gather=False, all_gather_matmul=False, matmul_reduce_scatter=False)), ("overlap", "overlap", {})]:
    torch._dynamo.reset(); torch.manual_seed(0)
    block = TransformerBlock(dim=1024, heads=8, hidden=2048, kv_heads=8).to(device=device, dtype=torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("rowwise"))
    block = parallelize_block(block, mesh)
    x = torch.randn(2, 1024, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        with config.patch(**patches):
            out = torch.compile(block, backend=backend)(x); out.backward(torch.randn_like(out))
        torch.cuda.synchronize(); print(name, "OK", flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:200], flush=True)
dist.destroy_process_group()
