"""The float8 all-gather consumer as a warp-specialized Hopper GEMM in Gluon: out = gathered A @
B_i (scales in the epilogue) while A's chunks are still arriving, as all_gather_matmul.py's TMA
consumer computes it, with its warps split as CUTLASS's "pingpong" kernels split them.

- A loader warp walks the program's tiles (the same order: the own chunk first, then the peers
  rank-rotated, GROUP_M-swizzled inside a chunk; tiles.py's row layout) and issues the TMA loads
  of A and B into a ring of NUM_STAGES shared-memory stages (ready / empty mbarriers). Before
  its first load from a peer's chunk it waits for the chunk's flag: a bounded poll, reported in
  ``timeouts`` as the Triton consumer's, then fence.proxy.async so TMA sees what the acquire made
  visible. The own chunk is read in place (``a_local``).
- Two consumer warpgroups take the program's tiles alternately, each running async wgmma over K
  and then its own epilogue (scales, bias, masked 16-byte stores into A's row order) while the
  other's main loop keeps the tensor cores busy. An mbarrier pair hands the main-loop turn from
  one to the other: the ring is shared, and without the turn one warpgroup can wait on a stage
  two uses ahead, which a parity wait cannot tell from one use behind.

Exact accumulation (use_fast_accum=False, torchao's backward) runs a cooperative form instead:
both warpgroups on every tile, 64 rows each, each K block's product into a partial that is
waited for and then added into the fp32 accumulator (_exact_tile). It comes far nearer cuBLAS's
exact _scaled_mm than the Triton consumer does (docs/benchmarks.md, the fused GEMMs alone).

Float8 only, mat2s as linear weights ([N, K] transposed), up to MAX_B of them in one launch:
inside a chunk, B 0's tiles, then B 1's, and so on, as the Triton consumer orders them. One
launch for Q, K and V keeps busy the SMs that K's and V's few tiles would leave idle in a launch
each; it runs at about cuBLAS's pace, ahead of the Triton consumer (docs/benchmarks.md, the
fused GEMMs alone).
The loader and the main loop serve the reduce-scatter producer too
(matmul_reduce_scatter_pingpong.py).
"""

import dataclasses

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .all_gather_matmul import own_rows
from .gemm import FLOAT8, sm_count, tma_operand
from .gluon_hopper import async_tma_load
from .launch import TOKEN_COUNTS, DirectKernel, compiles_other_configs

TILE = 128  # a warpgroup's tile is TILE x TILE, in TILE-deep K blocks (128-byte float8 rows)
BLOCK_M = BLOCK_N = BLOCK_K = gl.constexpr(TILE)  # (what the kernels read)
CONSUMER_REGS, LOADER_REGS = gl.constexpr(232), gl.constexpr(40)
MAXNREG = 168  # 65536 registers over the 12 warps Triton rounds 4 + 4 + 1 to


@dataclasses.dataclass(frozen=True)
class PingpongConfig:
    stages: int
    group_m: int

    def __str__(self) -> str:
        return f"gluon_pingpong{TILE}x{TILE}x{TILE}s{self.stages}g{self.group_m}"


CONFIGS = [PingpongConfig(6, 4), PingpongConfig(4, 8)]  # the probe's best, and its steadiest


MAX_B = 4  # B matrices one launch takes (Q, K, V; gate, up)


@gluon.jit
def _chunk_tiles(tiles_m, Ns):
    """Tiles of one chunk over every B."""
    tiles = 0
    for i in gl.static_range(len(Ns)):
        tiles += tiles_m * gl.cdiv(Ns[i], BLOCK_N)
    return tiles


