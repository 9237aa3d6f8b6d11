"""Tile order and pointer main loop shared by the persistent kernels. Tiles go chunk by chunk
from a first chunk, rank-rotated, GROUP_M-swizzled inside a chunk, so neighbouring programs share
B tiles and no tile straddles two chunks."""

import triton
import triton.language as tl


@triton.jit
def tile_counts(rows_per_chunk, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tiles_m, tiles_n, tiles_per_chunk) of a persistent GEMM over per-rank chunks of
    ``rows_per_chunk`` rows and N columns."""
    tiles_m = tl.cdiv(rows_per_chunk, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    return tiles_m, tiles_n, tiles_m * tiles_n


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
def pointer_mainloop(
    a_rows_base, stride_ak, b_ptr, stride_bk, stride_bn, offs_n, m_mask, n_mask, K, acc,
    FP32_IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += A_tile @ B[:, offs_n] with pointer loads; ``a_rows_base``: [BLOCK_M, 1] pointers
    to the tile's rows of A. Masked loads cover M, N and K tails."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows_base + offs_k[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc
