"""Consumer GEMM of the fused all-gather + matmul: a persistent Triton kernel that computes
out_i = A @ B_i (+ bias_i) while A's chunks are still arriving.

A is the gathered input as [M, K] rows in the gathered tensor's own order (the row layout of
tiles.py: ``outer`` blocks of ``world`` chunks of ``inner`` rows), where the chunk copies put
each peer's shard; output rows are A's rows, so a gather along a later dim, or a [batch, seq,
dim] gather along seq, needs no copy. The local chunk is read in place from the rank's own
shard (``a_local``), so it never has to be copied into the buffer. Tiles go chunk by chunk in
the order of schedule.all_gather_order (the local chunk first, then the peers rank-rotated),
GROUP_M-swizzled inside a chunk, and never straddle two chunks or two blocks. Before a tile's
first load from a peer's chunk the kernel waits for that chunk's flag.

Phases per tile: wait (peer chunk only) -> load -> dot -> (bias) -> store.
"""


import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import (
    CONFIGS,
    FLOAT8,
    FLOAT8_CONFIGS,
    GemmConfig,
    b_descriptor,
    chunk_tiles,
    flatten_tiles,
    pointer_fallback,
    pointer_mainloop,
    row_major,
    scale_columns,
    scale_rows,
    sm_count,
    tma_a,
    tma_mainloop,
    tma_operand,
)
from .launch import TOKEN_COUNTS, DirectKernel, compiles_other_configs
from .signals import wait_flag, wait_flag_in_pipeline
from .tiles import block_rows, chunk_tile, tile_counts


