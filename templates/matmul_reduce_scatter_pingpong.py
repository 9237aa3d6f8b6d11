"""The float8 reduce-scatter producer as a warp-specialized Hopper GEMM in Gluon: the partial
A_j @ B (scales in the epilogue, + bias) of every chunk j stored where chunk j's owner reduces
it, each chunk flagged once all its tiles are there, as matmul_reduce_scatter.py's Triton
producer does, with all_gather_matmul_pingpong.py's warps: a loader warp issues the TMA loads of
the program's tiles (chunks from rank + 1 on, the own chunk last) into a ring of stages; two
consumer warpgroups take the tiles alternately, each one's epilogue (scales, bias, the store
into the owner's slot, often a peer's memory over NVLink) running while the other's main loop
keeps the tensor cores busy.

Publishing a chunk: each warpgroup, after its last tile of a chunk, waits at a barrier of its
own 128 threads (so every thread's stores come before what follows), then adds the number of
its tiles there to the chunk's counter (acq_rel, system scope); the one that completes the
count resets it for the next call and writes the chunk's flag (release, system scope). One
atomic per warpgroup and chunk, as the Triton producer has one per program and chunk.

Exact accumulation (use_fast_accum=False, torchao's backward) and sums of matmuls (the
backward's input gradients of separate Q, K, V or gate, up weights: sum_t A_t @ B_t, each term
with its own scales and K) run the consumer's cooperative form instead: both warpgroups on every
tile, 64 rows each, each term's K blocks in turn (the loader loads them one after another into
the ring), each block's product waited for and added into fp32, the terms' dequantized products
summed in fp32 (not rounded one by one, as the op's reference rounds them) before one store.
Each warpgroup then counts its half of every tile, the chunk complete at twice its tiles.

Float8 only, mat2s linear weights ([N, K] transposed). It runs near cuBLAS's _scaled_mm with
fast accumulation, and far nearer cuBLAS exact than the Triton producer does without it; one
launch summing the input gradients beats cuBLAS's matmul per term and adds for Q+K+V and about
ties it for gate+up (docs/benchmarks.md, the fused GEMMs alone).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .all_gather_matmul_pingpong import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    CONSUMER_REGS,
    LOADER_REGS,
    MAX_B,
    MAXNREG,
    TILE,
    _exact_tile,
    _gl_float8,
    _loader,
    _tile,
    _weight_descriptor,
    allocate_ring,
    fits_float8,
    mma_tile,
    store_tile,
)
from .all_gather_matmul_pingpong import CONFIGS as CONFIGS  # the same configs serve both
from .all_gather_matmul_pingpong import PingpongConfig as PingpongConfig
from .all_gather_matmul_pingpong import usable as usable
from .gemm import sm_count
from .gluon_hopper import thread_barrier
from .launch import TOKEN_COUNTS, DirectKernel, compiles_other_configs
from .matmul_reduce_scatter import check_protocol_args

MAX_TERMS = MAX_B  # matmuls one launch sums (the loader's descriptors): Q, K, V's input gradient
_OUT_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _publish(counters_ptr, flag_ptrs_ptr, chunk, count, target, epoch):
    """After a warpgroup's last tile of ``chunk`` (its ``count`` tiles there): the warpgroup's
    threads meet (their stores before the release), then one add to the chunk's counter; the
    add that brings it to ``target`` resets the counter and flags the chunk."""
    thread_barrier()  # in a warp_specialize partition: a barrier of its warps alone
    total = gl.atomic_add(counters_ptr + chunk, count, sem="acq_rel", scope="sys") + count
    if total == target:
        gl.atomic_xchg(counters_ptr + chunk, 0, sem="relaxed", scope="gpu")
        flag = gl.load(flag_ptrs_ptr + chunk).to(gl.pointer_type(gl.int32))
        gl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@gluon.jit
def _dequantized(acc, a_scale_ptr, b_scale_ptr, rows, m_mask, offs_n, n_mask, A_ROWWISE: gl.constexpr,
                 B_ROWWISE: gl.constexpr):  # fmt: skip
    """acc (rows ``rows`` of A, columns ``offs_n``) times A's scale (one value, or one per row
    where A_ROWWISE) and B's (one value, or one per column where B_ROWWISE)."""
    if A_ROWWISE:
        acc = acc * gl.expand_dims(gl.load(a_scale_ptr + rows, mask=m_mask, other=0.0), 1)
    else:
        acc = acc * gl.load(a_scale_ptr)
    if B_ROWWISE:
        acc = acc * gl.expand_dims(gl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0), 0)
    else:
        acc = acc * gl.load(b_scale_ptr)
    return acc


