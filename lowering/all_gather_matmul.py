"""overlap::all_gather_matmul on CUDA: the variants that choose.py picks from.

- fused: every rank pushes its shard into each peer's symmetric workspace with the copy engine
  (side stream, rank-rotated, each chunk followed by its flag), while the persistent Triton GEMM
  of templates/all_gather_matmul.py starts on the local shard in place and takes the peers'
  chunks as their flags arrive.
- copy_engine_cublas: the same pushes and flags; the caller's stream runs one cuBLAS matmul per
  chunk, each behind a one-program kernel that waits for that chunk's flag.
- nccl_cublas: NCCL all-gather, then cuBLAS. The baseline, and the fallback.

All take the op's arguments and return what the op returns: (gathered or None, outputs); the
symmetric-memory ones write into ``outputs=allocate(...)`` when given (replay.py). The
contractions over the gathered rows (weight gradients, ops.py) run per chunk as it arrives in
copy_engine_cublas, accumulating in the output (cuBLAS beta = 1: one rounding per chunk); the fused
variant runs them after its kernel, as one matmul each over the workspace when the chunks stack
whole (else per chunk), nccl_cublas as one matmul each.
"""

import functools

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from overlap_pass import config, ops, schedule
from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import signals

from . import symm

KIND = "all_gather_matmul"


def allocate(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(),
):  # fmt: skip
    """The op's outputs for these arguments, empty, in its (contiguous) layout: the gathered
    tensor if asked for (else None), and one output per mat2, then one per contraction. Made
    apart from the call so that a call replayed from a CUDA graph (replay.py) writes new ones."""
    gathered_shape = ops._gathered_shape(shard, gather_dim, world_size)
    k = shard.shape[-1]
    outs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]]) for m in mat2s]
    outs += [
        shard.new_empty((k, other.shape[-1]) if left else (other.shape[-1], k))
        for other, left in zip(contract_with, gathered_left)
    ]
    return (shard.new_empty(gathered_shape) if return_gathered else None), outs


def _prepare(shard, gather_dim, world_size):
    """The shard (contiguous) and as [rows, K], the inner size of the output row remap, and the
    gathered shape."""
    shard = shard.contiguous()
    inner = 1
    for size in shard.shape[gather_dim:-1]:
        inner *= size
    return shard, shard.view(-1, shard.shape[-1]), inner, ops._gathered_shape(shard, gather_dim, world_size)


def _stacks_whole_chunks(shape, gather_dim: int) -> bool:
    """Whether the gather along ``gather_dim`` puts each rank's chunk in one contiguous block of
    rows (no dim before it is longer than 1), so chunk outputs can be written in place."""
    return all(size == 1 for size in shape[:gather_dim])


def _push_chunks(ws: symm.Workspace, flat: torch.Tensor, stacked_shape) -> None:
    """Side stream: copy this rank's shard into every peer's data, rank-rotated (at step s to
    rank - s, so each rank receives rank + 1, rank + 2, ... in the order its consumer takes
    them), each copy followed by that peer's flag."""
    rows = flat.shape[0]
    for step in range(1, ws.world_size):
        peer, _ = schedule.all_gather_peers(ws.rank, ws.world_size, step)
        ws.peer_rows(peer, stacked_shape, flat.dtype, ws.rank * rows, (ws.rank + 1) * rows).copy_(flat)
        ws.signal_peer(peer)


def _start(shard, gather_dim, world_size, group_name, own_too=False):
    """Steps 1 and 2 of the protocol (symm.py): barrier on the caller's stream, then the pushes
    on the side stream; with ``own_too``, then the own shard into its slot of the own data too,
    marked by ``ws.chunk_ready[rank]``. Returns the workspace, the stacked view of its data, and
    _prepare's."""
    shard, flat, inner, gathered_shape = _prepare(shard, gather_dim, world_size)
    ws = symm.workspace(KIND, group_name, shard.device)
    stacked_shape = (world_size * flat.shape[0], flat.shape[1])
    ws.enter(stacked_shape[0] * stacked_shape[1] * flat.element_size(), config.spin_limit)
    ws.fork()
    with ws.on_side_stream():
        _push_chunks(ws, flat, stacked_shape)
        if own_too:  # after the pushes: the peers wait for those
            rows = flat.shape[0]
            ws.peer_rows(ws.rank, stacked_shape, flat.dtype, ws.rank * rows, (ws.rank + 1) * rows).copy_(flat)
            ws.chunk_ready[ws.rank].record(ws.side_stream)
    return ws, ws.data(stacked_shape, flat.dtype), shard, flat, inner, gathered_shape


