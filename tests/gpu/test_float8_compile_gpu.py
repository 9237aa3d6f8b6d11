"""torchao's rowwise Float8 block compiled with overlap on CUDA, forward and backward, on the fake
process group of two ranks (one GPU: the graphs and their kernels run, the collectives do not
move data). Rowwise's backward matmuls are folded (float8.py) and, where no op takes them,
written back: a _scaled_mm written back without its input strides pinned once got a
column-major first operand from Inductor, and cuBLASLt refused it. Skipped without a GPU."""

import pytest
import torch

from overlap_pass import config
from tests.cpu.fake_world import fake_world
from benchmarks.tp_models import TransformerBlock, parallelize_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
torchao_float8 = pytest.importorskip("torchao.float8")

NOTHING = dict(quantize_before_gather=False, all_gather_matmul=False, matmul_reduce_scatter=False)


@pytest.mark.parametrize("patches", [NOTHING, {}], ids=["written_back", "rewritten"])
def test_rowwise_block_runs_with_the_fold(patches):
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    with fake_world(2, kernels=True):  # Inductor's kernels are what this checks
        torch.manual_seed(0)
        block = TransformerBlock(dim=512, heads=8, hidden=1024).to(device=device, dtype=torch.bfloat16)
        recipe = torchao_float8.Float8LinearConfig.from_recipe_name("rowwise")
        torchao_float8.convert_to_float8_training(block, config=recipe)
        block = parallelize_block(block, init_device_mesh("cuda", (2,)))
        x = torch.randn(2, 256, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
        with config.patch(fold_rowwise_float8=True, **patches):
            out = torch.compile(block, backend="overlap")(x)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        assert x.grad is not None and x.grad.shape == x.shape
