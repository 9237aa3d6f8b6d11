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

Float8 only, fast accumulation, mat2 a linear weight ([N, K] transposed). Replayed on one H100
against cuBLAS's _scaled_mm on the bench_ops shapes (docs/bench/2026-11-25-s17): rowwise
1.02-1.11x (the Triton producer 1.06-1.23x), tensorwise 0.96-1.00x; the 16-byte stores of
all_gather_matmul_pingpong.store_tile took 8B's o from 1.27x to 1.11x.
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
    MAXNREG,
    TILE,
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
from .matmul_reduce_scatter import check_protocol_args

_OUT_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _publish(counters_ptr, flag_ptrs_ptr, chunk, count, tiles_per_chunk, epoch):
    """After a warpgroup's last tile of ``chunk`` (its ``count`` tiles there): the warpgroup's
    threads meet (their stores before the release), then one add to the chunk's counter; the
    add that completes it resets the counter and flags the chunk."""
    gl.thread_barrier()  # in a warp_specialize partition: a barrier of its warps alone
    total = gl.atomic_add(counters_ptr + chunk, count, sem="acq_rel", scope="sys") + count
    if total == tiles_per_chunk:
        gl.atomic_xchg(counters_ptr + chunk, 0, sem="relaxed", scope="gpu")
        flag = gl.load(flag_ptrs_ptr + chunk).to(gl.pointer_type(gl.int32))
        gl.atomic_xchg(flag, epoch, sem="release", scope="sys")


@gluon.jit
def _producer(a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
              bias_ptr, a_scale_ptr, b_scale_ptr, outer, inner, N, K, rank, world_size, WG: gl.constexpr,
              A_SCALE: gl.constexpr, B_ROWWISE: gl.constexpr, HAS_BIAS: gl.constexpr,
              OUT_DTYPE: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup WG (4 warps): its alternate tiles, main loop, then the epilogue: A_SCALE 1, one
    value; 2, one per row of A (A's row order); B's scale one value, or one per column where
    B_ROWWISE; the bias; the store into the chunk owner's slot; the chunk's count."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // a_bufs.dtype.primitive_bitwidth]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    epoch = gl.load(epoch_ptr)
    tiles_m = outer * gl.cdiv(inner, BLOCK_M)
    tiles_per_chunk = tiles_m * gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nprog = gl.num_programs(0)
    first = gl.program_id(0) + WG * nprog  # this warpgroup's tiles: first, first + 2 * nprog, ...
    slot = rank * outer * inner  # this rank's rows in every owner's partials buffer
    j = WG  # the program's local tile number: its K blocks start at ring position j * k_tiles
    turn = 0
    count = 0  # this warpgroup's tiles of the current chunk
    for tile in range(first, tiles_per_chunk * world_size, 2 * nprog):
        chunk, _, tile_n, first_own, first_full, start = _tile(
            tile, tiles_m, (N,), tiles_per_chunk, rank + 1, world_size, inner, GROUP_M
        )
        acc = mma_tile(a_bufs, b_bufs, ready, empty, turns, j * k_tiles, turn, k_tiles, WG, mma_layout)
        turn += 1
        j += 2

        offs = gl.arange(0, BLOCK_M, layout=rows_layout)
        m_mask = start + offs < inner
        offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
        n_mask = offs_n < N
        if A_SCALE == 1:
            acc = acc * gl.load(a_scale_ptr)
        if A_SCALE == 2:
            acc = acc * gl.expand_dims(gl.load(a_scale_ptr + first_full + offs, mask=m_mask, other=0.0), 1)
        if B_ROWWISE:
            acc = acc * gl.expand_dims(gl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0), 0)
        else:
            acc = acc * gl.load(b_scale_ptr)
        if HAS_BIAS:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32), 0)
        # the owner's buffer: 16-byte aligned (the host checks), which an address read from
        # memory cannot tell the compiler
        dest = gl.multiple_of(gl.load(dest_ptrs_ptr + chunk).to(gl.pointer_type(OUT_DTYPE)), 16)
        store_tile(dest, slot + first_own, N, start, inner, tile_n * BLOCK_N, N, acc.to(OUT_DTYPE))

        count += 1
        step = tile // tiles_per_chunk
        if tile + 2 * nprog >= (step + 1) * tiles_per_chunk:  # the warpgroup's last tile of the chunk
            _publish(counters_ptr, flag_ptrs_ptr, chunk, count, tiles_per_chunk, epoch)
            count = 0


