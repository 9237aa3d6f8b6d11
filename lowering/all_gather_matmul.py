"""overlap::all_gather_matmul on CUDA: the variants that choose.py picks from.

- fused: every rank pushes its shard into each peer's symmetric workspace with the copy engine
  (side stream, rank-rotated, each chunk followed by its flag), while the persistent Triton GEMM
  of templates/all_gather_matmul.py starts on the local shard in place and takes the peers'
  chunks as their flags arrive.
- copy_engine_cublas: the same pushes and flags; the caller's stream runs one cuBLAS matmul per
  chunk, each behind a one-program kernel that waits for that chunk's flag.
- nccl_cublas: NCCL all-gather, then cuBLAS. The baseline, and the fallback.

The workspace holds the gathered rows in their own order (row_layout.py): a shard of a [batch, seq,
dim] tensor gathered along seq lands as ``batch`` runs of rows, one copy each, so every output
is written in place, row for row, and the gathered tensor is the workspace itself.

All take the op's arguments and return what the op returns: (gathered or None, outputs); the
symmetric-memory ones write into ``outputs=allocate(...)`` when given (replay.py). The
contractions over the gathered rows (weight gradients, matmul_ops.py) run per chunk as it arrives in
copy_engine_cublas where a chunk is one run of rows, accumulating in the output (cuBLAS beta =
1: one rounding per chunk); otherwise, and in the fused variant, once after the last chunk,
over the whole workspace; nccl_cublas runs them as one matmul each.
"""

import dataclasses
import functools
import math

import torch

from overlap_pass import config

from overlap_pass.ops import matmul_ops, schedule
from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm, signals

from . import collectives, symm
from .row_layout import RowLayout, matmul_into

KIND = "all_gather_matmul"


def allocate(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), passengers=(),
):  # fmt: skip
    """The op's outputs for these arguments, empty, in its (contiguous) layout: the gathered
    tensor if asked for (else None), and one output per mat2, then one per contraction, then
    each passenger's gathered tensor. Made apart from the call so that a call replayed from a
    CUDA graph (replay.py) writes new ones."""
    gathered_shape = matmul_ops._gathered_shape(shard, gather_dim, world_size)
    k = shard.shape[-1]
    outs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]]) for m in mat2s]
    outs += [
        shard.new_empty((k, other.shape[-1]) if left else (other.shape[-1], k))
        for other, left in zip(contract_with, gathered_left)
    ]
    outs += matmul_ops.gathered_passengers(passengers, gather_dim, world_size)
    return (shard.new_empty(gathered_shape) if return_gathered else None), outs


@dataclasses.dataclass(frozen=True)
class Region:
    """Where one gathered tensor lives in the workspace data: its [M, X] rows from byte
    ``offset`` on. An all-gather moves one tensor, or several with the same rows (float8 data
    and its rowwise scales, lowering/scaled.py), each chunk's parts under one flag."""

    shape: tuple[int, int]
    dtype: torch.dtype
    offset: int


