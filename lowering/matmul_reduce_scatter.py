"""overlap::matmul_reduce_scatter on CUDA: the variants that choose.py picks from.

Every rank computes the partial of each chunk (the rows its owner keeps) in the order of
schedule.reduce_scatter_order, the chunk of rank + 1 first and its own last, and moves each
partial into its owner's symmetric workspace as soon as it exists, so the transfers hide behind
the remaining matmuls. The owner then sums the W partials of its chunk in fp32, in a fixed order
(deterministic): the fused Triton producer in the epilogue of its own chunk's tiles, computed
last, while the last partial to arrive (rank + 1's) is still travelling; the other variants in a
kernel after their matmuls (templates/matmul_reduce_scatter.reduce_partials).

Variants differ in how a partial reaches its owner:
- fused: the persistent Triton producer GEMM stores each tile straight into the owner's
  workspace over NVLink and publishes each chunk from its last tile (no copy, no host steps).
- copy_engine_cublas: a cuBLAS matmul per chunk into a local staging slot, then the copy engine
  pushes it to the owner on a side stream (no SMs), followed by its flag.
- cublas_push: a cuBLAS matmul per chunk whose output is the owner's slot itself (a peer
  mapping); its flag follows on the same stream.
- nccl_cublas: cuBLAS over all rows, then NCCL's reduce-scatter. The baseline, and the fallback.

A sum of matmuls (an input gradient of Q, K and V, or of gate and up) runs one cuBLAS call per
input and chunk, each after the first a read-modify-write of the partial; for small K (K and V's
256 columns at W=4) those cost more than their arithmetic. ``copy_engine_cublas:joined`` joins
the operands once instead (inputs along K, mat2s along their rows): one matmul per chunk over the
summed K, for the price of copying the operands; ``fused:joined:<config>`` runs the fused
producer over that one matmul.

Chunks follow row_layout.py's row layout: a [batch, seq, dim] input scattered along seq is read in
place (strided views, a batched matmul per chunk, or the producer's row remap), and a partial
holds its chunk's rows in the output's own order, so the owner's sum writes the output as it
is, contiguous, and calls replay from per-call graphs at any batch.

Tail matmuls (the op's ``.tail`` overload, regions/tail_matmuls.py): the weight gradients of the
op's linears, queued after the partials and before the owner's sum, so that they run while the
last partials travel; the sum, which waits for those, then finds them there. Every
variant takes them (``tail``: (a, mat2, out) triples): NCCL's reduce-scatter runs asynchronously
under them; the fused producer leaves its sum to the kernel after them.

Partials travel in the inputs' dtype; ``out_dtype`` (fp32 for autocast's input gradients) is
only the dtype the owner's fp32 sum is written in. Workspace data: [recv: W x rows x N |
staging: W x rows x N], recv slot p holding rank p's partial of this rank's chunk. All take the
op's arguments and return its output; the symmetric-memory ones write into
``outputs=allocate(...)`` when given (replay.py).
"""

import functools
import math

import torch

from overlap_pass import config

from overlap_pass.ops import matmul_ops, schedule
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer

from . import collectives, gluon_kernels, symm
from .row_layout import RowLayout, matmul_into

KIND = "matmul_reduce_scatter"
TAIL_KIND = "matmul_reduce_scatter_tail"


def _input_rows(inputs, scatter_dim, world_size):
    """The inputs as their [M, K_i] rows (a copy only for an input that is not contiguous), and
    their row layout (row_layout.py)."""
    flats = [a.contiguous().view(-1, a.shape[-1]) for a in inputs]
    chunk_shape = matmul_ops._scattered_shape(list(inputs[0].shape), scatter_dim, world_size)
    return flats, RowLayout.of(chunk_shape, scatter_dim, world_size)


def allocate(inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None):
    """The op's output for these arguments, empty and contiguous, which every variant writes in
    place. Made apart from the call so that a call replayed from a CUDA graph (replay.py) writes
    a new one."""
    shape = _output_shape(inputs, mat2s, scatter_dim, world_size)
    return inputs[0].new_empty(shape, dtype=out_dtype or inputs[0].dtype)


def _output_shape(inputs, mat2s, scatter_dim, world_size) -> list:
    return matmul_ops._scattered_shape([*inputs[0].shape[:-1], mat2s[0].shape[1]], scatter_dim, world_size)


