"""Consumer GEMM of the fused all-gather + matmul: a persistent Triton kernel that computes
out_i = A @ B_i (+ bias_i) for up to four B's (Q, K, V) while A's chunks are still arriving.

A is the gathered input in its stacked layout: rank j's shard occupies rows
[j * rows_per_chunk, (j + 1) * rows_per_chunk) of a [world * rows_per_chunk, K] buffer, as the
chunk copies leave it. Tiles go chunk by chunk in the order of schedule.all_gather_order (the
local chunk first, then the peers rank-rotated), GROUP_M-swizzled inside a chunk, and never
straddle two chunks. Before a tile's first load from a peer's chunk the kernel waits for that
chunk's flag. Output rows are written where the gather along ``gather_dim`` puts them, so no
copy is needed for gathers along later dims:

    stacked row r of chunk j, r = o * inner + i   ->   output row o * (world * inner) + j * inner + i

where ``inner`` is the product of the shard's dims from gather_dim to the last but one, and
``outer`` the product of the dims before gather_dim.

Phases per tile: wait (peer chunk only) -> load -> dot -> (bias) -> store.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from .signals import wait_flag


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# 128x256x64, 3 stages, 8 warps: the persistent TMA GEMM that reached 0.92-1.02x cuBLAS in
# PERF_REFERENCE.md; the others are the smaller neighbours to sweep. Tiny blocks serve tests.
CONFIGS = [
    GemmConfig(128, 256, 64, 8, 8, 3),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 8, 4, 4),
]
TEST_CONFIG = GemmConfig(16, 16, 16, 2, 4, 1)


MAX_MATS = 4  # mat2s one launch can take (Q, K, V; gate, up); more go in further launches


@triton.jit
def _pick(j, v0, v1, v2, v3):
    """v_j for a run-time j in [0, 4)."""
    v = v0
    if j == 1:
        v = v1
    if j == 2:
        v = v2
    if j == 3:
        v = v3
    return v


# Per-mat2 sizes and strides are picked at run time, so none may be specialized to a constant.
_PER_MAT = [f"{name}{i}" for name in ("n", "stride_bk", "stride_bn") for i in range(4)]


@triton.jit(do_not_specialize=_PER_MAT)
def all_gather_matmul_consumer_kernel(
    a_ptr, flags_ptr, timeouts_ptr, tile_log_ptr,
    b0, b1, b2, b3, bias0, bias1, bias2, bias3, c0, c1, c2, c3,
    n0, n1, n2, n3,
    stride_bk0, stride_bk1, stride_bk2, stride_bk3,
    stride_bn0, stride_bn1, stride_bn2, stride_bn3,
    rows_per_chunk, K, inner, stride_am, stride_ak,
    rank, world_size, epoch, num_programs,
    NUM_MATS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LOG_TILES: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows_per_chunk, BLOCK_M)
    # the N tiles of every mat2, side by side: one chunk's rows meet all of them
    t0 = tl.cdiv(n0, BLOCK_N)
    t1 = tl.cdiv(n1, BLOCK_N) if NUM_MATS > 1 else 0
    t2 = tl.cdiv(n2, BLOCK_N) if NUM_MATS > 2 else 0
    t3 = tl.cdiv(n3, BLOCK_N) if NUM_MATS > 3 else 0
    tiles_n = t0 + t1 + t2 + t3
    tiles_per_chunk = tiles_m * tiles_n
    for tile in range(pid, tiles_per_chunk * world_size, num_programs):
        # chunk order: own chunk first, then rank + 1, rank + 2, ... (schedule.all_gather_order)
        step = tile // tiles_per_chunk
        chunk = (rank + step) % world_size
        local = tile % tiles_per_chunk
        # GROUP_M swizzle inside the chunk, so neighbouring programs share B tiles
        group_size = GROUP_M * tiles_n
        first_m = (local // group_size) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (local % group_size) % rows_in_group
        tile_n = (local % group_size) // rows_in_group
        # which mat2 this N tile belongs to
        j = 0
        if tile_n >= t0:
            tile_n -= t0
            j = 1
        if (j == 1) & (tile_n >= t1):
            tile_n -= t1
            j = 2
        if (j == 2) & (tile_n >= t2):
            tile_n -= t2
            j = 3
        b_ptr = _pick(j, b0, b1, b2, b3)
        c_ptr = _pick(j, c0, c1, c2, c3)
        N = _pick(j, n0, n1, n2, n3)
        stride_bk = _pick(j, stride_bk0, stride_bk1, stride_bk2, stride_bk3)
        stride_bn = _pick(j, stride_bn0, stride_bn1, stride_bn2, stride_bn3)

        # wait: a peer's chunk must have landed before any load from it
        if chunk != rank:
            wait_flag(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT)
        if LOG_TILES:
            tl.store(tile_log_ptr + tile, tl.atomic_add(tile_log_ptr + world_size * tiles_per_chunk, 1))

        # load -> dot
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the chunk
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < rows_per_chunk
        n_mask = offs_n < N
        a_rows = chunk * rows_per_chunk + offs_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            if FP32_IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:  # a zero bias stands in for a mat2 without one
            bias_ptr = _pick(j, bias0, bias1, bias2, bias3)
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]

        # store, at the rows the gather along gather_dim gives them (outputs are contiguous)
        out_rows = (offs_m // inner) * (world_size * inner) + chunk * inner + offs_m % inner
        tl.store(
            c_ptr + out_rows[:, None] * N + offs_n[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


class ChunkTimeout(RuntimeError):
    """A consumer gave up waiting for a chunk: names the rank and the chunks."""


def all_gather_matmul_consumer(
    a_stacked: torch.Tensor,
    mat2s: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    outs: list[torch.Tensor],
    flags: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    inner: int,
    epoch: int,
    config: GemmConfig = CONFIGS[0],
    num_programs: int | None = None,
    spin_limit: int = 1 << 30,
    timeouts: torch.Tensor | None = None,
    tile_log: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Launches the consumer GEMM: outs[i] = gathered A @ mat2s[i] (+ biases[i]).

    ``a_stacked``: [world * rows_per_chunk, K], chunks stacked by rank. ``outs[i]``: contiguous
    [world * rows_per_chunk, N_i] in the gather_dim row order (module docstring). ``flags``: one
    word per chunk, the peers' set to ``epoch`` once their chunk is in ``a_stacked``.
    ``timeouts`` (int32, one per chunk, zeroed by the caller) receives the chunks a wait gave up
    on; ``tile_log`` (int32, tiles + 1; one launch only) the order tiles started in."""
    rows, k = a_stacked.shape
    if not mat2s or not len(mat2s) == len(biases) == len(outs):
        raise ValueError(f"{len(mat2s)} mat2s, {len(biases)} biases, {len(outs)} outputs")
    for mat2, out in zip(mat2s, outs):
        n = mat2.shape[1]
        if rows % world_size or mat2.shape[0] != k or out.shape != (rows, n):
            raise ValueError(
                f"shapes do not fit: A {list(a_stacked.shape)}, B {list(mat2.shape)}, "
                f"out {list(out.shape)}, world {world_size}"
            )
        if not out.is_contiguous() or mat2.dtype != a_stacked.dtype:
            raise ValueError("outputs must be contiguous and mat2s of A's dtype")
    rows_per_chunk = rows // world_size
    if rows_per_chunk % inner:
        raise ValueError(f"inner={inner} does not divide the {rows_per_chunk} rows of a chunk")
    if timeouts is None:
        timeouts = torch.zeros(world_size, dtype=torch.int32, device=a_stacked.device)
    if len(mat2s) > MAX_MATS and tile_log is not None:
        raise ValueError(f"tile_log covers one launch: at most {MAX_MATS} mat2s")
    for first in range(0, len(mat2s), MAX_MATS):
        group = slice(first, first + MAX_MATS)
        _launch(
            a_stacked, mat2s[group], biases[group], outs[group], flags, timeouts, tile_log,
            rank, world_size, inner, epoch, config, num_programs, spin_limit,
        )  # fmt: skip
    return outs


