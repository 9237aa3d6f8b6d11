"""Row layout of a gather or scatter along a leading dim, as the CUDA variants address it.

The full tensor, as [M, K] rows in its own (contiguous) order, is ``outer`` blocks of ``world``
chunks of ``inner`` rows; rank j's chunk is the j-th run of ``inner`` rows in every block
(templates/tiles.py, which the kernels follow). A sequence-parallel [1, S, D] gathered along seq
has one block; DTensor's [batch, seq, dim] has ``batch`` blocks. A shard, or a partial of one
chunk, holds the chunk's ``outer * inner`` rows block by block.

cuBLAS reaches a chunk in place through strided views: [inner, K] rows when there is one block,
else [outer, inner, K] with a batch stride of ``world * inner`` rows, one batched call.
"""

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class RowLayout:
    outer: int
    world: int
    inner: int

    @classmethod
    def of(cls, shard_shape, dim: int, world: int) -> "RowLayout":
        """The layout of gathering ``shard_shape`` along ``dim`` (a leading dim) over ``world``
        ranks, or of scattering the gathered shape along it."""
        return cls(math.prod(shard_shape[:dim]), world, math.prod(shard_shape[dim:-1]))

    @property
    def chunk_rows(self) -> int:
        """Rows of one chunk (a shard, a partial)."""
        return self.outer * self.inner

    def block_span(self, chunk: int, block: int) -> tuple[int, int]:
        """(start, stop) of block ``block`` of chunk ``chunk`` among the full rows."""
        start = (block * self.world + chunk) * self.inner
        return start, start + self.inner

    def chunk(self, full: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk ``chunk`` of ``full`` ([M, X] rows, unit row stride X) as a view: [inner, X],
        or [outer, inner, X] across blocks."""
        if self.outer == 1:
            return full[chunk * self.inner : (chunk + 1) * self.inner]
        return full.view(self.outer, self.world, self.inner, full.shape[-1])[:, chunk]

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        """A chunk's own rows ([outer * inner, X]) shaped as ``chunk`` shapes a chunk."""
        return rows if self.outer == 1 else rows.view(self.outer, self.inner, rows.shape[-1])


def matmul_into(a, mat2, bias, out, accumulate: bool = False) -> None:
    """out (+)= a @ mat2 (+ bias) with cuBLAS, written in place: ``a`` and ``out`` 2-D, or 3-D
    batches of row blocks (RowLayout.chunk views) with ``mat2`` shared by every block."""
    if a.dim() == 2:
        if accumulate:
            out.addmm_(a, mat2)
        elif bias is None:
            torch.mm(a, mat2, out=out)
        else:
            torch.addmm(bias, a, mat2, out=out)
        return
    shared = mat2.expand(a.shape[0], *mat2.shape)  # batch stride 0: no copy of the weight
    if accumulate:
        out.baddbmm_(a, shared)
    elif bias is None:
        torch.bmm(a, shared, out=out)
    else:
        torch.baddbmm(bias, a, shared, out=out)