def _tail_outputs(operands) -> list[torch.Tensor]:
    return [a.new_empty(a.shape[0], b.shape[1]) for a, b in operands]


def allocate_tail(*args):
    """The ``.tail`` overload's outputs: the op's, and each tail matmul's [K_i, N_j]."""
    *op_args, tail_of, tail_with = args
    return allocate(*op_args), _tail_outputs(matmul_ops.tail_operands(op_args[0], tail_of, tail_with))


def run_tail(tail) -> None:
    for a, mat2, out in tail:
        torch.mm(a, mat2, out=out)


def _chunk_partial(flats, mat2s, bias, layout, chunk, out):
    """out = sum_i (chunk ``chunk`` of flats[i]) @ mat2s[i] + bias, with cuBLAS, in place;
    ``out``: the chunk's own rows, [outer * inner, N]."""
    target = layout.own(out)
    for i, (a, mat2) in enumerate(zip(flats, mat2s)):
        matmul_into(layout.chunk(a, chunk), mat2, bias if i == 0 else None, target, accumulate=i > 0)


class Call:
    """One call's workspace views: recv (this rank's slots), staging, and each owner's slot for
    this rank's partial ([rows, n] of ``dtype``, the partials' dtype). Made, it has entered
    the protocol (step 1)."""

    def __init__(self, layout, n, dtype, device, group_name):
        self.dtype, self.layout, self.n = dtype, layout, n
        self.rows = rows = layout.chunk_rows
        self.ws = ws = symm.workspace(KIND, group_name, device)
        self.world, self.rank = ws.world_size, ws.rank
        self.slots_shape = (self.world * rows, n)
        ws.enter(2 * self.world * rows * n * dtype.itemsize, config.spin_limit)
        self.recv = ws.data(self.slots_shape, self.dtype)
        self.out, self.scale = None, 1.0  # the owner's sum: where and how scaled (reduce_produced)

    def owner_slot(self, owner: int) -> torch.Tensor:
        """Rows of ``owner``'s recv that hold this rank's partial (a peer mapping)."""
        start = self.rank * self.rows
        return self.ws.peer_rows(owner, self.slots_shape, self.dtype, start, start + self.rows)

    def staging(self, chunk: int) -> torch.Tensor:
        start = (self.world + chunk) * self.rows
        return self.ws.peer_rows(self.rank, (2 * self.world * self.rows, self.n), self.dtype, start, start + self.rows)

    def own_reduction(self) -> producer.OwnReduction:
        """The owner's reduction as a producer kernel's epilogue takes it (into the call's
        output, set by reduce_produced)."""
        return producer.OwnReduction(self.out, self.ws.flags, self.ws.chunk_timeouts, self.scale, config.spin_limit)

    def reduce(self) -> None:
        producer.reduce_partials(
            self.recv, self.out, self.ws.flags, self.ws.epoch, self.ws.chunk_timeouts, rank=self.rank,
            world_size=self.world, scale=self.scale, spin_limit=config.spin_limit,
        )  # fmt: skip


def _overlapped(
    produce, inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None, outputs=None,
    tail=(),
):  # fmt: skip
    """What every symmetric-memory variant does around its own step, ``produce(call, flats,
    mat2s, bias)``, which gets every partial into its owner's slot and flags it: enter (barrier),
    produce, the tail matmuls, the owner's reduction (into ``outputs``, from allocate, if
    given), leave."""
    flats, layout = _input_rows(inputs, scatter_dim, world_size)
    call = Call(layout, mat2s[0].shape[1], flats[0].dtype, flats[0].device, group_name)
    if outputs is None:
        outputs = allocate(inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype)
    return reduce_produced(call, lambda: produce(call, flats, mat2s, bias), reduce_op, outputs, tail)


def reduce_produced(call: Call, produce, reduce_op: str, out: torch.Tensor, tail=()) -> torch.Tensor:
    """``produce()`` (every partial into its owner's slot, flagged), the tail matmuls, then the
    owner's reduction into ``out`` unless ``produce()`` returned True (its kernel summed the own
    chunk itself, Call.own_reduction), then leave (also when a launch fails). The reduction
    stays on the caller's stream, after the tail: on the side stream beside it (the copy
    engine's pushes are there) it would take SMs from the tail's GEMMs, which would then slow
    by more than it hides."""
    call.out, call.scale = out.view(call.rows, call.n), 1.0 / call.world if reduce_op == "avg" else 1.0
    try:
        reduced = produce()
        run_tail(tail)
        if not reduced:
            call.reduce()
    finally:  # joined even when a launch fails: the next call must not overtake the pushes
        call.ws.leave()
    return out