@gluon.jit
def _tile(tile, tiles_m, Ns, tiles_per_chunk, first_chunk, world_size, inner, GROUP_M: gl.constexpr):
    """(chunk, B, tile_n, first own row, first gathered row, first row within the chunk's block)
    of persistent tile ``tile``, chunks from ``first_chunk`` on (tiles.chunk_tile,
    tiles.block_rows and the Triton consumer's _tma_tile, in Gluon)."""
    chunk = (first_chunk + tile // tiles_per_chunk) % world_size
    local = tile % tiles_per_chunk
    b = 0
    tiles_n = gl.cdiv(Ns[0], BLOCK_N)
    first = 0
    next_first = tiles_m * tiles_n
    for i in gl.static_range(1, len(Ns)):
        if local >= next_first:
            b = i
            first = next_first
            tiles_n = gl.cdiv(Ns[i], BLOCK_N)
        next_first += tiles_m * gl.cdiv(Ns[i], BLOCK_N)
    local -= first
    group_size = GROUP_M * tiles_n
    first_m = (local // group_size) * GROUP_M
    rows_in_group = gl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (local % group_size) % rows_in_group
    tile_n = (local % group_size) // rows_in_group
    tiles_inner = gl.cdiv(inner, BLOCK_M)
    block = tile_m // tiles_inner
    start = (tile_m % tiles_inner) * BLOCK_M
    return chunk, b, tile_n, block * inner + start, (block * world_size + chunk) * inner + start, start


@gluon.jit
def _wait_chunk(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT: gl.constexpr):
    """Polls chunk ``chunk``'s flag (acquire, system scope) until it reaches ``epoch``, at most
    SPIN_LIMIT times, unless this call gave up on it already; a timeout goes to timeouts[chunk]
    (raise_on_timeouts names it). Then fence.proxy.async: TMA loads are the async proxy."""
    given_up = gl.load(timeouts_ptr + chunk, volatile=True) == epoch
    seen = gl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
    polls = 0
    while ((seen - epoch) < 0) & (polls < SPIN_LIMIT) & (given_up == 0):
        seen = gl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
        polls += 1
    if (seen - epoch) < 0:
        gl.atomic_xchg(timeouts_ptr + chunk, epoch, sem="relaxed", scope="gpu")
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [seen], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _load_block(i, desc0, desc1, desc2, desc3, row, col, bar, buf, COUNT: gl.constexpr):
    """Descriptor ``i``'s block at (row, col), of the first COUNT: a branch per descriptor
    (each is a kernel parameter of its own); a constexpr ``i`` leaves one."""
    if i == 0:
        async_tma_load(desc0, [row, col], bar, buf)
    if COUNT > 1:
        if i == 1:
            async_tma_load(desc1, [row, col], bar, buf)
    if COUNT > 2:
        if i == 2:
            async_tma_load(desc2, [row, col], bar, buf)
    if COUNT > 3:
        if i == 3:
            async_tma_load(desc3, [row, col], bar, buf)


@gluon.jit
def _loader(a_desc0, a_desc1, a_desc2, a_desc3, a_local_desc, b_desc0, b_desc1, b_desc2, b_desc3, a_bufs, b_bufs,
            ready, empty, flags_ptr, epoch_ptr, timeouts_ptr, outer, inner, Ns, Ks, rank, world_size,
            GROUP_M: gl.constexpr, SPIN_LIMIT: gl.constexpr, GATHER: gl.constexpr = True):  # fmt: skip
    """1 warp: every tile of this program in order, every K block, into the ring. GATHER (the
    all-gather consumer): chunks from the own one on, the own one's rows from a_local_desc, a
    peer's after its flag; else (the reduce-scatter producer, matmul_reduce_scatter_pingpong.py)
    chunks from rank + 1 on, every row from a_desc t, no waits. ``Ks``: a tile's terms (the
    producer's sums of matmuls), each term's K blocks in turn, term t's from a_desc t and B t
    (the unused descriptors repeat the first); the consumer has one, its B the tile's."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    nbytes: gl.constexpr = a_desc0.block_type.nbytes + b_desc0.block_type.nbytes
    epoch = gl.load(epoch_ptr)
    tiles_m = outer * gl.cdiv(inner, BLOCK_M)
    tiles_per_chunk = _chunk_tiles(tiles_m, Ns)
    ready_chunk = rank  # the last chunk waited for (the own one needs no wait; chunks come in order)
    first_chunk = rank if GATHER else rank + 1
    pos = 0  # ring position: stage pos % NUM_STAGES, its use number pos // NUM_STAGES
    for tile in range(gl.program_id(0), tiles_per_chunk * world_size, gl.num_programs(0)):
        chunk, b, tile_n, first_own, first_full, _ = _tile(
            tile, tiles_m, Ns, tiles_per_chunk, first_chunk, world_size, inner, GROUP_M
        )
        if GATHER:
            if chunk != ready_chunk:
                _wait_chunk(flags_ptr, timeouts_ptr, chunk, epoch, SPIN_LIMIT)
                ready_chunk = chunk
        for t in gl.static_range(len(Ks)):
            for kb in range(gl.cdiv(Ks[t], BLOCK_K)):
                s = pos % NUM_STAGES
                # a fresh mbarrier counts as having completed the phase before phase 0: the
                # first pass over the ring does not wait
                mbarrier.wait(empty.index(s), ((pos // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                if GATHER and chunk == rank:
                    async_tma_load(a_local_desc, [first_own, kb * BLOCK_K], bar, a_bufs.index(s))
                else:
                    _load_block(
                        t, a_desc0, a_desc1, a_desc2, a_desc3, first_full, kb * BLOCK_K, bar,
                        a_bufs.index(s), len(Ks),
                    )  # fmt: skip
                _load_block(
                    b + t, b_desc0, b_desc1, b_desc2, b_desc3, tile_n * BLOCK_N, kb * BLOCK_K, bar, b_bufs.index(s),
                    len(Ns) + len(Ks) - 1,
                )  # fmt: skip
                pos += 1


@gluon.jit
def mma_tile(a_bufs, b_bufs, ready, empty, turns, pos, turn, k_tiles, WG: gl.constexpr, mma_layout: gl.constexpr):
    """Warpgroup WG's main loop of one tile, in its turn (its ``turn``-th): async wgmma over the
    K blocks at ring positions pos, pos + 1, ...; the turn handed to the other warpgroup once
    the last is issued, each stage released once read. Returns the fp32 accumulator."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    # warpgroup 0 goes first (its first wait: the fresh barrier's "previous" phase)
    mbarrier.wait(turns.index(WG), (turn & 1) ^ (1 - WG))
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    for kb in range(k_tiles):
        s = pos % NUM_STAGES
        mbarrier.wait(ready.index(s), (pos // NUM_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        # at most this wgmma in flight: the previous K block's stage is read, release it
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES), pred=kb > 0)
        pos += 1
    mbarrier.arrive(turns.index(1 - WG))  # the other warpgroup's main loop may start
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((pos + NUM_STAGES - 1) % NUM_STAGES))
    return acc


# 8 consecutive columns a thread, each warp on the rows it holds in the wgmma layout (16 of
# every 64): the conversion stays within warps, and the stores are 16 bytes wide, not the
# 4 bytes of two bf16 that the wgmma layout gives a thread
STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))