@gluon.jit
def matmul_reduce_scatter_pingpong_kernel(
    a_desc, b_desc, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr, bias_ptr, a_scale_ptr, b_scale_ptr,
    outer, inner, N, K, rank, world_size,
    A_SCALE: gl.constexpr, B_ROWWISE: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_DTYPE: gl.constexpr,
    NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
):  # fmt: skip
    """For every chunk j: (A_j * its scale) @ (B * its scale) (+ bias) into dest_ptrs[j]'s
    rows of this rank's slot, then flag_ptrs[j] = epoch once the chunk is whole (module
    docstring). a_desc: [BLOCK_M, BLOCK_K] blocks of A's rows; b_desc: [BLOCK_N, BLOCK_K] blocks
    of B as [N, K] rows. 4 warps (the first warpgroup), + 4 + 1."""
    a_bufs, b_bufs, ready, empty, turns = allocate_ring(a_desc, b_desc, NUM_STAGES, 1)
    # (argument tuples written out in the call, as in all_gather_matmul_pingpong_kernel; the
    # loader's flag, epoch-for-waits and timeouts arguments unused: GATHER off)
    gl.warp_specialize([
        (_producer, (a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
                     bias_ptr, a_scale_ptr, b_scale_ptr, outer, inner, N, K, rank, world_size, gl.constexpr(0),
                     A_SCALE, B_ROWWISE, HAS_BIAS, OUT_DTYPE, GROUP_M)),
        (_producer, (a_bufs, b_bufs, ready, empty, turns, dest_ptrs_ptr, flag_ptrs_ptr, counters_ptr, epoch_ptr,
                     bias_ptr, a_scale_ptr, b_scale_ptr, outer, inner, N, K, rank, world_size, gl.constexpr(1),
                     A_SCALE, B_ROWWISE, HAS_BIAS, OUT_DTYPE, GROUP_M)),
        (_loader, (a_desc, a_desc, b_desc, b_desc, b_desc, b_desc, a_bufs, b_bufs, ready, empty, counters_ptr,
                   epoch_ptr, counters_ptr, outer, inner, (N,), K, rank, world_size, GROUP_M, gl.constexpr(1),
                   gl.constexpr(False))),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


def matmul_reduce_scatter_pingpong(
    a, mat2, bias, dest_ptrs, flag_ptrs, counters, epoch, *, rank, world_size, config, scales, out_dtype,
    fast_accum, inner=None, num_programs=None,
):  # fmt: skip
    """matmul_reduce_scatter.matmul_reduce_scatter_producer's float8 path on this kernel, same
    arguments (``config``: a PingpongConfig; ``scales``: (A's, one value or one per row; B's,
    one value or one per column), contiguous)."""
    m, k = a.shape
    inner = inner or m // world_size
    n = mat2.shape[1]
    a_scale, b_scale = scales
    if not (fast_accum and fits_float8(a, [mat2]) and a_scale.numel() in (1, m) and b_scale.numel() in (1, n)):
        raise ValueError("the pingpong producer takes aligned float8 operands, an [N, K] weight, fast accumulation")
    if m % (world_size * inner) or mat2.shape[0] != k:
        raise ValueError(f"A {list(a.shape)}, B {list(mat2.shape)}, world {world_size}, inner {inner}")
    check_protocol_args(dest_ptrs, flag_ptrs, counters, world_size)
    outer = m // (world_size * inner)
    tiles = world_size * outer * triton.cdiv(inner, TILE) * triton.cdiv(n, TILE)
    a_desc = TensorDescriptor.from_tensor(
        a, [TILE, TILE], gl.NVMMASharedLayout.get_default_for([TILE, TILE], _gl_float8(a.dtype))
    )
    matmul_reduce_scatter_pingpong_kernel[(min(num_programs or sm_count(a.device), tiles),)](
        a_desc, _weight_descriptor(mat2), dest_ptrs, flag_ptrs, counters, epoch,
        bias if bias is not None else a_scale, a_scale, b_scale, outer, inner, n, k, rank, world_size,
        A_SCALE=1 if a_scale.numel() == 1 else 2, B_ROWWISE=b_scale.numel() > 1, HAS_BIAS=bias is not None,
        OUT_DTYPE=_OUT_DTYPES[out_dtype], NUM_STAGES=config.stages, GROUP_M=config.group_m,
        num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