def _finish(ws, shard, stacked, flat, gather_dim, gathered):
    """Step 3's end: join the side stream; the gathered tensor, if asked for, is copied out of
    the workspace (the next call overwrites it) into ``gathered``."""
    ws.leave()
    if gathered is None:
        return
    world, rows = ws.world_size, flat.shape[0]
    chunks = [
        (flat if j == ws.rank else stacked[j * rows : (j + 1) * rows]).view(shard.shape)
        for j in range(world)
    ]
    torch.cat(chunks, dim=gather_dim, out=gathered)


def fused(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), *, gemm_config=None, outputs=None,
):  # fmt: skip
    gathered, outs = outputs or allocate(
        shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered, contract_with, gathered_left
    )
    # contractions over whole stacked chunks run as one matmul each over the workspace, which
    # then needs the own chunk too (copied on the side stream while the kernel runs)
    whole = bool(contract_with) and _stacks_whole_chunks(shard.shape, gather_dim)
    ws, stacked, shard, flat, inner, gathered_shape = _start(shard, gather_dim, world_size, group_name, whole)
    try:
        consumer.all_gather_matmul_consumer(
            stacked, list(mat2s), [None if b is None else b.contiguous() for b in biases],
            [o.view(-1, o.shape[-1]) for o in outs[: len(mat2s)]], ws.flags, ws.epoch,
            rank=ws.rank, world_size=world_size, inner=inner, a_local=flat,
            config=gemm_config or consumer.CONFIGS[0], num_programs=None,
            spin_limit=config.spin_limit, timeouts=ws.chunk_timeouts,
        )  # fmt: skip
        # the kernel waited for every chunk: the contractions run on whole data, no waits
        if whole:
            ws.main.wait_event(ws.chunk_ready[ws.rank])
            for out, other, left in zip(outs[len(mat2s) :], contract_with, gathered_left):
                # stacked rows are gathered rows
                _contract(stacked, other.reshape(stacked.shape[0], -1), left, out, accumulate=False)
        for chunk in schedule.all_gather_order(ws.rank, world_size) if contract_with and not whole else ():
            a = _chunk_rows(ws, stacked, flat, chunk, wait=False)
            _contract_chunk(
                a, chunk, contract_with, gathered_left, outs[len(mat2s) :], gathered_shape, gather_dim, ws
            )
    finally:  # joined even when the launch fails: the next call must not overtake the pushes
        _finish(ws, shard, stacked, flat, gather_dim, gathered)
    return gathered, outs


def copy_engine_cublas(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(), *, outputs=None,
):  # fmt: skip
    gathered, outs = outputs or allocate(
        shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered, contract_with, gathered_left
    )
    ws, stacked, shard, flat, inner, gathered_shape = _start(shard, gather_dim, world_size, group_name)
    try:
        for chunk in schedule.all_gather_order(ws.rank, world_size):
            a = _chunk_rows(ws, stacked, flat, chunk, wait=True)
            _matmul_chunk(a, chunk, mat2s, biases, outs, gather_dim, world_size)
            _contract_chunk(
                a, chunk, contract_with, gathered_left, outs[len(mat2s) :], gathered_shape, gather_dim, ws
            )
    finally:  # joined even when a matmul fails: the next call must not overtake the pushes
        _finish(ws, shard, stacked, flat, gather_dim, gathered)
    return gathered, outs


