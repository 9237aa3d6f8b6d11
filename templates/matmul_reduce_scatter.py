"""Fused matmul + reduce-scatter kernels: the producer GEMM and the owner's reduction.

Producer: a persistent Triton kernel that computes the partial P_j = A_j @ B (+ bias) of every
chunk j (A_j: the rows of chunk j, tiles.py's row layout: ``outer`` blocks of ``inner`` rows
each, read in place from the full [M, K] input, so a [batch, seq, dim] input scattered along
seq needs no copy) and writes it where chunk j's owner will reduce it, chunk by chunk in the
order of schedule.reduce_scatter_order (the chunk of rank + 1 first, the own chunk last),
publishing each chunk as soon as all its tiles are written.

    dest[j]: the address of a [world * rows_per_chunk, N] buffer of rank j (its partials
             buffer, a peer mapping); this rank writes rows [rank * rows_per_chunk, ...) of it,
             the chunk's own rows in order (block by block), which is the order of the
             owner's output rows
    flags[j]: the address of rank j's flag word for this rank; set to the call's epoch (release,
              system scope) once every tile of chunk j is in dest[j]

A chunk is published once all its tiles are stored: a program's tiles come chunk by chunk, and
after its last tile in a chunk it adds all it stored there to the chunk's counter (release);
the program that brings it to tiles_per_chunk (acquire) resets the counter for the next call
and writes the flag. Every partial holds the bias, as every rank's matmul + bias
does before a reduce-scatter (the op's semantics: the sum holds it once per rank).

Phases per tile: load -> dot -> (bias) -> store -> count [-> publish].

Reduction, where the producer's launch is given an OwnReduction: the tiles of the own chunk
come last, and by then the peers' partials of it have landed or are landing (each peer computes
this chunk before its own), so each such tile waits for every peer's flag in its epilogue, adds
their partials of its rows to its own (own first, then the peers in rank order, in fp32: the
same order on every call, so results repeat bit for bit), scales (1, or 1/W for avg), casts once
and stores the op's output. No partial of the own chunk is stored and no kernel follows: the
sum hides behind the GEMM instead of running after it. Otherwise (reduce_partials): a
one-program kernel waits for every peer's flag, then a kernel sums the W partials in rank order
the same way.
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
    scale_columns,
    scale_rows,
    sm_count,
    tma_fits,
    tma_mainloop,
)
from .launch import TOKEN_COUNTS, DirectKernel, compiles_other_configs
from .signals import WAIT_FOR_PEERS, wait_flag, wait_flag_in_pipeline
from .tiles import block_rows, chunk_tile, program_chunk_tile_count, tile_counts


@triton.jit
def _store_partial(
    acc, bias_ptr, dest_ptrs_ptr, chunk, dest_rows, m_mask, offs_n, N, dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr, store,
):  # fmt: skip
    """Epilogue of both producers: (+ bias) -> store into chunk ``chunk``'s owner's partials
    buffer at ``dest_rows`` (this rank's slot), where ``store`` (not the own chunk that
    _reduce_own sums in place). Returns the partial as stored. Buffers are 16-byte aligned (the host
    checks), which the compiler cannot see in an address loaded from memory: said, the stores
    vectorize."""
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    partial = acc.to(dtype)
    dest = tl.multiple_of(tl.load(dest_ptrs_ptr + chunk).to(tl.pointer_type(dtype)), 16)
    rows = dest_rows.to(tl.int64)
    keep = tl.where(store, m_mask, False)
    tl.store(dest + rows[:, None] * N + offs_n[None, :], partial, mask=keep[:, None] & n_mask[None, :])
    return partial


@triton.jit
def _reduce_own(
    partial, dest_ptrs_ptr, out_ptr, flags_ptr, timeouts_ptr, epoch, own, rank, rows_per_chunk, first_own,
    offs_m, m_mask, offs_n, N, scale, dtype: tl.constexpr, WORLD: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    PIPELINED_WAIT: tl.constexpr,
):  # fmt: skip
    """The owner's reduction in the epilogue of a tile of its own chunk (``own``; elsewhere
    every load and store here is masked off, so the loop body has no branch): out rows = scale
    * (this tile's ``partial`` + each peer's partial of these rows, read from this rank's
    partials buffer once the peer's flag holds the call's epoch; in rank order, fp32). Waits
    are bounded and reported as reduce_partials' (timeouts[peer]); on GPUs through
    wait_flag_in_pipeline (PIPELINED_WAIT), which keeps a flattened tile loop pipelined and the
    loads behind the wait."""
    n_mask = offs_n < N
    # (a row mask and a scalar condition through tl.where, here and in _store_partial: PTX as
    # with ``&``, which triton 3.9's interpreter types as no mask)
    recv = tl.multiple_of(tl.load(dest_ptrs_ptr + rank).to(tl.pointer_type(dtype)), 16)
    total = partial.to(tl.float32)
    for peer in tl.static_range(WORLD):
        needed = own & (peer != rank)
        if PIPELINED_WAIT:
            row0 = wait_flag_in_pipeline(flags_ptr, timeouts_ptr, peer, epoch, first_own, needed, SPIN_LIMIT)
        else:
            if needed:
                wait_flag(flags_ptr, timeouts_ptr, peer, epoch, SPIN_LIMIT)
            row0 = first_own
        rows = (peer * rows_per_chunk + row0 + offs_m).to(tl.int64)
        load_mask = tl.where(needed, m_mask, False)[:, None] & n_mask[None, :]
        total += tl.load(recv + rows[:, None] * N + offs_n[None, :], mask=load_mask, other=0.0).to(tl.float32)
    out_rows = (first_own + offs_m).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * N + offs_n[None, :], (total * scale).to(out_ptr.dtype.element_ty),
        mask=tl.where(own, m_mask, False)[:, None] & n_mask[None, :],
    )


@triton.jit
def _cta_barrier(cond):
    """bar.sync 0 (all threads of the CTA) where ``cond``, uniform over the CTA, holds. As inline
    PTX: Triton does not software-pipeline a loop with a tl.debug_barrier in its body."""
    tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.s32 %p, $1, 0; @%p bar.sync 0; mov.b32 $0, $1; }", "=r,r",
        [cond.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _count_tiles(counters_ptr, flag_ptrs_ptr, tile, pid, num_programs, tiles_per_chunk, world_size, epoch,
                 first_chunk, PTX_BARRIER: tl.constexpr):  # fmt: skip
    """After the stores of a program's tile ``tile``: if it is the program's last tile of its
    chunk, the program adds all its tiles of the chunk to the chunk's counter (release, after a
    CTA barrier, so it covers every thread's stores); the program that completes the count
    (acquire) resets the counter for the next call and publishes the chunk. One system-scope
    atomic per program and chunk, not per tile: a release waits until the program's stores to
    peers have landed, so per tile it would stall every tile's end. Masked atomics, no branch:
    Triton 3.6 fails to flatten a loop with an atomic under a branch of its epilogue."""
    step = tile // tiles_per_chunk
    chunk = (first_chunk + step) % world_size
    last = tile + num_programs >= (step + 1) * tiles_per_chunk
    count = program_chunk_tile_count(step, tiles_per_chunk, pid, num_programs)
    if PTX_BARRIER:  # a flattened loop on a GPU (tl.debug_barrier would stop its pipelining)
        _cta_barrier(last)
    else:
        tl.debug_barrier()
    total = tl.atomic_add(counters_ptr + chunk, count, mask=last, sem="acq_rel", scope="sys") + count
    publish = last & (total == tiles_per_chunk)
    tl.atomic_xchg(counters_ptr + chunk, 0, mask=publish, sem="relaxed", scope="gpu")
    flag = tl.load(flag_ptrs_ptr + chunk).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(flag, epoch, mask=publish, sem="release", scope="sys")


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def matmul_reduce_scatter_producer_kernel(
    a_ptr, b_ptr, bias_ptr, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr, tile_log_ptr,
    out_ptr, flags_ptr, timeouts_ptr, scale,
    outer, inner, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    rank, world_size, num_programs,
    HAS_BIAS: tl.constexpr,
    REDUCE_WORLD: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    PIPELINED_WAIT: tl.constexpr,
    LOG_TILES: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """REDUCE_WORLD: the world size where the own chunk is summed in the epilogue (OwnReduction:
    into out_ptr, waiting on flags_ptr, giving up into timeouts_ptr), else 0."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    tiles_m, tiles_n, tiles_per_chunk = tile_counts(outer, inner, N, BLOCK_M, BLOCK_N)
    total_tiles = tiles_per_chunk * world_size
    slot = rank * outer * inner  # this rank's first row in every owner's buffer
    for tile in range(pid, total_tiles, num_programs):
        # rank + 1 first, the own chunk last (schedule.reduce_scatter_order)
        chunk, tile_m, tile_n = chunk_tile(tile, tiles_m, tiles_n, rank + 1, world_size, GROUP_M)
        if LOG_TILES:
            tl.store(tile_log_ptr + tile, tl.atomic_add(tile_log_ptr + total_tiles, 1))

        first_own, first_full, offs_m, m_mask = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = (first_full + offs_m).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = pointer_mainloop(
            a_ptr + a_rows[:, None] * stride_am, stride_ak, b_ptr, stride_bk, stride_bn, offs_n,
            m_mask, offs_n < N, K, acc, FP32_IEEE, BLOCK_K,
        )  # fmt: skip
        own = (chunk == rank) & (REDUCE_WORLD != 0)
        partial = _store_partial(
            acc, bias_ptr, dest_ptrs_ptr, chunk, slot + first_own + offs_m, m_mask, offs_n, N,
            a_ptr.dtype.element_ty, HAS_BIAS, own == 0,
        )  # fmt: skip
        if REDUCE_WORLD != 0:
            _reduce_own(
                partial, dest_ptrs_ptr, out_ptr, flags_ptr, timeouts_ptr, epoch, own, rank, outer * inner,
                first_own, offs_m, m_mask, offs_n, N, scale, a_ptr.dtype.element_ty, REDUCE_WORLD, SPIN_LIMIT,
                PIPELINED_WAIT,
            )  # fmt: skip
        _count_tiles(
            counters_ptr, flag_ptrs_ptr, tile, pid, num_programs, tiles_per_chunk, world_size, epoch,
            rank + 1, False,
        )  # fmt: skip


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def matmul_reduce_scatter_tma_kernel(
    a_desc, b_desc, bias_ptr, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr, a_scale_ptr,
    b_scale_ptr, out_ptr, flags_ptr, timeouts_ptr, scale, outer, inner, N, K, rank, world_size, num_programs,
    HAS_BIAS: tl.constexpr,
    REDUCE_WORLD: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    PIPELINED_WAIT: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    B_NK: tl.constexpr,
    FP8_EXACT: tl.constexpr,
    FLATTEN: tl.constexpr,
    PTX_BARRIER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """The producer with TMA loads (host-side descriptors), same order and epilogue. Rows past a
    block's end that a tile loads are the next rows of A (or TMA's zeros): they only feed rows
    that the masked store drops. Partials are stored as OUT_DTYPE. The tile loop is flattened
    into the K loop (one software pipeline over all the program's tiles), and the epilogue
    finds its tile again from a counter of its own, as in the TMA consumer.

    Float8 (A and B float8, scales dequantize as _scaled_mm's, on the fp32 accumulator before
    the bias; FP8_EXACT: see gemm.tma_mainloop): A_SCALE 1, the one value at a_scale_ptr, 2,
    one per row of A (A's row order); B_SCALE 1, one value at b_scale_ptr, 2, one per column.
    REDUCE_WORLD: as the pointer kernel's."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    tiles_m, tiles_n, tiles_per_chunk = tile_counts(outer, inner, N, BLOCK_M, BLOCK_N)
    slot = rank * outer * inner
    total_tiles = tiles_per_chunk * world_size
    tile_c = pid - num_programs  # the epilogue's tile
    for tile in tl.range(pid, total_tiles, num_programs, flatten=FLATTEN):
        chunk, tile_m, tile_n = chunk_tile(tile, tiles_m, tiles_n, rank + 1, world_size, GROUP_M)
        _, first_full, _, _ = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tma_mainloop(a_desc, first_full, b_desc, tile_n * BLOCK_N, K, acc, B_NK, BLOCK_K, FP8_EXACT)

        tile_c += num_programs
        chunk, tile_m, tile_n = chunk_tile(tile_c, tiles_m, tiles_n, rank + 1, world_size, GROUP_M)
        first_own, first_full, offs_m, m_mask = block_rows(tile_m, chunk, inner, world_size, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = scale_rows(acc, A_SCALE, a_scale_ptr, first_full + offs_m, m_mask)
        if B_SCALE != 0:
            acc = scale_columns(acc, b_scale_ptr, B_SCALE == 2, offs_n, offs_n < N)
        own = (chunk == rank) & (REDUCE_WORLD != 0)
        partial = _store_partial(
            acc, bias_ptr, dest_ptrs_ptr, chunk, slot + first_own + offs_m, m_mask, offs_n, N,
            OUT_DTYPE, HAS_BIAS, own == 0,
        )  # fmt: skip
        if REDUCE_WORLD != 0:
            _reduce_own(
                partial, dest_ptrs_ptr, out_ptr, flags_ptr, timeouts_ptr, epoch, own, rank, outer * inner,
                first_own, offs_m, m_mask, offs_n, N, scale, OUT_DTYPE, REDUCE_WORLD, SPIN_LIMIT, PIPELINED_WAIT,
            )  # fmt: skip
        _count_tiles(
            counters_ptr, flag_ptrs_ptr, tile_c, pid, num_programs, tiles_per_chunk, world_size, epoch,
            rank + 1, PTX_BARRIER,
        )  # fmt: skip


_TMA_KERNEL = DirectKernel(matmul_reduce_scatter_tma_kernel)
_POINTER_KERNEL = DirectKernel(matmul_reduce_scatter_producer_kernel)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _scale_kind(scale: torch.Tensor) -> int:
    """1: one value, 2: one per row (A) or column (B)."""
    return 1 if scale.numel() == 1 else 2


@dataclasses.dataclass(frozen=True)
class OwnReduction:
    """What a producer needs to sum its own chunk in its epilogue (see the module docstring):
    ``out``, the op's output ([rows of a chunk, N], contiguous); this rank's flag words, one per
    producer rank, and timeout words (reduce_partials'); ``scale``, 1 or 1/W for avg."""

    out: torch.Tensor
    flags: torch.Tensor
    timeouts: torch.Tensor
    scale: float = 1.0
    spin_limit: int = 1 << 30


def check_protocol_args(dest_ptrs, flag_ptrs, counters, world_size: int) -> None:
    """The producers' destinations, flags and counters: one per chunk, of the kernels' types."""
    for name, t in (("dest_ptrs", dest_ptrs), ("flag_ptrs", flag_ptrs)):
        if t.dtype != torch.int64 or t.numel() != world_size:
            raise ValueError(f"{name} must hold {world_size} int64 addresses")
    if counters.dtype != torch.int32 or counters.numel() != world_size:
        raise ValueError(f"counters must be {world_size} int32 words")


@compiles_other_configs(CONFIGS, FLOAT8_CONFIGS)
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
    inner: int | None = None,
    num_programs: int | None = None,
    tile_log: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    fast_accum: bool = False,
    own_reduction: OwnReduction | None = None,
) -> None:
    """Launches the producer: for every chunk j, A_j @ mat2 (+ bias) into ``dest_ptrs[j]`` (int64
    addresses, 16-byte aligned, of [M, N] contiguous buffers of ``out_dtype``, by default a's),
    rows of slot ``rank``; then flag ``flag_ptrs[j]`` (int64 address of an int32) =
    ``epoch[0]``. ``a``:
    [M, K], the full input: M / (world * inner) blocks of ``world`` chunks of ``inner`` rows
    (tiles.py; default: one block, chunk j the j-th M / world rows).
    ``counters``: int32, one per chunk, zero before the first call (the kernel leaves them zero).
    ``tile_log`` (int32, tiles + 1; pointer loads): the order tiles started in.

    Float8 (a and mat2 float8, e4m3 or e5m2 each; ``scales`` given): TMA loads only, mat2 a
    linear weight ([N, K] transposed, K-major, as fp8 tensor cores and _scaled_mm want it);
    ``scales`` = (a's: one fp32 value or M contiguous, one per row; mat2's: one value or N
    contiguous, one per column). A_j @ mat2 is then (A_j * its scales) @ (mat2 * its scales);
    ``fast_accum`` as _scaled_mm's use_fast_accum (gemm.tma_mainloop).

    ``own_reduction``: the own chunk's partial is not stored; its tiles sum the peers' partials
    from ``dest_ptrs[rank]`` into ``own_reduction.out`` instead (module docstring)."""
    m, k = a.shape
    inner = inner or m // world_size
    float8 = a.dtype in FLOAT8 and mat2.dtype in FLOAT8
    if m % (world_size * inner) or mat2.shape[0] != k or (mat2.dtype != a.dtype and not float8):
        raise ValueError(
            f"A {list(a.shape)} {a.dtype}, B {list(mat2.shape)} {mat2.dtype}, world {world_size}, inner {inner}"
        )
    if float8 != (scales is not None):
        raise ValueError("float8 operands take scales, and only they")
    check_protocol_args(dest_ptrs, flag_ptrs, counters, world_size)
    outer, n = m // (world_size * inner), mat2.shape[1]
    out_dtype = out_dtype or a.dtype
    use_tma = config.tma and tile_log is None and tma_fits(a, mat2)
    if float8:
        a_scale, b_scale = scales
        if not (use_tma and mat2.stride(0) == 1) or a_scale.numel() not in (1, m) or b_scale.numel() not in (1, n):
            raise ValueError(
                f"float8 needs a TMA config, aligned operands, mat2 a transposed [N, K] weight and "
                f"scales of 1 or {m} and 1 or {n} values: got {a_scale.numel()} and {b_scale.numel()}"
            )
    if not use_tma:
        config = pointer_fallback(config, a.dtype)
    programs = min(num_programs or sm_count(a.device), chunk_tiles(world_size, outer, inner, n, config))
    bias_arg = bias if bias is not None else a
    reduction = _reduction_args(own_reduction, m // world_size, n, world_size, a.is_cuda, counters)
    if use_tma:
        bm, bk = config.block_m, config.block_k
        a_scale, b_scale = scales or (counters, counters)
        a_kind, b_kind = (_scale_kind(s) for s in scales) if scales else (0, 0)
        exact = float8 and not fast_accum
        _TMA_KERNEL[(programs,)](
            TensorDescriptor.from_tensor(a, [bm, bk]), b_descriptor(mat2, config), bias_arg, dest_ptrs,
            flag_ptrs, counters, epoch, a_scale, b_scale, *reduction.args, outer, inner, n, k, rank, world_size,
            programs, HAS_BIAS=bias is not None, **reduction.constexprs, A_SCALE=a_kind, B_SCALE=b_kind,
            OUT_DTYPE=_TL_DTYPES[out_dtype], B_NK=mat2.stride(0) == 1, FP8_EXACT=exact,
            FLATTEN=flatten_tiles(exact, [out_dtype, *reduction.out_dtypes]),
            PTX_BARRIER=a.is_cuda,
            BLOCK_M=bm, BLOCK_N=config.block_n,
            BLOCK_K=bk, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return
    if out_dtype != a.dtype:
        raise ValueError(f"pointer loads store partials in A's dtype {a.dtype}, not {out_dtype}")
    _POINTER_KERNEL[(programs,)](
        a, mat2, bias_arg, dest_ptrs, flag_ptrs, counters, epoch,
        tile_log if tile_log is not None else counters, *reduction.args,
        outer, inner, n, k, a.stride(0), a.stride(1), mat2.stride(0), mat2.stride(1),
        rank, world_size, programs,
        HAS_BIAS=bias is not None,
        **reduction.constexprs,
        LOG_TILES=tile_log is not None,
        FP32_IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


# chunk_numel specialized (a multiple of 16 or not, so at most two compiles): the masked loads
# are vectorized only when Triton knows it is (reduce_partials has the times)
@triton.jit
def reduce_partials_kernel(partials_ptr, out_ptr, chunk_numel, scale, world_size, BLOCK: tl.constexpr):
    """out = scale * sum_p partials[p] (p = 0, 1, ..., W - 1, in fp32). ``partials``: [W,
    chunk_numel] contiguous, every slot there (wait_for_peers_kernel ran before, on the same
    stream)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for peer in range(0, world_size):
        acc += tl.load(partials_ptr + peer * chunk_numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


_REDUCE_KERNEL = DirectKernel(reduce_partials_kernel)


@dataclasses.dataclass(frozen=True)
class _ReductionArgs:
    args: tuple  # out_ptr, flags_ptr, timeouts_ptr, scale
    constexprs: dict  # REDUCE_WORLD, SPIN_LIMIT, PIPELINED_WAIT
    out_dtypes: tuple  # the output's dtype, where the epilogue stores it


def _reduction_args(reduction: OwnReduction | None, rows: int, n: int, world_size: int, on_gpu: bool, stand_in):
    """The producers' reduction arguments; ``stand_in``, a tensor for the pointers not used."""
    if reduction is None:
        off = dict(REDUCE_WORLD=0, SPIN_LIMIT=1, PIPELINED_WAIT=False)
        return _ReductionArgs((stand_in, stand_in, stand_in, 1.0), off, ())
    out = reduction.out
    if not out.is_contiguous() or out.numel() != rows * n:
        raise ValueError(f"the reduction's output {list(out.shape)} is not a contiguous [{rows}, {n}]")
    if reduction.flags.numel() != world_size or reduction.timeouts.numel() != world_size:
        raise ValueError(f"the reduction waits on {world_size} flags, with {world_size} timeout words")
    constexprs = dict(REDUCE_WORLD=world_size, SPIN_LIMIT=reduction.spin_limit, PIPELINED_WAIT=on_gpu)
    args = (out, reduction.flags, reduction.timeouts, reduction.scale)
    return _ReductionArgs(args, constexprs, (out.dtype,))


def reduce_partials(
    partials: torch.Tensor,
    out: torch.Tensor,
    flags: torch.Tensor,
    epoch: torch.Tensor,
    timeouts: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    scale: float = 1.0,
    spin_limit: int = 1 << 30,
    block: int = 4096,
    num_warps: int = 4,
) -> torch.Tensor:
    """Launches the owner's reduction: ``out`` ([rows, N], contiguous) = scale * the fp32 sum in
    rank order of the W slots of ``partials`` ([W * rows, N], contiguous), once every peer's
    slot is flagged (``flags[p]`` holds the call's epoch). A wait that gives up writes the
    epoch into ``timeouts[p]``.

    One program waits and stream order holds the sum behind it (a kernel boundary makes what
    the wait acquired visible): the wait's kernel is short and the sum runs about as fast as
    torch.add of the slots, where a wait in every program of the sum (an acquire at system
    scope each) makes it far slower, and so does an unspecialized ``chunk_numel``."""
    numel = out.numel()
    if not (partials.is_contiguous() and out.is_contiguous() and partials.numel() == world_size * numel):
        raise ValueError(f"partials {list(partials.shape)} do not hold {world_size} of out {list(out.shape)}")
    WAIT_FOR_PEERS[(1,)](flags, epoch, timeouts, rank, world_size, SPIN_LIMIT=spin_limit, num_warps=1)
    grid = (triton.cdiv(numel, block),)
    _REDUCE_KERNEL[grid](partials, out, numel, scale, world_size, BLOCK=block, num_warps=num_warps)
    return out
