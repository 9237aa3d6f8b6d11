"""Producer GEMM of the fused matmul + reduce-scatter: a persistent Triton kernel that computes
the partial P_j = A_j @ B of every chunk j (A_j: the rows of chunk j) and writes it where chunk j's
owner will reduce it, chunk by chunk in the order of schedule.reduce_scatter_order (the chunk of
rank + 1 first, the own chunk last), publishing each chunk as soon as all its tiles are written.

    dest[j]: the address of a [world * rows_per_chunk, N] buffer of rank j (its partials
             buffer, a peer mapping); this rank writes rows [rank * rows_per_chunk, ...) of it
    flags[j]: the address of rank j's flag word for this rank; set to the call's epoch (release,
              system scope) once every tile of chunk j is in dest[j]

A chunk is published by its last tile: every tile adds one to the chunk's counter after its
stores (release); the tile that brings it to tiles_per_chunk (acquire) resets the counter for
the next call and writes the flag. The bias goes into the own chunk's partial only, so the
owner's sum holds it exactly once.

Phases per tile: load -> dot -> (bias, own chunk) -> store -> count [-> publish].
"""

import torch
import triton
import triton.language as tl

from .all_gather_matmul import GemmConfig, _sm_count
from .tiles import chunk_tile, pointer_mainloop


@triton.jit
def matmul_reduce_scatter_producer_kernel(
    a_ptr, b_ptr, bias_ptr, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr, tile_log_ptr,
    rows_per_chunk, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    rank, world_size, num_programs,
    HAS_BIAS: tl.constexpr,
    LOG_TILES: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    tiles_m = tl.cdiv(rows_per_chunk, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_chunk = tiles_m * tiles_n
    for tile in range(pid, tiles_per_chunk * world_size, num_programs):
        # rank + 1 first, the own chunk last (schedule.reduce_scatter_order)
        chunk, tile_m, tile_n = chunk_tile(tile, tiles_m, tiles_n, rank + 1, world_size, GROUP_M)
        if LOG_TILES:
            tl.store(tile_log_ptr + tile, tl.atomic_add(tile_log_ptr + world_size * tiles_per_chunk, 1))

        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the chunk
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < rows_per_chunk
        n_mask = offs_n < N
        a_rows = (chunk * rows_per_chunk + offs_m).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = pointer_mainloop(
            a_ptr + a_rows[:, None] * stride_am, stride_ak, b_ptr, stride_bk, stride_bn, offs_n,
            m_mask, n_mask, K, acc, FP32_IEEE, BLOCK_K,
        )  # fmt: skip
        if HAS_BIAS:
            own = (chunk == rank).to(tl.float32)  # the bias once: in the own chunk's partial
            acc += own * tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

        # store into the owner's partials buffer, in this rank's slot
        dest = tl.load(dest_ptrs_ptr + chunk).to(tl.pointer_type(a_ptr.dtype.element_ty))
        out_rows = (rank * rows_per_chunk + offs_m).to(tl.int64)
        tl.store(
            dest + out_rows[:, None] * N + offs_n[None, :],
            acc.to(a_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )
        # count the tile; the chunk's last tile publishes it and resets the counter. The CTA
        # barrier first: the counting thread's release then covers every thread's stores
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + chunk, 1, sem="acq_rel", scope="sys") + 1
        if done == tiles_per_chunk:
            tl.atomic_xchg(counters_ptr + chunk, 0, sem="relaxed", scope="gpu")
            flag = tl.load(flag_ptrs_ptr + chunk).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")


def matmul_reduce_scatter_producer(
    a: torch.Tensor,
    mat2: torch.Tensor,
    bias: torch.Tensor | None,
    dest_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    counters: torch.Tensor,
    epoch: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    config: GemmConfig,
    num_programs: int | None = None,
    tile_log: torch.Tensor | None = None,
) -> None:
    """Launches the producer: for every chunk j, A_j @ mat2 (+ bias if j == rank) into
    ``dest_ptrs[j]`` (int64 addresses of [world * rows, N] contiguous buffers of a's dtype), rows
    of slot ``rank``; then flag ``flag_ptrs[j]`` (int64 address of an int32) = ``epoch[0]``.
    ``counters``: int32, one per chunk, zero before the first call (the kernel leaves them zero).
    ``tile_log`` (int32, tiles + 1): the order tiles started in."""
    m, k = a.shape
    if m % world_size or mat2.shape[0] != k or mat2.dtype != a.dtype:
        raise ValueError(f"A {list(a.shape)} {a.dtype}, B {list(mat2.shape)} {mat2.dtype}, world {world_size}")
    for name, t in (("dest_ptrs", dest_ptrs), ("flag_ptrs", flag_ptrs)):
        if t.dtype != torch.int64 or t.numel() != world_size:
            raise ValueError(f"{name} must hold {world_size} int64 addresses")
    if counters.dtype != torch.int32 or counters.numel() != world_size:
        raise ValueError(f"counters must be {world_size} int32 words")
    rows, n = m // world_size, mat2.shape[1]
    tiles = world_size * triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n)
    programs = min(num_programs or _sm_count(a.device), tiles)
    matmul_reduce_scatter_producer_kernel[(programs,)](
        a, mat2, bias if bias is not None else a, dest_ptrs, flag_ptrs, counters, epoch,
        tile_log if tile_log is not None else counters,
        rows, n, k, a.stride(0), a.stride(1), mat2.stride(0), mat2.stride(1),
        rank, world_size, programs,
        HAS_BIAS=bias is not None,
        LOG_TILES=tile_log is not None,
        FP32_IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
