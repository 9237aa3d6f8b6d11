"""Why does a rowwise float8 block fail in cuBLASLt once float8.py folds its backward matmuls,
even with every rewrite off? Compiles the block (fake world of 2, one GPU) with the fold on and
nothing else, forward and backward; run with TORCH_LOGS=post_grad_graphs,output_code to see which
_scaled_mm gets which strides. Argument "nofold": the same without the fold; "all": every rewrite on too."""

import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import overlap_pass  # noqa: F401
from overlap_pass import config
from tools.tp_models import TransformerBlock, parallelize_block

if __name__ == "__main__":
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    mesh = init_device_mesh("cuda", (2,))
    fold = "nofold" not in sys.argv
    patches = dict(
        fold_rowwise_float8=fold, quantize_before_gather=False, all_gather_matmul=False,
        matmul_reduce_scatter=False, split_all_reduce=False,
    )
    if "all" in sys.argv:  # every rewrite on
        patches = dict(fold_rowwise_float8=fold)
    torch.manual_seed(0)
    block = TransformerBlock(dim=1024, heads=8, hidden=2048, kv_heads=8).to(device=device, dtype=torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("rowwise"))
    block = parallelize_block(block, mesh)
    x = torch.randn(2, 1024, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        with config.patch(**patches):
            out = torch.compile(block, backend="overlap")(x)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(sys.argv[1:], "OK", flush=True)
    except Exception as e:
        traceback.print_exc()
        print(sys.argv[1:], "FAILED", type(e).__name__, str(e)[:200], flush=True)
    dist.destroy_process_group()
