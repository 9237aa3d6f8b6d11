"""GEMM parts that the all-gather consumer and the reduce-scatter producer share: block configs,
the TMA and pointer-load main loops, TMA descriptor helpers, the SM count.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = False  # TMA loads (bf16/fp16 with aligned strides), else pointer loads

    def __str__(self) -> str:
        return (
            f"{'tma' if self.tma else 'ptr'}{self.block_m}x{self.block_n}x{self.block_k}"
            f"w{self.num_warps}s{self.num_stages}"
        )


# 128x256x64, 3 stages, 8 warps: the config of a persistent TMA GEMM known to reach 0.92-1.02x
# cuBLAS on Hopper; 4 stages (196 KiB of shared memory, fits with one main loop); a smaller
# tile; pointer loads for small problems. Inputs TMA cannot take (fp32, unaligned strides) run a
# TMA config's blocks with pointer loads. Tiny blocks serve tests.
CONFIGS = [
    GemmConfig(128, 256, 64, 8, 8, 3, tma=True),
    GemmConfig(128, 256, 64, 8, 8, 4, tma=True),
    GemmConfig(128, 128, 64, 8, 4, 4, tma=True),
    GemmConfig(64, 128, 64, 8, 4, 4),
]
# float8, the best of the sweep in docs/benchmarks.md (the fused GEMMs alone): 128-deep K blocks
# (128 bytes per row, one swizzle line) are the fastest on every shape but the smallest, where
# 128x256x64 in 4 stages is
FLOAT8_CONFIGS = [
    GemmConfig(128, 256, 128, 8, 8, 3, tma=True),
    GemmConfig(128, 256, 128, 8, 8, 4, tma=True),
    GemmConfig(128, 256, 64, 8, 8, 4, tma=True),
]
TEST_CONFIG = GemmConfig(16, 16, 16, 2, 4, 1)


@triton.jit
def tma_mainloop(
    a_desc, row0, b_desc, col0, K, acc, B_NK: tl.constexpr, BLOCK_K: tl.constexpr, FP8_EXACT: tl.constexpr
):  # fmt: skip
    """acc += A[row0:row0+BM, :] @ B[:, col0:col0+BN] through TMA; B stored [N, K] if B_NK.

    Float8 on Hopper: the tensor cores add fp8 products at less than fp32 precision, and
    Triton's default there (max_num_imprecise_acc 2**30) never corrects for it, as _scaled_mm's
    use_fast_accum=True. FP8_EXACT adds each block's product into the fp32 accumulator apart
    (max_num_imprecise_acc = BLOCK_K), as its use_fast_accum=False."""
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        if B_NK:
            b = b_desc.load([col0, k0]).T
        else:
            b = b_desc.load([k0, col0])
        if FP8_EXACT:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
    return acc


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


@triton.jit
def scale_rows(acc, A_SCALE: tl.constexpr, scale_ptr, rows, m_mask):
    """The float8 epilogue's A side, as _scaled_mm dequantizes: A_SCALE 0 leaves ``acc``, 1
    multiplies it by the one value at ``scale_ptr``, 2 each row by its own (``rows``: the
    tile's row indices into the scales)."""
    if A_SCALE == 1:
        acc *= tl.load(scale_ptr)
    if A_SCALE == 2:
        acc *= tl.load(scale_ptr + rows, mask=m_mask, other=0.0)[:, None]
    return acc


@triton.jit
def scale_columns(acc, scale_ptr, rowwise, offs_n, n_mask):
    """The float8 epilogue's B side: the one value at ``scale_ptr``, or one per column."""
    if rowwise:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    else:
        acc *= tl.load(scale_ptr)
    return acc


def flatten_tiles(exact: bool, out_dtypes) -> bool:
    """Whether a TMA kernel flattens its tile loop into the K loop (FLATTEN: one software
    pipeline over all the program's tiles). Not for exact float8 accumulation, nor 32-bit
    outputs: flattened, their epilogue's shared memory does not fit next to the pipeline's
    buffers (278 KB of Hopper's 227 for a float8 128x256x128 tile with fp32 out, 3 stages)."""
    return not exact and all(dtype.itemsize <= 2 for dtype in out_dtypes)


def tma_operand(t: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned bases and row strides."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def row_major(mat2: torch.Tensor) -> torch.Tensor:
    """B as TMA loads it: a linear's weight (a transposed view of [N, K]) as its [N, K] rows,
    else B itself."""
    return mat2.t() if mat2.stride(0) == 1 else mat2


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # what Hopper's float8 tensor cores take


def tma_a(a: torch.Tensor) -> bool:
    """Whether A can load through TMA (bf16, fp16 or float8, aligned)."""
    return a.dtype in (torch.float16, torch.bfloat16, *FLOAT8) and tma_operand(a)


def b_descriptor(mat2: torch.Tensor, config: GemmConfig) -> TensorDescriptor:
    """B's TMA descriptor: a linear's weight (``mat2`` an [N, K] transposed) as [N, K] rows in
    [BLOCK_N, BLOCK_K] blocks, else [K, N] rows in [BLOCK_K, BLOCK_N] blocks (see B_NK)."""
    if mat2.stride(0) == 1:
        return TensorDescriptor.from_tensor(mat2.t(), [config.block_n, config.block_k])
    return TensorDescriptor.from_tensor(mat2, [config.block_k, config.block_n])


def tma_fits(a: torch.Tensor, mat2: torch.Tensor) -> bool:
    """Whether A @ mat2 can load both through TMA."""
    return tma_a(a) and tma_operand(row_major(mat2))


def chunk_tiles(world_size: int, outer: int, inner: int, n: int, config: GemmConfig) -> int:
    """Tiles of a persistent launch over every chunk (tiles.py's row layout) and N columns."""
    return world_size * outer * triton.cdiv(inner, config.block_m) * triton.cdiv(n, config.block_n)


def pointer_fallback(config: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """The blocks a config runs with pointer loads (inputs TMA cannot take): at most 3 stages;
    fp32 (full-precision FMA dots) in 64 x 64 x 32 blocks, which compile in seconds."""
    if dtype == torch.float32:
        return dataclasses.replace(
            config, block_m=min(config.block_m, 64), block_n=min(config.block_n, 64),
            block_k=min(config.block_k, 32), num_warps=4, num_stages=min(config.num_stages, 2), tma=False,
        )  # fmt: skip
    return dataclasses.replace(config, tma=False, num_stages=min(config.num_stages, 3))


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index) if device.type == "cuda" else 4