def produce_fused(
    call, flats, mat2s, bias, *, gemm_config, scales=None, fast_accum=False, reduce_in_epilogue=True
) -> bool:  # fmt: skip
    """The Triton producer (one matmul), or for a pingpong config the Gluon float8 one (a sum of
    matmuls too), stores every tile into its owner's slot (in the call's dtype) and flags each
    chunk; the Triton one sums the own chunk in its epilogue unless told not to (returns True:
    reduced). ``scales``: float8 operands', (A's, B's) per matmul; ``fast_accum``: theirs."""
    ws = call.ws
    if gluon_kernels.is_pingpong(gemm_config):
        launch = gluon_kernels.load().producer.matmul_reduce_scatter_pingpong
        extra = {"terms": list(zip(flats[1:], mat2s[1:], scales[1:]))}
    else:
        launch = producer.matmul_reduce_scatter_producer
        extra = {"own_reduction": call.own_reduction()} if reduce_in_epilogue else {}
    launch(
        flats[0], mat2s[0], None if bias is None else bias.contiguous(),
        ws.peer_data_addresses(), ws.peer_flag_addresses(),
        ws.counters, ws.epoch, rank=call.rank, world_size=call.world, config=gemm_config,
        inner=call.layout.inner, scales=scales[0] if scales else None, out_dtype=call.dtype, fast_accum=fast_accum,
        **extra,
    )  # fmt: skip
    return "own_reduction" in extra


def _produce_copy_engine(call, flats, mat2s, bias):
    push_partials(call, functools.partial(_chunk_partial, flats, mat2s, bias, call.layout))


def push_partials(call: Call, partial) -> None:
    """``partial(chunk, out)`` (cuBLAS) per chunk into staging; the copy engine pushes each to
    its owner, flag behind it. Every matmul is queued first, each marking its chunk ready, then
    every push behind its mark: the GPU runs the same schedule, and the host switches streams
    once, not per chunk."""
    ws = call.ws
    order = schedule.reduce_scatter_order(call.rank, call.world)
    ws.fork()  # the pushes come after the barrier; each waits only for its own matmul
    for chunk in order:
        own = chunk == call.rank  # last: straight into the own slot, no copy
        partial(chunk, call.owner_slot(chunk) if own else call.staging(chunk))
        ws.chunk_ready[chunk].record(ws.main)
    with ws.on_side_stream():
        for chunk in order[:-1]:
            ws.side_stream.wait_event(ws.chunk_ready[chunk])
            call.owner_slot(chunk).copy_(call.staging(chunk))
            ws.signal_peer(chunk)


def _produce_cublas_push(call, flats, mat2s, bias):
    """cuBLAS per chunk, writing straight into the owner's slot; the flag follows in stream order."""
    for chunk in schedule.reduce_scatter_order(call.rank, call.world):
        _chunk_partial(flats, mat2s, bias, call.layout, chunk, call.owner_slot(chunk))
        if chunk != call.rank:
            call.ws.signal_peer(chunk)  # stream order: after the matmul's stores


def fused(inputs, *args, gemm_config=None, outputs=None, reduce_in_epilogue=True, tail=()):
    """``reduce_in_epilogue=False``: the owner's sum as a kernel after the producer (the other
    variants' way; benchmarks time the two side by side), as it is under tail matmuls."""
    if len(inputs) != 1:  # before the barrier: every rank refuses alike, nobody waits
        raise NotImplementedError("the fused producer takes one matmul (use a cuBLAS variant for sums)")
    produce = functools.partial(
        produce_fused, gemm_config=gemm_config or gemm.CONFIGS[0], reduce_in_epilogue=reduce_in_epilogue and not tail
    )
    return _overlapped(produce, inputs, *args, outputs=outputs, tail=tail)


def copy_engine_cublas(*args, outputs=None, tail=()):
    return _overlapped(_produce_copy_engine, *args, outputs=outputs, tail=tail)


