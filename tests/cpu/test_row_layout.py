"""The row layout the CUDA variants address chunks with (lowering/row_layout.py), on CPU tensors:
a chunk view is the tensor's slice along the gathered dim, and matmul_into writes a chunk of the
output in place, 2-D or batched, with bias and accumulation."""

import pytest
import torch

from overlap_pass.ops import schedule
from overlap_pass.lowering.row_layout import RowLayout, matmul_into


@pytest.mark.parametrize(
    "shape, dim, world",
    [((12, 5), 0, 2), ((1, 12, 5), 1, 3), ((4, 8, 5), 1, 2), ((3, 6, 2, 5), 1, 3), ((2, 3, 4, 5), 2, 4)],
)
def test_chunk_views_are_the_slices_along_the_gathered_dim(shape, dim, world):
    full = torch.randn(shape)
    shard_shape = list(shape)
    shard_shape[dim] //= world
    layout = RowLayout.of(shard_shape, dim, world)
    rows = full.reshape(-1, shape[-1])
    assert layout.world * layout.chunk_rows == rows.shape[0]
    for j in range(world):
        want = schedule.chunk(full, dim, j, world).reshape(-1, shape[-1])
        view = layout.chunk(rows, j)
        assert view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr(), "a view"
        torch.testing.assert_close(view.reshape(-1, shape[-1]), want, atol=0, rtol=0)
        # the block spans cover the chunk's rows, in its own order
        spans = [rows[slice(*layout.block_span(j, b))] for b in range(layout.outer)]
        torch.testing.assert_close(torch.cat(spans), want, atol=0, rtol=0)
        assert layout.own(want).shape == view.shape


@pytest.mark.parametrize("outer", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_into_writes_a_chunk_in_place(outer, bias):
    world, inner, k, n = 2, 5, 7, 6
    layout = RowLayout(outer, world, inner)
    a = torch.randn(world * outer * inner, k, dtype=torch.float64)
    weight = torch.randn(n, k, dtype=torch.float64)  # a linear's: used transposed
    b = torch.randn(n, dtype=torch.float64) if bias else None
    out = torch.full((world * outer * inner, n), float("nan"), dtype=torch.float64)
    for j in range(world):
        target = layout.chunk(out, j)
        matmul_into(layout.chunk(a, j), weight.t(), b, target)
        matmul_into(layout.chunk(a, j), weight.t(), None, target, accumulate=True)  # twice the product
    want = 2 * (a @ weight.t()) + (b if bias else 0)
    torch.testing.assert_close(out, want)
