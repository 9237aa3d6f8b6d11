"""Simulated peers for the reduce-scatter producer GEMM, shared by the interpreter tests (CPU)
and the GPU tests: every rank's producer writes into the other ranks' partials buffers, which
are plain tensors of one device here."""

import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as mrs

EPOCH = 5


def simulate(
    world, rows, k, n, dtype, bias, seed=0, num_programs=3, config=gemm.TEST_CONFIG, outer=1, device="cpu",
    scales=None, out_dtype=None, launch=mrs.matmul_reduce_scatter_producer, epoch=EPOCH, counters=None, **kwargs,
):  # fmt: skip
    """Runs every rank's producer (``launch``: matmul_reduce_scatter_producer or a kernel taking
    its arguments, ``kwargs`` passed on) into simulated peer buffers, NaN-poisoned; returns the
    per-rank inputs, mat2, bias, the buffers, flags and counters. ``rows`` per chunk, in
    ``outer`` blocks (templates/tiles.py). Float8: ``scales[rank]``, the producer's ``scales``
    for that rank; partials and bias in ``out_dtype``. ``counters``: a previous call's, per rank
    (the kernel leaves them zero), else new ones."""
    gen = torch.Generator().manual_seed(seed)
    out_dtype = out_dtype or dtype
    inputs = [torch.randn(world * rows, k, generator=gen).to(dtype).to(device) for _ in range(world)]
    mat2 = torch.randn(n, k, generator=gen).to(dtype).to(device).t()
    b = torch.randn(n, generator=gen).to(out_dtype).to(device) if bias else None
    partials = [torch.full((world * rows, n), float("nan"), dtype=out_dtype, device=device) for _ in range(world)]
    flags = torch.zeros(world, world, dtype=torch.int32, device=device)  # flags[owner, producer]
    counters = counters or [torch.zeros(world, dtype=torch.int32, device=device) for _ in range(world)]
    dest_ptrs = torch.tensor([p.data_ptr() for p in partials], dtype=torch.int64, device=device)
    for rank in range(world):
        flag_ptrs = torch.tensor([flags[j, rank].data_ptr() for j in range(world)], dtype=torch.int64, device=device)
        launch(
            inputs[rank], mat2, b, dest_ptrs, flag_ptrs, counters[rank],
            torch.tensor([epoch], dtype=torch.int32, device=device), rank=rank, world_size=world,
            config=config, num_programs=num_programs, inner=rows // outer,
            scales=None if scales is None else scales[rank], out_dtype=out_dtype, **kwargs,
        )  # fmt: skip
    return inputs, mat2, b, partials, flags, counters


def check_partials(inputs, mat2, b, partials, world, rows, tol, outer=1, scales=None):
    """Slot p of owner j's buffer holds rank p's rows of chunk j times mat2, plus the bias;
    float8 operands dequantized by ``scales[p]`` (simulate's)."""
    for owner in range(world):
        for producer in range(world):
            got = partials[owner][producer * rows : (producer + 1) * rows]
            mine, b_side = inputs[producer].float(), mat2.float()
            if scales is not None:
                a_scale, b_scale = scales[producer]
                mine, b_side = mine * a_scale.view(-1, 1), b_side * b_scale.view(1, -1)
            want = agm.own_rows(mine, owner, world, rows // outer) @ b_side
            if b is not None:
                want += b.float()
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