def regions(parts, layout) -> tuple[list[Region], int]:
    """The regions of ``parts`` (each a shard as its [rows, X] rows) one after the other, each
    128-byte aligned, and the bytes they take."""
    placed, offset = [], 0
    for flat in parts:
        shape = (layout.world * layout.chunk_rows, flat.shape[1])
        placed.append(Region(shape, flat.dtype, offset))
        offset += -(-shape[0] * shape[1] * flat.element_size() // 128) * 128
    return placed, offset


def _copy_chunk(ws: symm.Workspace, peer: int, flat: torch.Tensor, layout, region: Region) -> None:
    """This rank's shard into its rows of ``peer``'s workspace: one copy-engine copy per block."""
    for block in range(layout.outer):
        start, stop = layout.block_span(ws.rank, block)
        own = flat if layout.outer == 1 else flat[block * layout.inner : (block + 1) * layout.inner]
        ws.peer_rows(peer, region.shape, region.dtype, start, stop, region.offset).copy_(own)


def _push_chunks(ws: symm.Workspace, parts, layout, placed, late: bool = False) -> None:
    """Side stream: copy this rank's shard (every part) into every peer's data, rank-rotated
    (at step s to rank - s, so each rank receives rank + 1, rank + 2, ... in the order its
    consumer takes them), each chunk followed by that peer's flag (or late flag)."""
    for step in range(1, ws.world_size):
        peer, _ = schedule.all_gather_peers(ws.rank, ws.world_size, step)
        for flat, region in zip(parts, placed):
            _copy_chunk(ws, peer, flat, layout, region)
        ws.signal_peer(peer, late)


def shard_rows(shard: torch.Tensor) -> torch.Tensor:
    """A shard as its [rows, X] rows (a copy only where it is not contiguous)."""
    return shard.contiguous().view(-1, shard.shape[-1])


def start(parts, layout, group_name, own_too=False, passengers=()):
    """Steps 1 and 2 of the protocol (symm.py): barrier on the caller's stream, then the pushes
    of ``parts`` (shards as their rows, shard_rows) on the side stream; with ``own_too``, then
    the own shard into its rows of the own data too, marked by ``ws.chunk_ready[rank]``, so that
    the data is the whole gathered tensor. ``passengers`` (more shards with the same rows, which
    no matmul reads) are pushed after every chunk, under the late flags, so they never hold up a
    chunk the consumer waits for (collect_passengers takes them out). Returns the workspace and
    each part's, then each passenger's, gathered rows in its data."""
    placed, data_bytes = regions(list(parts) + list(passengers), layout)
    ws = symm.workspace(KIND, group_name, parts[0].device)
    ws.enter(data_bytes, config.spin_limit)
    ws.fork()
    with ws.on_side_stream():
        _push_chunks(ws, parts, layout, placed)
        if passengers:
            _push_chunks(ws, passengers, layout, placed[len(parts) :], late=True)
        if own_too:  # after the pushes: the peers wait for those
            for flat, region in zip(parts, placed):
                _copy_chunk(ws, ws.rank, flat, layout, region)
            ws.chunk_ready[ws.rank].record(ws.side_stream)
    return ws, [ws.data(r.shape, r.dtype, r.offset) for r in placed]


def collect_passengers(ws, flats, datas, outs, layout) -> None:
    """After the consumer, on the caller's stream: each passenger's gathered tensor, its own
    chunk from the shard, every peer's from the data once that peer's late flag is set (a wait
    that gives up is reported as one for that peer's chunk)."""
    rows = [out.view(-1, out.shape[-1]) for out in outs]
    for flat, out in zip(flats, rows):
        layout.chunk(out, ws.rank).copy_(layout.own(flat))
    for chunk in schedule.all_gather_order(ws.rank, ws.world_size)[1:]:
        signals.WAIT[(1,)](
            ws.late_flags, ws.epoch, ws.chunk_timeouts, chunk, SPIN_LIMIT=config.spin_limit, num_warps=1
        )
        for data, out in zip(datas, rows):
            layout.chunk(out, chunk).copy_(layout.chunk(data, chunk))


def finish(ws, data, gathered):
    """Step 3's end: join the side stream; the gathered tensor, if asked for, is copied out of
    the workspace (the next call overwrites it; the own chunk is there, start's own_too)."""
    ws.leave()
    if gathered is not None:
        gathered.view(data.shape).copy_(data)


def _whole_contractions(ws, data, contract_with, gathered_left, outs) -> None:
    """Every contraction as one matmul over the whole gathered rows, once the own chunk is in
    the data too (the peers' are: their waits came first on this stream)."""
    ws.main.wait_event(ws.chunk_ready[ws.rank])
    for out, other, left in zip(outs, contract_with, gathered_left):
        _contract(data, other, left, out, accumulate=False)


def _passengers_of(outs, mat2s, contract_with, passengers):
    """(the passengers as their rows, their gathered outputs: the last entries of ``outs``)."""
    return [shard_rows(p) for p in passengers], outs[len(mat2s) + len(contract_with) :]


def fused(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), passengers=(), *, gemm_config=None, outputs=None,
):  # fmt: skip
    gathered, outs = outputs or allocate(
        shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered, contract_with, gathered_left,
        passengers,
    )  # fmt: skip
    layout = RowLayout.of(shard.shape, gather_dim, world_size)
    # the contractions run after the kernel over the whole data, own chunk included
    own_too = bool(contract_with) or return_gathered
    flat = shard_rows(shard)
    riders, rider_outs = _passengers_of(outs, mat2s, contract_with, passengers)
    ws, (data, *rider_data) = start([flat], layout, group_name, own_too, passengers=riders)
    try:
        consumer.all_gather_matmul_consumer(
            data, list(mat2s), [None if b is None else b.contiguous() for b in biases],
            [o.view(-1, o.shape[-1]) for o in outs[: len(mat2s)]], ws.flags, ws.epoch,
            rank=ws.rank, world_size=world_size, inner=layout.inner, a_local=flat,
            config=gemm_config or gemm.CONFIGS[0], num_programs=None,
            spin_limit=config.spin_limit, timeouts=ws.chunk_timeouts,
        )  # fmt: skip
        if contract_with:  # the kernel waited for every chunk: no waits
            contracted = outs[len(mat2s) : len(mat2s) + len(contract_with)]
            _whole_contractions(ws, data, contract_with, gathered_left, contracted)
        if riders:
            collect_passengers(ws, riders, rider_data, rider_outs, layout)
    finally:  # joined even when the launch fails: the next call must not overtake the pushes
        finish(ws, data, gathered)
    return gathered, outs


