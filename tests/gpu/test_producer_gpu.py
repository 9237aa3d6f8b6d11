"""The reduce-scatter producer GEMM on one GPU with simulated peers (every rank's partials
buffer a tensor of this GPU), every config, one block or several ([batch, seq, dim] scattered
along seq); and the cuBLAS chunk matmuls of the copy-engine variants writing a chunk of several
blocks in place. Skipped without a GPU."""

import pytest
import torch

from overlap_pass.lowering.row_layout import RowLayout, matmul_into
from overlap_pass.templates import gemm

from tests.producer_cases import EPOCH, check_partials, simulate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("config", gemm.CONFIGS + [gemm.TEST_CONFIG], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "world, rows, outer, k, n, bias",
    [(2, 1024, 1, 512, 768, True), (2, 1024, 4, 256, 384, False), (4, 3 * 77, 3, 64, 200, True), (3, 500, 2, 96, 130, False)],
)
@pytest.mark.parametrize("num_programs", [None, 3], ids=["programs=SMs", "programs=3"])
def test_partials_land_in_the_owners_slots(config, dtype, world, rows, outer, k, n, bias, num_programs):
    """Every partial in place, every flag set, counters left zero; with 3 programs each stores
    several tiles of a chunk before it counts them."""
    inputs, mat2, b, partials, flags, counters = simulate(
        world, rows, k, n, dtype, bias, config=config, outer=outer, num_programs=num_programs, device="cuda"
    )
    torch.cuda.synchronize()
    assert all(not torch.isnan(p).any() for p in partials), "some partial rows were never written"
    check_partials(inputs, mat2, b, partials, world, rows, TOL[dtype], outer)
    assert (flags == EPOCH).all() and all(not c.any() for c in counters)


@pytest.mark.parametrize("outer", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_chunk_matmuls_write_in_place_without_copies(outer, bias):
    """matmul_into on strided chunk views: the output's storage is written (no temporary
    output), and the result is a plain matmul's. cuBLAS takes the batch stride of a chunk view
    and the weight's stride-0 batch as they are."""
    world, inner, k, n = 2, 512, 256, 384
    layout = RowLayout(outer, world, inner)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(world * outer * inner, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    out = torch.full((world * outer * inner, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    matmul_into(layout.chunk(a, 0), weight.t(), b, layout.chunk(out, 0))  # cuBLAS's workspace
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for j in range(world):
        matmul_into(layout.chunk(a, j), weight.t(), b, layout.chunk(out, j))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < out.numel() * out.element_size() // (2 * world), f"{extra} bytes of temporaries"
    want = a.float() @ weight.float().t() + (b.float() if bias else 0)
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2