def _launch(a, mat2s, biases, outs, flags, timeouts, tile_log, rank, world_size, inner, epoch,
            config, num_programs, spin_limit):  # fmt: skip
    count = len(mat2s)
    has_bias = any(b is not None for b in biases)
    if has_bias:  # one code path: a mat2 without bias gets zeros
        biases = [b if b is not None else outs[i].new_zeros(outs[i].shape[1]) for i, b in enumerate(biases)]
    pad = lambda values, fill: list(values) + [fill] * (MAX_MATS - count)  # noqa: E731
    rows_per_chunk = a.shape[0] // world_size
    tiles = world_size * triton.cdiv(rows_per_chunk, config.block_m) * sum(
        triton.cdiv(m.shape[1], config.block_n) for m in mat2s
    )
    if num_programs is None:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
        num_programs = min(sms, tiles)
    all_gather_matmul_consumer_kernel[(num_programs,)](
        a, flags, timeouts, tile_log if tile_log is not None else timeouts,
        *pad(mat2s, mat2s[0]),
        *pad(biases if has_bias else [outs[0]] * count, outs[0]),
        *pad(outs, outs[0]),
        *pad([m.shape[1] for m in mat2s], 0),
        *pad([m.stride(0) for m in mat2s], 0),
        *pad([m.stride(1) for m in mat2s], 0),
        rows_per_chunk, a.shape[1], inner, a.stride(0), a.stride(1),
        rank, world_size, epoch, num_programs,
        NUM_MATS=count,
        HAS_BIAS=has_bias,
        LOG_TILES=tile_log is not None,
        FP32_IEEE=a.dtype == torch.float32,
        SPIN_LIMIT=spin_limit,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def raise_on_timeouts(timeouts: torch.Tensor, rank: int) -> None:
    """After the kernel: name the chunks this rank gave up waiting for."""
    late = timeouts.nonzero().flatten().tolist()
    if late:
        raise ChunkTimeout(f"rank {rank} gave up waiting for the flags of chunks {late}")