def cublas_push(*args, outputs=None, tail=()):
    return _overlapped(_produce_cublas_push, *args, outputs=outputs, tail=tail)


def _joined(inputs, mat2s) -> tuple[list, list]:
    """sum_i inputs[i] @ mat2s[i] as one matmul, [inputs...] @ [mat2s...] (the contracted dim
    is the inputs' last, never the scattered one). Joined before the barrier, so the copies
    overlap the peers' arrival."""
    return [torch.cat(inputs, dim=-1)], [torch.cat(mat2s, dim=0)]


def joined_copy_engine_cublas(inputs, mat2s, *args, outputs=None, tail=()):
    """copy_engine_cublas over the joined matmul."""
    return _overlapped(_produce_copy_engine, *_joined(inputs, mat2s), *args, outputs=outputs, tail=tail)


def joined_fused(inputs, mat2s, *args, gemm_config, outputs=None, tail=()):
    """The fused producer over the joined matmul: a sum's tiles hidden behind the GEMM as one
    matmul's are, for the copies' cost (the inputs' bytes and the weights')."""
    return fused(*_joined(inputs, mat2s), *args, gemm_config=gemm_config, outputs=outputs, tail=tail)


def nccl_cublas(inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None, tail=()):
    # a count's first calls and the counts no fused variant takes run this: each line is host
    # time on the critical path, so no RowLayout
    shape = inputs[0].shape
    rows = [a.reshape(-1, a.shape[-1]) for a in inputs]  # (a copy only where no view exists)
    full = torch.mm(rows[0], mat2s[0]) if bias is None else torch.addmm(bias, rows[0], mat2s[0])
    for a, mat2 in zip(rows[1:], mat2s[1:]):
        # the matmuls eager and Inductor run, then a sum: an accumulating matmul (addmm_) meets
        # cuBLAS's setup for a new shape at each new token count (a millisecond or more of host)
        full += torch.mm(a, mat2)
    if out_dtype is not None and out_dtype != full.dtype:
        full = full.to(out_dtype)  # the partial rounded to the inputs' dtype, as the op's is
    blocks = math.prod(shape[:scatter_dim])  # of W chunks each (row_layout.py)
    if blocks > 1:  # NCCL scatters ranks stacked along dim 0, as Inductor's graph does
        full = full.view(blocks, world_size, -1, full.shape[1]).transpose(0, 1).contiguous()
    # the tail under NCCL's kernel
    scattered = collectives.reduce_scatter(full, reduce_op, world_size, group_name, (lambda: run_tail(tail)) if tail else None)
    return scattered.view(_output_shape(inputs, mat2s, scatter_dim, world_size))


def variants(num_inputs: int = 1) -> dict:
    """Name -> implementation, every variant choose.py may pick for ``num_inputs`` matmuls."""
    table = {}
    if num_inputs == 1:
        table = {f"fused:{c}": functools.partial(fused, gemm_config=c) for c in gemm.CONFIGS}
    table["copy_engine_cublas"] = copy_engine_cublas
    if num_inputs > 1:
        table["copy_engine_cublas:joined"] = joined_copy_engine_cublas
        joinable = [c for c in gemm.CONFIGS if c.tma]  # the joined operands are contiguous
        table.update({f"fused:joined:{c}": functools.partial(joined_fused, gemm_config=c) for c in joinable})
    table["cublas_push"] = cublas_push
    table["nccl_cublas"] = nccl_cublas
    return table


def tail_variants(num_inputs: int = 1) -> dict:
    """The ``.tail`` overload's variants: each of ``variants``, taking the tail matmuls' operands
    after the op's arguments and returning (out, tail outputs)."""
    return {name: functools.partial(_with_tail, v) for name, v in variants(num_inputs).items()}


def _with_tail(variant, *args, outputs=None):
    """``outputs``: allocate_tail's, for a replayed call (the baseline, never replayed, makes
    its own)."""
    *op_args, tail_of, tail_with = args
    operands = matmul_ops.tail_operands(op_args[0], tail_of, tail_with)
    out, tail_outs = outputs or (None, _tail_outputs(operands))
    tail = [(a, b, o) for (a, b), o in zip(operands, tail_outs)]
    given = {} if out is None else {"outputs": out}
    return variant(*op_args, tail=tail, **given), tail_outs