@triton.jit
def _store_tile(
    c_ptr, acc, bias_ptr, rows, offs_n, m_mask, n_mask, stride_cm, stride_cn, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """Epilogue of both consumers: (+ bias) -> store at ``rows`` of the output (A's rows), in
    int64 (an output can pass 2**31 elements)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def all_gather_matmul_consumer_kernel(
    a_ptr, a_local_ptr, b_ptr, bias_ptr, c_ptr, flags_ptr, epoch_ptr, timeouts_ptr, tile_log_ptr,
    outer, inner, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    rank, world_size, num_programs,
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
    # the call's epoch lives on the device, so CUDA-graph replays wait for their own flags
    epoch = tl.load(epoch_ptr)
    tiles_m, tiles_n, tiles_per_chunk = tile_counts(outer, inner, N, BLOCK_M, BLOCK_N)
    for tile in range(pid, tiles_per_chunk * world_size, num_programs):
        # own chunk first, then rank + 1, ... (schedule.all_gather_order)
        chunk, tile_m, tile_n = chunk_tile(tile, tiles_m, tiles_n, rank, world_size, GROUP_M)

        # wait: a peer's chunk must have landed before any load from it
        if chunk != rank:
            wait_flag(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT)
        if LOG_TILES:
            tl.store(tile_log_ptr + tile, tl.atomic_add(tile_log_ptr + world_size * tiles_per_chunk, 1))

        # load -> dot
        first_own, first_full, offs_m, m_mask = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        if chunk == rank:
            a_base = a_local_ptr + (first_own + offs_m).to(tl.int64)[:, None] * stride_am
        else:
            a_base = a_ptr + (first_full + offs_m).to(tl.int64)[:, None] * stride_am
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = pointer_mainloop(
            a_base, stride_ak, b_ptr, stride_bk, stride_bn, offs_n, m_mask, n_mask, K, acc,
            FP32_IEEE, BLOCK_K,
        )  # fmt: skip
        _store_tile(
            c_ptr, acc, bias_ptr, first_full + offs_m, offs_n, m_mask, n_mask, stride_cm,
            stride_cn, HAS_BIAS,
        )  # fmt: skip


@triton.jit
def _tma_tile(local, tiles_m, Ns, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(b, tile_m, tile_n) of tile ``local`` of a chunk in the TMA consumer: B 0's tiles, then
    B 1's, and so on, each GROUP_M-swizzled."""
    b, first = 0, 0
    tiles_n = tl.cdiv(Ns[0], BLOCK_N)
    next_first = tiles_m * tiles_n
    for i in tl.static_range(1, len(Ns)):
        if local >= next_first:
            b, first, tiles_n = i, next_first, tl.cdiv(Ns[i], BLOCK_N)
        next_first += tiles_m * tl.cdiv(Ns[i], BLOCK_N)
    _, tile_m, tile_n = chunk_tile(local - first, tiles_m, tiles_n, 0, 1, GROUP_M)
    return b, tile_m, tile_n


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def all_gather_matmul_tma_kernel(
    a_desc, a_local_desc, b_desc0, b_desc1, b_desc2, b_desc3, bias_ptrs, c_ptrs, Ns, strides_cm,
    flags_ptr, epoch_ptr, timeouts_ptr, outer, inner, K, rank, world_size, num_programs,
    a_scale_ptr, a_local_scale_ptr, b_scale_ptrs,
    BIAS_MASK: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE_MASK: tl.constexpr,
    B_ROWWISE_MASK: tl.constexpr,
    B_NK: tl.constexpr,
    FP8_EXACT: tl.constexpr,
    FLATTEN: tl.constexpr,
    PIPELINED_WAIT: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """The consumer with TMA loads (host-side descriptors) over one to MAX_B B matrices: their
    descriptors (Triton 3.6 takes descriptors as arguments of their own, not inside tuples;
    b_desc0 stands in for the ones not used), and tuples of bias and output pointers, N and
    output row strides, one entry per B; bit i of BIAS_MASK: B i has a bias; outputs have unit
    column stride. Same chunk order, waits and row layout as all_gather_matmul_consumer_kernel;
    inside a chunk, B 0's tiles, then B 1's, and so on, so Q, K and V share one persistent launch
    (K's and V's few tiles alone would leave most SMs idle). Rows past a chunk's end that a tile
    loads are the next rows of A (or TMA's zeros): they only feed rows that the masked store drops.

    The tile loop is flattened into the K loop: one software pipeline over all the program's
    tiles, the next tile's first loads in flight during this tile's epilogue. A program waits
    for a peer chunk's flag once, before its first tile there (its chunks come in order and
    never return); on GPUs through signals.wait_flag_in_pipeline, which keeps the loop
    pipelined and the loads behind the wait (PIPELINED_WAIT; the interpreter takes wait_flag).
    The epilogue finds its tile again from a counter of its own, as Triton's persistent matmul
    does.

    Float8 (A and B float8, scales dequantize as _scaled_mm's): A_SCALE 1 multiplies by the one
    value at a_scale_ptr, 2 by one value per row (a_scale_ptr: the gathered rows', in A's row
    order, there with their chunk; a_local_scale_ptr: the own chunk's); bit i of B_SCALE_MASK:
    B i has a scale (b_scale_ptrs[i]), one value, or one per column where bit i of
    B_ROWWISE_MASK is set. Scales apply to the fp32 accumulator, before the bias; FP8_EXACT: see
    gemm.tma_mainloop."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    tiles_m = outer * tl.cdiv(inner, BLOCK_M)
    tiles_per_chunk = 0
    for i in tl.static_range(len(Ns)):
        tiles_per_chunk += tiles_m * tl.cdiv(Ns[i], BLOCK_N)
    ready = rank  # the last chunk this program waited for (its own needs no wait)
    tile_c = pid - num_programs  # the epilogue's tile
    for tile in tl.range(pid, tiles_per_chunk * world_size, num_programs, flatten=FLATTEN):
        # own chunk first, then rank + 1, ... (schedule.all_gather_order)
        chunk = (rank + tile // tiles_per_chunk) % world_size
        b, tile_m, tile_n = _tma_tile(tile % tiles_per_chunk, tiles_m, Ns, BLOCK_N, GROUP_M)
        first_own, first_full, _, _ = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        b_desc = b_desc0  # picked in turn: one main loop, one pipeline's buffers
        if len(Ns) > 1:
            if b == 1:
                b_desc = b_desc1
        if len(Ns) > 2:
            if b == 2:
                b_desc = b_desc2
        if len(Ns) > 3:
            if b == 3:
                b_desc = b_desc3
        # load -> dot, after the chunk's flag if it is a peer's this program has not waited for
        needed = (chunk != rank) & (chunk != ready)
        ready = chunk
        if PIPELINED_WAIT:  # on every tile, outside any branch (see wait_flag_in_pipeline)
            peer_row0 = wait_flag_in_pipeline(flags_ptr, timeouts_ptr, chunk, epoch, first_full, needed, SPIN_LIMIT)
        else:
            if needed:
                wait_flag(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT)
            peer_row0 = first_full
        if chunk == rank:
            a_source = a_local_desc
            row0 = first_own
        else:
            a_source = a_desc
            row0 = peer_row0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tma_mainloop(a_source, row0, b_desc, tile_n * BLOCK_N, K, acc, B_NK, BLOCK_K, FP8_EXACT)

        # epilogue: scales -> bias -> store
        tile_c += num_programs
        chunk = (rank + tile_c // tiles_per_chunk) % world_size
        b, tile_m, tile_n = _tma_tile(tile_c % tiles_per_chunk, tiles_m, Ns, BLOCK_N, GROUP_M)
        first_own, first_full, offs_m, m_mask = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        bias_ptr, c_ptr, N, stride_cm = bias_ptrs[0], c_ptrs[0], Ns[0], strides_cm[0]
        has_bias = (BIAS_MASK & 1) != 0
        for i in tl.static_range(1, len(Ns)):
            if b == i:
                bias_ptr, c_ptr, N, stride_cm = bias_ptrs[i], c_ptrs[i], Ns[i], strides_cm[i]
                has_bias = ((BIAS_MASK >> i) & 1) != 0
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        if A_SCALE != 0:  # the own chunk's row scales are where its rows are
            if chunk == rank:
                acc = scale_rows(acc, A_SCALE, a_local_scale_ptr, first_own + offs_m, m_mask)
            else:
                acc = scale_rows(acc, A_SCALE, a_scale_ptr, first_full + offs_m, m_mask)
        if B_SCALE_MASK != 0:
            b_scale_ptr = b_scale_ptrs[0]
            b_rowwise = (B_ROWWISE_MASK & 1) != 0
            for i in tl.static_range(1, len(Ns)):
                if b == i:
                    b_scale_ptr = b_scale_ptrs[i]
                    b_rowwise = ((B_ROWWISE_MASK >> i) & 1) != 0
            acc = scale_columns(acc, b_scale_ptr, b_rowwise, offs_n, n_mask)
        if BIAS_MASK != 0:
            if has_bias:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        _store_tile(c_ptr, acc, bias_ptr, first_full + offs_m, offs_n, m_mask, n_mask, stride_cm, 1, False)


_TMA_KERNEL = DirectKernel(all_gather_matmul_tma_kernel)
MAX_B = 4  # B matrices one TMA launch takes (Q, K, V; gate, up)
_POINTER_KERNEL = DirectKernel(all_gather_matmul_consumer_kernel)


@dataclasses.dataclass(frozen=True)
class Scales:
    """Float8 scales of one consumer call (see all_gather_matmul_consumer)."""

    a: torch.Tensor  # one value, or one per gathered row
    a_local: torch.Tensor | None  # the own chunk's rows' (rowwise)
    b: tuple  # per mat2: one value, or one per column
    fast_accum: bool = False  # as _scaled_mm's use_fast_accum (gemm.tma_mainloop)

    @property
    def a_kind(self) -> int:
        return 1 if self.a.numel() == 1 else 2


def _launch_tma(a_descs, group, flags, epoch, timeouts, outer, k, *, rank, world_size, inner, config, num_programs, spin_limit, scales=None):
    """One TMA consumer launch over ``group``, [(mat2, bias, out, b scale)] sharing one B layout;
    ``a_descs``: the descriptors of A and of the local chunk, shared by a call's launches."""
    b_descs = [b_descriptor(m, config) for m, _, _, _ in group]
    b_descs += b_descs[:1] * (MAX_B - len(group))
    tiles = sum(chunk_tiles(world_size, outer, inner, m.shape[1], config) for m, _, _, _ in group)
    programs = min(num_programs, tiles)
    a_scale = scales.a if scales else flags
    exact = scales is not None and not scales.fast_accum
    a_local_scale = scales.a_local if scales and scales.a_local is not None else a_scale
    _TMA_KERNEL[(programs,)](
        *a_descs, *b_descs, tuple(out if bias is None else bias for _, bias, out, _ in group),
        tuple(out for _, _, out, _ in group), tuple(m.shape[1] for m, _, _, _ in group),
        tuple(out.stride(0) for _, _, out, _ in group), flags, epoch, timeouts, outer, inner, k,
        rank, world_size, programs, a_scale, a_local_scale,
        tuple(out if sb is None else sb for _, _, out, sb in group),
        BIAS_MASK=sum(1 << i for i, (_, bias, _, _) in enumerate(group) if bias is not None),
        A_SCALE=scales.a_kind if scales else 0,
        B_SCALE_MASK=sum(1 << i for i, (_, _, _, sb) in enumerate(group) if sb is not None),
        B_ROWWISE_MASK=sum(1 << i for i, (_, _, _, sb) in enumerate(group) if sb is not None and sb.numel() > 1),
        B_NK=group[0][0].stride(0) == 1, FP8_EXACT=exact,
        FLATTEN=flatten_tiles(exact, [out.dtype for _, _, out, _ in group]),
        PIPELINED_WAIT=group[0][2].is_cuda, SPIN_LIMIT=spin_limit,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


class ChunkTimeout(RuntimeError):
    """A consumer gave up waiting for a chunk: names the rank and the chunks."""


def own_rows(a: torch.Tensor, rank: int, world_size: int, inner: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of gathered rows ``a`` (tiles.py's row layout) as its own [outer *
    inner, K] rows: a view when the chunk is one run of rows (outer = 1), else a copy."""
    outer = a.shape[0] // (world_size * inner)
    chunk = a.view(outer, world_size, inner, a.shape[-1])[:, rank]
    return chunk.reshape(outer * inner, a.shape[-1])


@compiles_other_configs(CONFIGS, FLOAT8_CONFIGS)
def all_gather_matmul_consumer(
    a_gathered: torch.Tensor,
    mat2s: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    outs: list[torch.Tensor],
    flags: torch.Tensor,
    epoch: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    inner: int,
    a_local: torch.Tensor | None = None,
    config: GemmConfig = CONFIGS[0],
    num_programs: int | None = None,
    spin_limit: int = 1 << 30,
    timeouts: torch.Tensor | None = None,
    tile_log: torch.Tensor | None = None,
    scales: Scales | None = None,
) -> list[torch.Tensor]:
    """Launches the consumer GEMM: outs[i] = gathered A @ mat2s[i] (+ biases[i]).

    ``a_gathered``: [M, K], the gathered rows in their own order: ``M / (world * inner)`` blocks
    of ``world`` chunks of ``inner`` rows (tiles.py), each peer's chunk there once its flag is
    set. ``outs[i]``: [M, N_i], row for row. ``flags``: one int32 word per chunk, a peer's set
    to the call's epoch (``epoch``: a one-word int32 device tensor) once its chunk is in
    ``a_gathered``. ``a_local``: the own chunk as its own [M / world, K] rows, read in place
    (row stride as ``a_gathered``'s); by default own_rows(a_gathered).
    ``timeouts`` (int32, one per chunk, zeroed by the caller) receives the chunks a wait gave up
    on; ``tile_log`` (int32, tiles + 1; one mat2 only) the order tiles started in.

    With TMA, one launch takes up to MAX_B mat2s of one layout (Q, K and V together). Pointer loads
    take one launch per mat2: a single launch that picks pointers and strides at run time runs
    many times slower (no specialized strides, no vector loads).

    Float8 (A and mat2s float8, ``scales`` given): TMA loads only, mat2s as linear weights
    ([N, K] transposed: K-major, as fp8 tensor cores and _scaled_mm want them); ``scales.a``
    one fp32 value or one per gathered row (rows in A's order, each chunk's there with its flag),
    ``scales.a_local`` the own chunk's row scales, ``scales.b`` one value or one per column for
    each mat2, ``scales.fast_accum`` as _scaled_mm's use_fast_accum. outs[i] = (A * a scale) @
    (mat2s[i] * its scale) (+ biases[i])."""
    rows, k = a_gathered.shape
    if not mat2s or not len(mat2s) == len(biases) == len(outs):
        raise ValueError(f"{len(mat2s)} mat2s, {len(biases)} biases, {len(outs)} outputs")
    for mat2, out in zip(mat2s, outs):
        if rows % (world_size * inner) or mat2.shape[0] != k or out.shape != (rows, mat2.shape[1]):
            raise ValueError(
                f"shapes do not fit: A {list(a_gathered.shape)}, B {list(mat2.shape)}, "
                f"out {list(out.shape)}, world {world_size}, inner {inner}"
            )
        float8 = a_gathered.dtype in FLOAT8 and mat2.dtype in FLOAT8
        if mat2.dtype != a_gathered.dtype and not float8:
            raise ValueError(f"A is {a_gathered.dtype}, B is {mat2.dtype}")
        if float8 != (scales is not None):
            raise ValueError("float8 operands take scales, and only they")
    outer = rows // (world_size * inner)
    if a_local is None:
        a_local = own_rows(a_gathered, rank, world_size, inner)
    if a_local.shape != (outer * inner, k) or a_local.stride() != a_gathered.stride():
        raise ValueError(
            f"a_local {list(a_local.shape)} strides {a_local.stride()} does not fit A "
            f"{list(a_gathered.shape)} strides {a_gathered.stride()}"
        )
    if tile_log is not None and len(mat2s) > 1:
        raise ValueError("tile_log records one launch: pass one mat2")
    if timeouts is None:
        timeouts = torch.zeros(world_size, dtype=torch.int32, device=a_gathered.device)
    programs = num_programs or sm_count(a_gathered.device)
    # TMA: one launch per B layout ([N, K] weights, [K, N] matrices), A's descriptors shared
    a_tma = config.tma and tile_log is None and tma_a(a_gathered) and tma_a(a_local)
    tma_groups: dict[bool, list] = {}
    b_scales = scales.b if scales is not None else [None] * len(mat2s)
    for mat2, bias, out, b_scale in zip(mat2s, biases, outs, b_scales):
        if a_tma and tma_operand(row_major(mat2)) and out.stride(1) == 1:
            tma_groups.setdefault(mat2.stride(0) == 1, []).append((mat2, bias, out, b_scale))
            continue
        if scales is not None:
            raise ValueError("float8 needs TMA: aligned operands, mat2 a transposed [N, K] weight")
        n = mat2.shape[1]
        pointer_config = pointer_fallback(config, a_gathered.dtype)
        launched = min(programs, chunk_tiles(world_size, outer, inner, n, pointer_config))
        _POINTER_KERNEL[(launched,)](
            a_gathered, a_local, mat2, bias if bias is not None else out, out, flags, epoch,
            timeouts, tile_log if tile_log is not None else timeouts,
            outer, inner, n, k,
            a_gathered.stride(0), a_gathered.stride(1), mat2.stride(0), mat2.stride(1),
            out.stride(0), out.stride(1),
            rank, world_size, launched,
            HAS_BIAS=bias is not None,
            LOG_TILES=tile_log is not None,
            FP32_IEEE=a_gathered.dtype == torch.float32,
            SPIN_LIMIT=spin_limit,
            BLOCK_M=pointer_config.block_m,
            BLOCK_N=pointer_config.block_n,
            BLOCK_K=pointer_config.block_k,
            GROUP_M=pointer_config.group_m,
            num_warps=pointer_config.num_warps,
            num_stages=pointer_config.num_stages,
        )  # fmt: skip
    if tma_groups:
        block = [config.block_m, config.block_k]
        a_descs = (TensorDescriptor.from_tensor(a_gathered, block), TensorDescriptor.from_tensor(a_local, block))
        for layout in tma_groups.values():
            for group in (layout[i : i + MAX_B] for i in range(0, len(layout), MAX_B)):
                _launch_tma(
                    a_descs, group, flags, epoch, timeouts, outer, k, rank=rank,
                    world_size=world_size, inner=inner, config=config, num_programs=programs,
                    spin_limit=spin_limit, scales=scales,
                )  # fmt: skip
    return outs


def raise_on_timeouts(timeouts: torch.Tensor, rank: int) -> None:
    """After the kernel: name the chunks this rank gave up waiting for."""
    late = timeouts.nonzero().flatten().tolist()
    if late:
        raise ChunkTimeout(f"rank {rank} gave up waiting for the flags of chunks {late}")