@gluon.jit
def store_tile(base, first_row, row_stride, start, inner, first_col, N, values):
    """values ([rows, BLOCK_N], the wgmma layout) at base[(first_row + i) * row_stride +
    first_col + j], the rows past the block's end (start + i >= inner) and the columns past N
    masked."""
    values = gl.convert_layout(values, STORE_LAYOUT)
    offs = gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, STORE_LAYOUT))
    cols = first_col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE_LAYOUT))
    rows = (first_row + offs).to(gl.int64)
    ptrs = base + gl.expand_dims(rows * row_stride, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, values, mask=gl.expand_dims(start + offs < inner, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def _epilogue(acc, b, chunk, tile_n, first_own, first_full, start, rank, inner, c_ptrs, strides_cm, bias_ptrs,
              a_scale_ptr, a_local_scale_ptr, b_scale_ptrs, Ns, A_SCALE: gl.constexpr, B_ROWWISE_MASK: gl.constexpr,
              BIAS_MASK: gl.constexpr):  # fmt: skip
    """acc (rows first_own / first_full on, the wgmma layout) of B ``b``: A_SCALE 1, one value;
    2, one per row; B b's scale one value, or one per column where bit b of B_ROWWISE_MASK is
    set; B b's bias where bit b of BIAS_MASK is; the store at A's rows (rows past the chunk's
    block masked)."""
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    c_ptr, stride_cm, N, b_scale_ptr, bias_ptr = c_ptrs[0], strides_cm[0], Ns[0], b_scale_ptrs[0], bias_ptrs[0]
    col_step = B_ROWWISE_MASK & 1  # 0: the one value, read by every column
    has_bias = (BIAS_MASK & 1) != 0
    for i in gl.static_range(1, len(Ns)):
        if b == i:
            c_ptr, stride_cm, N, b_scale_ptr, bias_ptr = c_ptrs[i], strides_cm[i], Ns[i], b_scale_ptrs[i], bias_ptrs[i]
            col_step = (B_ROWWISE_MASK >> i) & 1
            has_bias = ((BIAS_MASK >> i) & 1) != 0
    offs = gl.arange(0, acc.shape[0], layout=rows_layout)
    m_mask = start + offs < inner
    offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_layout)
    n_mask = offs_n < N
    if A_SCALE == 1:
        acc = acc * gl.load(a_scale_ptr)
    if A_SCALE == 2:  # the own chunk's row scales are where its rows are
        if chunk == rank:
            row_scale = gl.load(a_local_scale_ptr + first_own + offs, mask=m_mask, other=0.0)
        else:
            row_scale = gl.load(a_scale_ptr + first_full + offs, mask=m_mask, other=0.0)
        acc = acc * gl.expand_dims(row_scale, 1)
    acc = acc * gl.expand_dims(gl.load(b_scale_ptr + offs_n * col_step, mask=n_mask, other=0.0), 0)
    if BIAS_MASK != 0:
        if has_bias:
            acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32), 0)
    store_tile(c_ptr, first_full, stride_cm, start, inner, tile_n * BLOCK_N, N, acc.to(c_ptr.dtype.element_ty))