@gluon.jit
def _store_partial(acc, dest_ptrs_ptr, bias_ptr, chunk, slot, first_own, start, inner, tile_n, N, offs_n, n_mask,
                   HAS_BIAS: gl.constexpr, OUT_DTYPE: gl.constexpr):  # fmt: skip
    """acc (+ bias) into chunk ``chunk``'s owner's buffer, rows ``slot + first_own`` on."""
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32), 0)
    # the owner's buffer: 16-byte aligned (the host checks), which an address read from memory
    # cannot tell the compiler
    dest = gl.multiple_of(gl.load(dest_ptrs_ptr + chunk).to(gl.pointer_type(OUT_DTYPE)), 16)
    store_tile(dest, slot + first_own, N, start, inner, tile_n * BLOCK_N, N, acc.to(OUT_DTYPE))


@gluon.jit
def _producer(a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
              bias_ptr, a_scale_ptrs, b_scale_ptrs, outer, inner, N, Ks, rank, world_size, WG: gl.constexpr,
              A_ROWWISE_MASK: gl.constexpr, B_ROWWISE_MASK: gl.constexpr, HAS_BIAS: gl.constexpr,
              OUT_DTYPE: gl.constexpr, GROUP_M: gl.constexpr, COOPERATIVE: gl.constexpr):  # fmt: skip
    """Warpgroup WG (4 warps): its alternate tiles, main loop, then the epilogue: each term's
    product dequantized by its scales (bit t of A_ROWWISE_MASK: term t's A has one per row,
    A's row order; of B_ROWWISE_MASK: its B one per column; else one value), the terms summed,
    the bias, the store into the chunk owner's slot, the chunk's count. COOPERATIVE (exact
    accumulation, or a sum): both warpgroups on every tile, WG's 64 rows each, every term's
    K blocks waited for and added into fp32 (the consumer's _exact_tile)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // a_bufs.dtype.primitive_bitwidth]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    epoch = gl.load(epoch_ptr)
    tiles_m = outer * gl.cdiv(inner, BLOCK_M)
    tiles_per_chunk = tiles_m * gl.cdiv(N, BLOCK_N)
    nprog = gl.num_programs(0)
    slot = rank * outer * inner  # this rank's rows in every owner's partials buffer
    count = 0  # this warpgroup's tiles of the current chunk
    if COOPERATIVE:
        row0: gl.constexpr = WG * (BLOCK_M // 2)
        first, step_tiles, target = gl.program_id(0), nprog, 2 * tiles_per_chunk  # each tile counted twice
    else:
        row0: gl.constexpr = 0
        first, step_tiles, target = gl.program_id(0) + WG * nprog, 2 * nprog, tiles_per_chunk
    pos = 0  # COOPERATIVE: the ring position of the tile's first K block
    j = WG  # else: the program's local tile number: its K blocks start at ring position j * k_tiles
    turn = 0
    for tile in range(first, tiles_per_chunk * world_size, step_tiles):
        chunk, _, tile_n, first_own, first_full, start = _tile(
            tile, tiles_m, (N,), tiles_per_chunk, rank + 1, world_size, inner, GROUP_M
        )
        offs = gl.arange(0, BLOCK_M // 2 if COOPERATIVE else BLOCK_M, layout=rows_layout)
        rows = first_full + row0 + offs
        m_mask = start + row0 + offs < inner
        offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
        n_mask = offs_n < N
        if COOPERATIVE:
            for t in gl.static_range(len(Ks)):
                k_tiles = gl.cdiv(Ks[t], BLOCK_K)
                term = _exact_tile(a_bufs, b_bufs, ready, empty, pos, k_tiles, row0, mma_layout)
                pos += k_tiles
                term = _dequantized(term, a_scale_ptrs[t], b_scale_ptrs[t], rows, m_mask, offs_n, n_mask,
                                    (A_ROWWISE_MASK >> t) & 1, (B_ROWWISE_MASK >> t) & 1)  # fmt: skip
                if t == 0:
                    acc = term
                else:
                    acc = acc + term
        else:
            k_tiles = gl.cdiv(Ks[0], BLOCK_K)
            acc = mma_tile(a_bufs, b_bufs, ready, empty, turns, j * k_tiles, turn, k_tiles, WG, mma_layout)
            turn += 1
            j += 2
            acc = _dequantized(acc, a_scale_ptrs[0], b_scale_ptrs[0], rows, m_mask, offs_n, n_mask,
                               A_ROWWISE_MASK & 1, B_ROWWISE_MASK & 1)  # fmt: skip
        _store_partial(acc, dest_ptrs_ptr, bias_ptr, chunk, slot, first_own + row0, start + row0, inner, tile_n, N,
                       offs_n, n_mask, HAS_BIAS, OUT_DTYPE)  # fmt: skip
        count += 1
        step = tile // tiles_per_chunk
        if tile + step_tiles >= (step + 1) * tiles_per_chunk:  # the warpgroup's last tile of the chunk
            _publish(counters_ptr, flag_ptrs_ptr, chunk, count, target, epoch)
            count = 0


@gluon.jit(do_not_specialize=TOKEN_COUNTS)
def matmul_reduce_scatter_pingpong_kernel(
    a_desc0, a_desc1, a_desc2, a_desc3, b_desc0, b_desc1, b_desc2, b_desc3, dest_ptrs_ptr, flag_ptrs_ptr,
    counters_ptr, epoch_ptr, bias_ptr, a_scale_ptrs, b_scale_ptrs, outer, inner, N, Ks, rank, world_size,
    A_ROWWISE_MASK: gl.constexpr, B_ROWWISE_MASK: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_DTYPE: gl.constexpr,
    NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, COOPERATIVE: gl.constexpr,
):  # fmt: skip
    """For every chunk j: sum_t (A t_j * its scale) @ (B t * its scale) (+ bias) into
    dest_ptrs[j]'s rows of this rank's slot, then flag_ptrs[j] = epoch once the chunk is whole
    (module docstring). a_desc t: [BLOCK_M, BLOCK_K] blocks of term t's A rows; b_desc t:
    [BLOCK_N, BLOCK_K] blocks of its B as [N, K] rows (descriptors past len(Ks) repeat the
    first); a_scale_ptrs, b_scale_ptrs, Ks: one entry per term. COOPERATIVE: both warpgroups
    on every tile (exact accumulation, sums). 4 warps (the first warpgroup), + 4 + 1."""
    # cooperative: both warpgroups release each stage
    a_bufs, b_bufs, ready, empty, turns = allocate_ring(a_desc0, b_desc0, NUM_STAGES, 2 if COOPERATIVE else 1)
    # (argument tuples written out in the call, as in all_gather_matmul_pingpong_kernel; the
    # loader's flag, epoch-for-waits and timeouts arguments unused: GATHER off)
    gl.warp_specialize([
        (_producer, (a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
                     bias_ptr, a_scale_ptrs, b_scale_ptrs, outer, inner, N, Ks, rank, world_size, gl.constexpr(0),
                     A_ROWWISE_MASK, B_ROWWISE_MASK, HAS_BIAS, OUT_DTYPE, GROUP_M, COOPERATIVE)),
        (_producer, (a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
                     bias_ptr, a_scale_ptrs, b_scale_ptrs, outer, inner, N, Ks, rank, world_size, gl.constexpr(1),
                     A_ROWWISE_MASK, B_ROWWISE_MASK, HAS_BIAS, OUT_DTYPE, GROUP_M, COOPERATIVE)),
        (_loader, (a_desc0, a_desc1, a_desc2, a_desc3, a_desc0, b_desc0, b_desc1, b_desc2, b_desc3, a_bufs, b_bufs,
                   ready, empty, counters_ptr, epoch_ptr, counters_ptr, outer, inner, (N,), Ks, rank, world_size,
                   GROUP_M, gl.constexpr(1), gl.constexpr(False))),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


_KERNEL = DirectKernel(matmul_reduce_scatter_pingpong_kernel)


@compiles_other_configs(CONFIGS)
def matmul_reduce_scatter_pingpong(
    a, mat2, bias, dest_ptrs, flag_ptrs, counters, epoch, *, rank, world_size, config, scales, out_dtype,
    fast_accum, inner=None, num_programs=None, terms=(),
):  # fmt: skip
    """matmul_reduce_scatter.matmul_reduce_scatter_producer's float8 path on this kernel, same
    arguments (``config``: a PingpongConfig; ``scales``: (A's, one value or one per row; B's,
    one value or one per column), contiguous). ``terms``: further (a, mat2, scales) of a sum of
    matmuls (up to MAX_TERMS in all; every A of a's rows and float8 type, every B of mat2's
    columns and type), each product dequantized by its own scales, the bias added once. Exact
    accumulation (not ``fast_accum``) and sums run the cooperative form."""
    operands = [(a, mat2, scales), *terms]
    m = a.shape[0]
    inner = inner or m // world_size
    n = mat2.shape[1]
    if len(operands) > MAX_TERMS:
        raise ValueError(f"the pingpong producer sums at most {MAX_TERMS} matmuls, not {len(operands)}")
    for a_t, mat2_t, (a_scale, b_scale) in operands:
        if not (fits_float8(a_t, [mat2_t]) and a_scale.numel() in (1, m) and b_scale.numel() in (1, n)):
            raise ValueError("the pingpong producer takes aligned float8 operands, [N, K] weights, scales of their sizes")
        same_types = (a_t.dtype, mat2_t.dtype) == (a.dtype, mat2.dtype)
        if a_t.shape[0] != m or mat2_t.shape != (a_t.shape[1], n) or not same_types:
            shapes = f"A {list(a_t.shape)} {a_t.dtype}, B {list(mat2_t.shape)} {mat2_t.dtype}"
            raise ValueError(f"{shapes} do not join the sum")
    if m % (world_size * inner):
        raise ValueError(f"A {list(a.shape)}, world {world_size}, inner {inner}")
    check_protocol_args(dest_ptrs, flag_ptrs, counters, world_size)
    outer = m // (world_size * inner)
    tiles = world_size * outer * triton.cdiv(inner, TILE) * triton.cdiv(n, TILE)
    a_layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], _gl_float8(a.dtype))
    a_descs = [TensorDescriptor.from_tensor(a_t, [TILE, TILE], a_layout) for a_t, _, _ in operands]
    b_descs = [_weight_descriptor(mat2_t) for _, mat2_t, _ in operands]
    padding = MAX_TERMS - len(operands)  # the kernel's unused descriptors repeat the first
    a_scales, b_scales = (tuple(pair[i] for _, _, pair in operands) for i in (0, 1))
    _KERNEL[(min(num_programs or sm_count(a.device), tiles),)](
        *a_descs, *a_descs[:1] * padding, *b_descs, *b_descs[:1] * padding, dest_ptrs, flag_ptrs, counters, epoch,
        bias if bias is not None else a_scales[0], a_scales, b_scales, outer, inner, n,
        tuple(a_t.shape[1] for a_t, _, _ in operands), rank, world_size,
        A_ROWWISE_MASK=sum(1 << t for t, s in enumerate(a_scales) if s.numel() > 1),
        B_ROWWISE_MASK=sum(1 << t for t, s in enumerate(b_scales) if s.numel() > 1), HAS_BIAS=bias is not None,
        OUT_DTYPE=_OUT_DTYPES[out_dtype], NUM_STAGES=config.stages, GROUP_M=config.group_m,
        COOPERATIVE=not fast_accum or len(operands) > 1, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
