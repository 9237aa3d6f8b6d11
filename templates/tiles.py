"""Tile order and row layout shared by the persistent kernels.

Tiles go chunk by chunk from a first chunk, rank-rotated, GROUP_M-swizzled inside a chunk, so
neighbouring programs share B tiles and no tile straddles two chunks.

Row layout of a gather or scatter along a leading dim: the full tensor as [M, K] rows is
``outer`` blocks, each of ``world`` chunks of ``inner`` rows. Rank j's chunk is the j-th run of
``inner`` rows in every block: one run when the dims before the gathered dim are all 1 (outer
= 1), ``batch`` runs for DTensor's [batch, seq, dim] sharded along seq. A chunk's own rows
(``outer * inner``, in block order) are what a shard or a partial holds; row i of block o of
chunk j is row (o * world + j) * inner + i of the full tensor. Tiles never straddle two blocks,
so a tile's rows are consecutive in the full tensor too and TMA can load them."""

import triton
import triton.language as tl


@triton.jit
def tile_counts(outer, inner, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tiles_m, tiles_n, tiles_per_chunk) of a persistent GEMM over per-rank chunks of
    ``outer`` blocks of ``inner`` rows each (module docstring) and N columns."""
    tiles_m = outer * tl.cdiv(inner, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    return tiles_m, tiles_n, tiles_m * tiles_n


@triton.jit
def block_rows(tile_m, chunk, inner, world_size, BLOCK_M: tl.constexpr):
    """Rows of M-tile ``tile_m`` of chunk ``chunk`` (module docstring): (first row among the
    chunk's own rows, first row in the full tensor, offsets 0..BLOCK_M, mask of the rows that
    exist). Row first_own + i is row first_full + i, for every i the mask keeps."""
    tiles_inner = tl.cdiv(inner, BLOCK_M)
    block = tile_m // tiles_inner
    start = (tile_m % tiles_inner) * BLOCK_M
    offs = tl.arange(0, BLOCK_M)
    first_own = block * inner + start
    first_full = (block * world_size + chunk) * inner + start
    return first_own, first_full, offs, start + offs < inner


@triton.jit
def chunk_tile(tile, tiles_m, tiles_n, first_chunk, world_size, GROUP_M: tl.constexpr):
    """(chunk, tile_m, tile_n) of persistent tile ``tile``: tiles [0, tiles_per_chunk) belong to
    ``first_chunk``, the next ones to first_chunk + 1 (mod world), and so on."""
    tiles_per_chunk = tiles_m * tiles_n
    chunk = (first_chunk + tile // tiles_per_chunk) % world_size
    local = tile % tiles_per_chunk
    group_size = GROUP_M * tiles_n
    first_m = (local // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (local % group_size) % rows_in_group
    tile_n = (local % group_size) // rows_in_group
    return chunk, tile_m, tile_n


@triton.jit
def program_chunk_tile_count(step, tiles_per_chunk, pid, num_programs):
    """How many tiles of the ``step``-th chunk of its launch (tiles [step * tiles_per_chunk,
    (step + 1) * tiles_per_chunk), handed out round-robin: tile t to program t mod
    num_programs) persistent program ``pid`` runs."""
    start = step * tiles_per_chunk
    first = pid + tl.cdiv(tl.maximum(start - pid, 0), num_programs) * num_programs
    return tl.maximum(tl.cdiv(start + tiles_per_chunk - first, num_programs), 0)