@gluon.jit
def _exact_tile(a_bufs, b_bufs, ready, empty, pos, k_tiles, ROW0: gl.constexpr, mma_layout: gl.constexpr):
    """Exact accumulation (use_fast_accum=False) of warpgroup rows ROW0..ROW0 + 64 of one tile:
    each K block's product into a fresh partial, waited for, then added into the fp32
    accumulator (as cuBLAS's exact _scaled_mm promotes). Adding a partial while another wgmma
    is in flight makes ptxas serialize every wgmma (C7514); here the other warpgroup's wgmmas
    fill the gap. Both warpgroups release each stage (empty counts 2)."""
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    acc = gl.zeros([BLOCK_M // 2, BLOCK_N], gl.float32, mma_layout)
    for kb in range(k_tiles):
        s = pos % NUM_STAGES
        mbarrier.wait(ready.index(s), (pos // NUM_STAGES) & 1)
        part = warpgroup_mma(
            a_bufs.index(s).slice(ROW0, BLOCK_M // 2, dim=0), b_bufs.index(s).permute((1, 0)),
            gl.zeros([BLOCK_M // 2, BLOCK_N], gl.float32, mma_layout), use_acc=False, is_async=True,
        )  # fmt: skip
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        mbarrier.arrive(empty.index(s))
        acc = acc + part
        pos += 1
    return acc


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, turns, c_ptrs, strides_cm, bias_ptrs, a_scale_ptr, a_local_scale_ptr,
              b_scale_ptrs, outer, inner, Ns, K, rank, world_size, WG: gl.constexpr, A_SCALE: gl.constexpr,
              B_ROWWISE_MASK: gl.constexpr, BIAS_MASK: gl.constexpr, GROUP_M: gl.constexpr,
              EXACT: gl.constexpr):  # fmt: skip
    """Warpgroup WG (4 warps): its alternate tiles, main loop of async wgmma over K, then the
    epilogue (_epilogue). EXACT (exact accumulation): cooperative instead, both warpgroups on
    every tile of the program, WG's 64 rows each (_exact_tile)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // a_bufs.dtype.primitive_bitwidth]
    )
    tiles_m = outer * gl.cdiv(inner, BLOCK_M)
    tiles_per_chunk = _chunk_tiles(tiles_m, Ns)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nprog = gl.num_programs(0)
    if EXACT:
        row0: gl.constexpr = WG * (BLOCK_M // 2)
        pos = 0
        for tile in range(gl.program_id(0), tiles_per_chunk * world_size, nprog):
            chunk, b, tile_n, first_own, first_full, start = _tile(
                tile, tiles_m, Ns, tiles_per_chunk, rank, world_size, inner, GROUP_M
            )
            acc = _exact_tile(a_bufs, b_bufs, ready, empty, pos, k_tiles, row0, mma_layout)
            pos += k_tiles
            _epilogue(acc, b, chunk, tile_n, first_own + row0, first_full + row0, start + row0, rank, inner, c_ptrs,
                      strides_cm, bias_ptrs, a_scale_ptr, a_local_scale_ptr, b_scale_ptrs, Ns, A_SCALE,
                      B_ROWWISE_MASK, BIAS_MASK)  # fmt: skip
    else:
        j = WG  # the program's local tile number: its K blocks start at ring position j * k_tiles
        turn = 0
        for tile in range(gl.program_id(0) + WG * nprog, tiles_per_chunk * world_size, 2 * nprog):
            chunk, b, tile_n, first_own, first_full, start = _tile(
                tile, tiles_m, Ns, tiles_per_chunk, rank, world_size, inner, GROUP_M
            )
            acc = mma_tile(a_bufs, b_bufs, ready, empty, turns, j * k_tiles, turn, k_tiles, WG, mma_layout)
            turn += 1
            j += 2
            _epilogue(acc, b, chunk, tile_n, first_own, first_full, start, rank, inner, c_ptrs, strides_cm,
                      bias_ptrs, a_scale_ptr, a_local_scale_ptr, b_scale_ptrs, Ns, A_SCALE, B_ROWWISE_MASK,
                      BIAS_MASK)  # fmt: skip


@gluon.jit
def allocate_ring(a_desc, b_desc, NUM_STAGES: gl.constexpr, RELEASES: gl.constexpr):
    """The kernels' shared memory: NUM_STAGES stages of A and B blocks, their ready and empty
    mbarriers (empty completing after RELEASES arrivals), the warpgroups' turn pair; the inits
    fenced so the async proxy (TMA) sees them before the partitions start."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=RELEASES)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()
    return a_bufs, b_bufs, ready, empty, turns


@gluon.jit(do_not_specialize=TOKEN_COUNTS)
def all_gather_matmul_pingpong_kernel(
    a_desc, a_local_desc, b_desc0, b_desc1, b_desc2, b_desc3, c_ptrs, strides_cm, bias_ptrs, a_scale_ptr,
    a_local_scale_ptr, b_scale_ptrs, flags_ptr, epoch_ptr, timeouts_ptr, outer, inner, Ns, K, rank, world_size,
    A_SCALE: gl.constexpr, B_ROWWISE_MASK: gl.constexpr, BIAS_MASK: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, SPIN_LIMIT: gl.constexpr, EXACT: gl.constexpr = False,
):  # fmt: skip
    """outs[i][rows of A, Ns[i]] = (gathered A * its scale) @ (B i * its scale) (+ bias i); a_desc,
    a_local_desc: [BLOCK_M, BLOCK_K] blocks of the gathered rows and of the own chunk's; b_desc
    i: [BLOCK_N, BLOCK_K] blocks of B i as [N, K] rows (b_desc0 stands in for those past
    len(Ns)); c_ptrs, strides_cm, bias_ptrs, b_scale_ptrs, Ns: tuples, one entry per B. EXACT:
    exact accumulation, the consumers cooperative (_consumer). 4 warps (the first consumer), + 4
    + 1."""
    # cooperative (EXACT): both warpgroups release each stage
    a_bufs, b_bufs, ready, empty, turns = allocate_ring(a_desc, b_desc0, NUM_STAGES, 2 if EXACT else 1)
    # (argument tuples written out in the call: a tuple assigned to a name first turns its
    # constexprs into tensors in Gluon 3.6; the warpgroup's number as a constexpr of its own)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, turns, c_ptrs, strides_cm, bias_ptrs, a_scale_ptr,
                     a_local_scale_ptr, b_scale_ptrs, outer, inner, Ns, K, rank, world_size, gl.constexpr(0),
                     A_SCALE, B_ROWWISE_MASK, BIAS_MASK, GROUP_M, EXACT)),
        (_consumer, (a_bufs, b_bufs, ready, empty, turns, c_ptrs, strides_cm, bias_ptrs, a_scale_ptr,
                     a_local_scale_ptr, b_scale_ptrs, outer, inner, Ns, K, rank, world_size, gl.constexpr(1),
                     A_SCALE, B_ROWWISE_MASK, BIAS_MASK, GROUP_M, EXACT)),
        (_loader, (a_desc, a_desc, a_desc, a_desc, a_local_desc, b_desc0, b_desc1, b_desc2, b_desc3, a_bufs, b_bufs,
                   ready, empty, flags_ptr, epoch_ptr, timeouts_ptr, outer, inner, Ns, (K,), rank, world_size,
                   GROUP_M, SPIN_LIMIT)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


_KERNEL = DirectKernel(all_gather_matmul_pingpong_kernel)


def usable(device: torch.device) -> bool:
    """Hopper (sm_90): wgmma and setmaxnreg as this kernel uses them."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def fits_float8(a: torch.Tensor, mat2s) -> bool:
    """Whether the pingpong kernels take these operands: float8 A and weights ([N, K]
    transposed), aligned for TMA."""
    return (
        a.dtype in FLOAT8
        and tma_operand(a)
        and all(m.dtype in FLOAT8 and m.stride(0) == 1 and tma_operand(m.t()) for m in mat2s)
    )


def fits(a_gathered: torch.Tensor, a_local: torch.Tensor, mat2s, outs) -> bool:
    """Whether this kernel takes the call: fits_float8, the own rows aligned too, outputs with
    unit column stride. Fast or exact accumulation alike."""
    return fits_float8(a_gathered, mat2s) and tma_operand(a_local) and all(o.stride(-1) == 1 for o in outs)


@compiles_other_configs(CONFIGS)
def all_gather_matmul_pingpong(
    a_gathered, mat2s, biases, outs, flags, epoch, *, rank, world_size, inner, scales, config, timeouts,
    spin_limit=1 << 30, a_local=None, num_programs=None,
):  # fmt: skip
    """all_gather_matmul.all_gather_matmul_consumer's float8 path on this kernel, same arguments
    (``scales``: its Scales; ``config``: a PingpongConfig); one launch per MAX_B mat2s. Exact
    accumulation (not scales.fast_accum) runs the cooperative form (_exact_tile)."""
    if a_local is None:
        a_local = own_rows(a_gathered, rank, world_size, inner)
    if not fits(a_gathered, a_local, mat2s, outs):
        raise ValueError("the pingpong consumer takes aligned float8 operands and [N, K] weights")
    rows, k = a_gathered.shape
    outer = rows // (world_size * inner)
    programs = num_programs or sm_count(a_gathered.device)
    a_layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], _gl_float8(a_gathered.dtype))
    a_desc = TensorDescriptor.from_tensor(a_gathered, [TILE, TILE], a_layout)
    a_local_desc = TensorDescriptor.from_tensor(a_local, [TILE, TILE], a_layout)
    a_local_scale = scales.a_local
    if a_local_scale is None:  # the own chunk's row scales where its rows are, or the one value
        a_local_scale = scales.a if scales.a.numel() == 1 else own_rows(scales.a.view(-1, 1), rank, world_size, inner)
        a_local_scale = a_local_scale.reshape(-1).contiguous()
    calls = list(zip(mat2s, biases, outs, scales.b))
    for first in range(0, len(calls), MAX_B):
        group = calls[first : first + MAX_B]
        b_descs = [_weight_descriptor(mat2) for mat2, _, _, _ in group]
        b_descs += b_descs[:1] * (MAX_B - len(group))
        ns = tuple(mat2.shape[1] for mat2, _, _, _ in group)
        tiles = world_size * outer * triton.cdiv(inner, TILE) * sum(triton.cdiv(n, TILE) for n in ns)
        _KERNEL[(min(programs, tiles),)](
            a_desc, a_local_desc, *b_descs, tuple(out for _, _, out, _ in group),
            tuple(out.stride(0) for _, _, out, _ in group),
            tuple(out if bias is None else bias for _, bias, out, _ in group), scales.a, a_local_scale,
            tuple(b_scale for _, _, _, b_scale in group), flags, epoch, timeouts, outer, inner, ns, k, rank,
            world_size, A_SCALE=1 if scales.a.numel() == 1 else 2,
            B_ROWWISE_MASK=sum(1 << i for i, (_, _, _, b_scale) in enumerate(group) if b_scale.numel() > 1),
            BIAS_MASK=sum(1 << i for i, (_, bias, _, _) in enumerate(group) if bias is not None),
            NUM_STAGES=config.stages, GROUP_M=config.group_m, SPIN_LIMIT=spin_limit, EXACT=not scales.fast_accum,
            num_warps=4, maxnreg=MAXNREG,
        )  # fmt: skip
    return outs


def _gl_float8(dtype: torch.dtype):
    return gl.float8e4nv if dtype == torch.float8_e4m3fn else gl.float8e5


def _weight_descriptor(mat2: torch.Tensor) -> TensorDescriptor:
    """[TILE, TILE] blocks of a [K, N] mat2 read as its [N, K] rows."""
    layout = gl.NVMMASharedLayout.get_default_for([TILE, TILE], _gl_float8(mat2.dtype))
    return TensorDescriptor.from_tensor(mat2.t(), [TILE, TILE], layout)