def copy_engine_cublas(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), passengers=(), *, outputs=None,
):  # fmt: skip
    gathered, outs = outputs or allocate(
        shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered, contract_with, gathered_left,
        passengers,
    )  # fmt: skip
    layout = RowLayout.of(shard.shape, gather_dim, world_size)
    # a chunk of several runs of rows cannot be contracted in one matmul: contract at the end
    per_chunk = layout.outer == 1
    own_too = (bool(contract_with) and not per_chunk) or return_gathered
    flat = shard_rows(shard)
    riders, rider_outs = _passengers_of(outs, mat2s, contract_with, passengers)
    ws, (data, *rider_data) = start([flat], layout, group_name, own_too, passengers=riders)
    row_outs = [o.view(-1, o.shape[-1]) for o in outs[: len(mat2s)]]
    contracted = outs[len(mat2s) : len(mat2s) + len(contract_with)]
    try:
        for chunk in schedule.all_gather_order(ws.rank, world_size):
            a = chunk_rows(ws, data, flat, layout, chunk)
            for out, mat2, bias in zip(row_outs, mat2s, biases):
                matmul_into(a, mat2, bias, layout.chunk(out, chunk))
            if per_chunk:
                first = chunk == ws.rank  # the first chunk taken writes, the others add
                for out, other, left in zip(contracted, contract_with, gathered_left):
                    _contract(a, layout.chunk(other, chunk), left, out, accumulate=not first)
        if contract_with and not per_chunk:
            _whole_contractions(ws, data, contract_with, gathered_left, contracted)
        if riders:
            collect_passengers(ws, riders, rider_data, rider_outs, layout)
    finally:  # joined even when a matmul fails: the next call must not overtake the pushes
        finish(ws, data, gathered)
    return gathered, outs


def chunk_rows(ws, data, flat, layout, chunk) -> torch.Tensor:
    """Chunk ``chunk``'s rows (row_layout.py's view): the local shard in place, or the peer's chunk
    in the workspace, behind a one-program kernel that waits for its flag (on the caller's
    stream)."""
    if chunk == ws.rank:
        return layout.own(flat)
    signals.WAIT[(1,)](
        ws.flags, ws.epoch, ws.chunk_timeouts, chunk, SPIN_LIMIT=config.spin_limit, num_warps=1
    )
    return layout.chunk(data, chunk)


def _contract(gathered, theirs, left, out, accumulate: bool) -> None:
    """out (+)= gathered^T @ theirs if ``left`` else theirs^T @ gathered: a contraction over
    the rows both hold, with cuBLAS."""
    x, y = (gathered.t(), theirs) if left else (theirs.t(), gathered)
    if accumulate:
        out.addmm_(x, y)
    else:
        torch.mm(x, y, out=out)


def nccl_cublas(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), passengers=(),
):  # fmt: skip
    gathered = nccl_gather(shard, gather_dim, world_size, group_name)
    flat = gathered.view(-1, shard.shape[-1])
    outs = []
    for mat2, bias in zip(mat2s, biases):
        out = torch.mm(flat, mat2) if bias is None else torch.addmm(bias, flat, mat2)
        outs.append(out.view(list(gathered.shape[:-1]) + [mat2.shape[1]]))
    for other, left in zip(contract_with, gathered_left):
        outs.append(flat.t() @ other if left else other.t() @ flat)
    outs += [nccl_gather(p, gather_dim, world_size, group_name) for p in passengers]
    return (gathered if return_gathered else None), outs


def nccl_gather(shard: torch.Tensor, gather_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """NCCL all-gather along ``gather_dim``; 1-byte dtypes (float8) move as uint8."""
    shard = shard.contiguous()
    raw = shard.view(torch.uint8) if shard.element_size() == 1 else shard
    # ranks one after another along dim 0 (the form every backend takes), then stacked
    joined = collectives.all_gather(raw, world_size, group_name)
    stacked = joined.view(shard.dtype).view((world_size,) + tuple(shard.shape))
    if math.prod(shard.shape[:gather_dim]) == 1:  # ranks stacked: in order (RowLayout's outer)
        return stacked.view(matmul_ops._gathered_shape(shard, gather_dim, world_size))
    return torch.cat(stacked.unbind(0), dim=gather_dim)


def variants(num_mat2s: int = 1) -> dict:
    """Name -> implementation, every variant choose.py may pick for a call with ``num_mat2s``
    row matmuls (the fused kernel needs one)."""
    table = {}
    if num_mat2s:
        table = {f"fused:{cfg}": functools.partial(fused, gemm_config=cfg) for cfg in gemm.CONFIGS}
    table["copy_engine_cublas"] = copy_engine_cublas
    table["nccl_cublas"] = nccl_cublas
    return table