def _chunk_rows(ws, stacked, flat, chunk, wait: bool) -> torch.Tensor:
    """Chunk ``chunk``'s rows, [rows, K]: the local shard in place, or the peer's chunk in the
    workspace, behind a one-program kernel that waits for its flag (on the caller's stream)."""
    if chunk == ws.rank:
        return flat
    if wait:
        signals.WAIT[(1,)](
            ws.flags, ws.epoch, ws.chunk_timeouts, chunk, SPIN_LIMIT=config.spin_limit, num_warps=1
        )
    rows = flat.shape[0]
    return stacked[chunk * rows : (chunk + 1) * rows]


def _matmul_chunk(a, chunk, mat2s, biases, outs, gather_dim, world):
    """cuBLAS: chunk ``chunk``'s rows of each output."""
    rows = a.shape[0]
    in_place = bool(mat2s) and _stacks_whole_chunks(outs[0].shape, gather_dim)  # alike for every output
    for out, mat2, bias in zip(outs, mat2s, biases):
        target = schedule.chunk(out, gather_dim, chunk, world)
        if in_place:
            target = target.view(rows, -1)  # contiguous rows: cuBLAS writes in place
            if bias is None:
                torch.mm(a, mat2, out=target)
            else:
                torch.addmm(bias, a, mat2, out=target)
        else:
            target.copy_((a @ mat2 if bias is None else torch.addmm(bias, a, mat2)).view(target.shape))


def _contract_chunk(a, chunk, contract_with, gathered_left, outs, gathered_shape, gather_dim, ws):
    """cuBLAS: chunk ``chunk``'s term of each contraction over the gathered rows, accumulated
    into its output. The first chunk taken (the local one) writes, the others add."""
    first = chunk == ws.rank
    for out, other, left in zip(outs, contract_with, gathered_left):
        theirs = schedule.chunk(ops._as_gathered(other, gathered_shape), gather_dim, chunk, ws.world_size)
        theirs = theirs.reshape(a.shape[0], -1)  # a view unless dims before gather_dim exceed 1
        _contract(a, theirs, left, out, accumulate=not first)


def _contract(rows, theirs, left, out, accumulate: bool) -> None:
    """out (+)= rows^T @ theirs if ``left`` else theirs^T @ rows: a contraction over the rows
    both hold, with cuBLAS."""
    x, y = (rows.t(), theirs) if left else (theirs.t(), rows)
    if accumulate:
        out.addmm_(x, y)
    else:
        torch.mm(x, y, out=out)


def nccl_cublas(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=(), gathered_left=(),
):  # fmt: skip
    group = _resolve_process_group(group_name)
    shard = shard.contiguous()
    stacked = shard.new_empty((world_size,) + tuple(shard.shape))
    dist.all_gather_into_tensor(stacked, shard, group=group)
    if _stacks_whole_chunks(shard.shape, gather_dim):
        gathered = stacked.view(ops._gathered_shape(shard, gather_dim, world_size))
    else:
        gathered = torch.cat(stacked.unbind(0), dim=gather_dim)
    flat = gathered.view(-1, shard.shape[-1])
    outs = []
    for mat2, bias in zip(mat2s, biases):
        out = torch.mm(flat, mat2) if bias is None else torch.addmm(bias, flat, mat2)
        outs.append(out.view(list(gathered.shape[:-1]) + [mat2.shape[1]]))
    for other, left in zip(contract_with, gathered_left):
        outs.append(flat.t() @ other if left else other.t() @ flat)
    return (gathered if return_gathered else None), outs


def variants(num_mat2s: int = 1) -> dict:
    """Name -> implementation, every variant choose.py may pick for a call with ``num_mat2s``
    row matmuls (the fused kernel needs one)."""
    table = {}
    if num_mat2s:
        table = {f"fused:{cfg}": functools.partial(fused, gemm_config=cfg) for cfg in consumer.CONFIGS}
    table["copy_engine_cublas"] = copy_engine_cublas
    table["nccl_cublas"] = nccl_cublas
    return table
