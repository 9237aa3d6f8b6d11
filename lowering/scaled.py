"""overlap::all_gather_scaled_matmul and overlap::scaled_matmul_reduce_scatter on CUDA: the
variants that choose.py picks from, as for the bf16 ops.

- copy_engine_cublas: the bf16 ops' copy-engine protocol (all_gather_matmul.py,
  matmul_reduce_scatter.py) with one _scaled_mm (scaled_ops.scaled_mm_rows) per chunk. An
  all-gather moves the float8 rows and, for rowwise scales, the rows' scales with them, both
  under the chunk's one flag; a reduce-scatter's partials are the matmul's out_dtype (bf16), a
  sum's the op's out_dtype (the terms are summed widened, scaled_ops.py).
- fused (one per gemm.FLOAT8_CONFIGS entry): for the all-gather, the same pushes and flags,
  consumed by the persistent Triton float8 GEMM of templates/all_gather_matmul.py, the scales
  in its epilogue (the row scales of each chunk read once its flag is set), or on Hopper by
  the warp-specialized Gluon one of templates/all_gather_matmul_pingpong.py (one per
  pingpong.CONFIGS entry; exact accumulation in its cooperative form); for the
  reduce-scatter, the Triton float8 producer of templates/matmul_reduce_scatter.py (one
  matmul), which stores each tile's dequantized partial (bf16) in its owner's slot and flags
  each chunk, or on Hopper the Gluon one of templates/matmul_reduce_scatter_pingpong.py (one
  per pingpong.CONFIGS entry; a sum of matmuls too, summed in fp32, and exact accumulation, in
  its cooperative form).
- nccl_cublas: the NCCL collective (float8 moved as bytes), then _scaled_mm on the whole
  tensor: what Inductor runs for these graphs without overlap. The baseline, and the fallback.

A chunk of several blocks of rows (a [batch, seq, dim] tensor gathered or scattered along seq,
row_layout.py) takes one _scaled_mm per block: _scaled_mm has no batched form; the Triton
kernels read the blocks in place.
"""

import contextlib
import dataclasses
import functools

import torch

from overlap_pass import config

from overlap_pass.ops import matmul_ops, scaled_ops, schedule
from overlap_pass.templates import all_gather_matmul as consumer
from overlap_pass.templates import gemm

from . import all_gather_matmul as agm
from . import matmul_reduce_scatter as mrs
from . import collectives, gluon_kernels
from .row_layout import RowLayout

AG_KIND, RS_KIND = "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"


def _scale_rows(scale: torch.Tensor) -> torch.Tensor:
    """A tensorwise scale as it is, a rowwise one ([..., 1]) as its [rows, 1]."""
    return scale if scaled_ops.is_tensorwise(scale) else agm.shard_rows(scale)


def _chunk_scale(scale: torch.Tensor, layout: RowLayout, chunk: int) -> torch.Tensor:
    return scale if scaled_ops.is_tensorwise(scale) else layout.chunk(scale, chunk)


def _scaled_mm_into(a, scale, mat2, mat2_scale, bias, out, out_dtype, use_fast_accum) -> None:
    """out = _scaled_mm(a, mat2) for a chunk's rows (RowLayout.chunk views): [rows, K], or
    [blocks, rows, K] and one call per block."""
    if a.dim() == 2:
        scaled_ops.scaled_mm_rows(a, scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum, out=out)
        return
    for block in range(a.shape[0]):
        block_scale = scale if scaled_ops.is_tensorwise(scale) else scale[block]
        scaled_ops.scaled_mm_rows(
            a[block], block_scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum, out=out[block]
        )


@dataclasses.dataclass
class _Gather:
    """One all-gather call in progress (_start_gather): the shard's rows and, if rowwise, their
    scales (``parts``), the passengers' rows, the workspace and where each lands in its data,
    and the gathered tensors it returns (the shard's if asked for, the passengers')."""

    layout: RowLayout
    parts: list
    passengers: list
    ws: object
    data: list
    gathered: torch.Tensor | None
    passenger_outs: list

    @contextlib.contextmanager
    def consuming(self):
        """Around the consumer: then the passengers collected, and agm.finish, which joins the
        side stream even when a launch fails (the next call must not overtake the pushes)."""
        try:
            yield
            if self.passenger_outs:
                agm.collect_passengers(
                    self.ws, self.passengers, self.data[len(self.parts) :], self.passenger_outs, self.layout
                )
        finally:
            agm.finish(self.ws, self.data[0], self.gathered)


def allocate_gather(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=(),
):  # fmt: skip
    """The float8 all-gather's outputs, empty: the gathered shard if asked for (else None), one
    output per mat2, each passenger's gathered tensor. Made apart from the call, as
    agm.allocate, so that a call replayed from a CUDA graph (replay.py) writes new ones."""
    gathered_shape = matmul_ops._gathered_shape(shard, gather_dim, world_size)
    outs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]], dtype=out_dtype) for m in mat2s]
    gathered = shard.new_empty(gathered_shape) if return_gathered else None
    return gathered, outs, matmul_ops.gathered_passengers(passengers, gather_dim, world_size)


def _start_gather(
    shard, shard_scale, mat2s, gather_dim, world_size, group_name, out_dtype, return_gathered, passengers, outputs
):  # fmt: skip
    """The all-gather variants' common start: their outputs (``outputs``, or new ones), then
    steps 1 and 2 of the protocol (agm.start) for the float8 rows, if rowwise their scales, and
    the passengers. Returns (the call, the matmuls' outputs)."""
    gathered, outs, passenger_outs = outputs or allocate_gather(
        shard, shard_scale, mat2s, (), (), gather_dim, world_size, group_name, out_dtype,
        return_gathered=return_gathered, passengers=passengers,
    )  # fmt: skip
    layout = RowLayout.of(shard.shape, gather_dim, world_size)
    rowwise = not scaled_ops.is_tensorwise(shard_scale)
    parts = [agm.shard_rows(shard)] + ([_scale_rows(shard_scale)] if rowwise else [])
    riders = [agm.shard_rows(p) for p in passengers]
    ws, data = agm.start(parts, layout, group_name, own_too=return_gathered, passengers=riders)
    return _Gather(layout, parts, riders, ws, data, gathered, passenger_outs), outs


def all_gather_copy_engine_scaled_mm(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=(), *, outputs=None,
):  # fmt: skip
    call, outs = _start_gather(
        shard, shard_scale, mat2s, gather_dim, world_size, group_name, out_dtype, return_gathered, passengers, outputs
    )
    layout, parts, ws, data = call.layout, call.parts, call.ws, call.data
    with call.consuming():
        for chunk in schedule.all_gather_order(ws.rank, world_size):
            a = agm.chunk_rows(ws, data[0], parts[0], layout, chunk)  # waits for the chunk's flag
            scale = shard_scale
            if len(parts) > 1:  # rowwise: arrived with the rows, under the same flag
                scale = layout.own(parts[1]) if chunk == ws.rank else layout.chunk(data[1], chunk)
            for out, mat2, mat2_scale, bias in zip(outs, mat2s, mat2_scales, biases):
                target = layout.chunk(out.view(-1, out.shape[-1]), chunk)
                _scaled_mm_into(a, scale, mat2, mat2_scale, bias, target, out_dtype, use_fast_accum)
    return call.gathered, outs, call.passenger_outs


def _fused_fits(shard: torch.Tensor, mat2s) -> bool:
    """Whether the Triton float8 consumer takes these operands: TMA loads only, so a 16-byte
    aligned shard and linear weights ([N, K] transposed: K-major, as fp8 tensor cores want)."""
    return gemm.tma_a(agm.shard_rows(shard)) and all(m.stride(0) == 1 and gemm.tma_operand(m.t()) for m in mat2s)


def all_gather_fused_scaled_mm(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=(), *, gemm_config, outputs=None,
):  # fmt: skip
    """The copy engine's pushes and flags, consumed by the persistent Triton float8 GEMM
    (templates/all_gather_matmul.py, scales in its epilogue), or the Gluon one if ``gemm_config``
    is a pingpong.PingpongConfig."""
    if not _fused_fits(shard, mat2s):  # before the barrier: every rank refuses alike
        raise NotImplementedError("the fused float8 consumer needs TMA-aligned operands and [N, K] weights")
    gluon = gluon_kernels.is_pingpong(gemm_config)
    if gluon and not gluon_kernels.load().consumer.usable(shard.device):
        raise NotImplementedError("the Gluon pingpong consumer runs on Hopper")
    # the kernel reads a weight's rowwise scale as N consecutive words
    column_scales = tuple(s if scaled_ops.is_tensorwise(s) else scaled_ops._standard_strides(s) for s in mat2_scales)
    call, outs = _start_gather(
        shard, shard_scale, mat2s, gather_dim, world_size, group_name, out_dtype, return_gathered, passengers, outputs
    )
    layout, parts, ws, data = call.layout, call.parts, call.ws, call.data
    if len(parts) > 1:  # rowwise: every gathered row's scale (each chunk's with its rows), the own
        scales = consumer.Scales(data[1].view(-1), parts[1].view(-1), column_scales, use_fast_accum)
    else:
        scales = consumer.Scales(shard_scale.reshape(1), None, column_scales, use_fast_accum)
    launch = gluon_kernels.load().consumer.all_gather_matmul_pingpong if gluon else consumer.all_gather_matmul_consumer
    with call.consuming():
        launch(
            data[0], list(mat2s), [None if b is None else b.contiguous() for b in biases],
            [o.view(-1, o.shape[-1]) for o in outs], ws.flags, ws.epoch, rank=ws.rank,
            world_size=world_size, inner=layout.inner, a_local=parts[0], config=gemm_config,
            spin_limit=config.spin_limit, timeouts=ws.chunk_timeouts, scales=scales,
        )  # fmt: skip
    return call.gathered, outs, call.passenger_outs


def allocate_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    """The float8 reduce-scatter's output, empty (as mrs.allocate, for replay.py)."""
    return _scattered_output(inputs, mat2s[0].shape[1], scatter_dim, world_size, out_dtype or mm_dtype)


def _scattered_output(inputs, n, scatter_dim, world_size, dtype) -> torch.Tensor:
    full = [*inputs[0].shape[:-1], n]
    return inputs[0].new_empty(matmul_ops._scattered_shape(full, scatter_dim, world_size), dtype=dtype)


def _reduce_scatter(inputs, flats, layout, n, scatter_dim, world_size, group_name, reduce_op, dtypes, produce, outputs):
    """What both symmetric-memory reduce-scatter variants do around their own step: the output
    (``outputs``, or a new one; ``dtypes``: the partials' and the output's), the call (which
    enters the protocol), ``produce(call)``, then the owner's reduction (mrs.reduce_produced)."""
    partial_dtype, out_dtype = dtypes
    out = _scattered_output(inputs, n, scatter_dim, world_size, out_dtype) if outputs is None else outputs
    call = mrs.Call(layout, n, partial_dtype, flats[0].device, group_name)
    return mrs.reduce_produced(call, lambda: produce(call), reduce_op, out)


def copy_engine_scaled_mm_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False, *, outputs=None,
):  # fmt: skip
    flats, layout = mrs._input_rows(inputs, scatter_dim, world_size)
    scales = [_scale_rows(s) for s in input_scales]

    def partial(chunk: int, slot: torch.Tensor) -> None:
        target = layout.own(slot)
        for i, (a, scale, mat2, mat2_scale) in enumerate(zip(flats, scales, mat2s, mat2_scales)):
            rows, chunk_scale = layout.chunk(a, chunk), _chunk_scale(scale, layout, chunk)
            direct = i == 0 and target.dtype == mm_dtype
            term = target if direct else torch.empty_like(target, dtype=mm_dtype)
            term_bias = bias if i == 0 else None
            _scaled_mm_into(rows, chunk_scale, mat2, mat2_scale, term_bias, term, mm_dtype, use_fast_accum)
            if i == 0 and not direct:
                target.copy_(term)
            elif i > 0:
                target.add_(term)

    # the op sums its terms widened (scaled_ops): a sum's partials travel in out_dtype; one
    # term's in mm_dtype, which widens exactly at the owner
    dtypes = ((out_dtype or mm_dtype) if len(inputs) > 1 else mm_dtype, out_dtype or mm_dtype)
    return _reduce_scatter(
        inputs, flats, layout, mat2s[0].shape[1], scatter_dim, world_size, group_name, reduce_op, dtypes,
        lambda call: mrs.push_partials(call, partial), outputs,
    )  # fmt: skip


def fused_scaled_mm_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False, *, gemm_config, outputs=None,
):  # fmt: skip
    """The persistent Triton float8 producer (templates/matmul_reduce_scatter.py, scales in its
    epilogue; one matmul), or the Gluon one (matmul_reduce_scatter_pingpong.py; a sum of up to
    MAX_TERMS too) if ``gemm_config`` is a pingpong.PingpongConfig, stores each partial into its
    owner's slot; the owner's reduction as the other variants'."""
    flats, layout = mrs._input_rows(inputs, scatter_dim, world_size)
    gluon = gluon_kernels.is_pingpong(gemm_config)
    terms = gluon_kernels.load().producer.MAX_TERMS if gluon else 1
    # before the barrier: every rank refuses alike
    if len(inputs) > terms or not all(_fused_fits(a, [m]) for a, m in zip(flats, mat2s)):
        raise NotImplementedError(
            f"the fused float8 producer takes up to {terms} matmul(s) of TMA-aligned operands, [N, K] weights"
        )
    if len({a.dtype for a in flats}) > 1 or len({m.dtype for m in mat2s}) > 1:
        raise NotImplementedError("the Gluon producer sums matmuls of one float8 type on each side")
    if gluon and not gluon_kernels.load().producer.usable(flats[0].device):
        raise NotImplementedError("the Gluon pingpong producer runs on Hopper")
    # one word, or one per row of A / column of B, consecutive, as the kernels read them
    scales = [tuple(s.reshape(-1).contiguous() for s in pair) for pair in zip(input_scales, mat2_scales)]
    produce = functools.partial(
        mrs.produce_fused, flats=flats, mat2s=mat2s, bias=bias, gemm_config=gemm_config, scales=scales,
        fast_accum=use_fast_accum,
    )  # fmt: skip
    # a sum's partials in out_dtype, as the copy engine's (the terms summed widened)
    partial_dtype = (out_dtype or mm_dtype) if len(inputs) > 1 else mm_dtype
    return _reduce_scatter(
        inputs, flats, layout, mat2s[0].shape[1], scatter_dim, world_size, group_name, reduce_op,
        (partial_dtype, out_dtype or mm_dtype), produce, outputs,
    )  # fmt: skip


def all_gather_nccl_scaled_mm(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=(),
):  # fmt: skip
    gathered = agm.nccl_gather(shard, gather_dim, world_size, group_name)
    scale = shard_scale
    if not scaled_ops.is_tensorwise(shard_scale):
        scale = agm.nccl_gather(shard_scale, gather_dim, world_size, group_name)
    outs = [
        scaled_ops.scaled_mm_rows(gathered, scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum)
        for mat2, mat2_scale, bias in zip(mat2s, mat2_scales, biases)
    ]
    passenger_outs = [agm.nccl_gather(p, gather_dim, world_size, group_name) for p in passengers]
    return (gathered if return_gathered else None), outs, passenger_outs


def nccl_scaled_mm_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    full = None
    for i, (a, scale, mat2, mat2_scale) in enumerate(zip(inputs, input_scales, mat2s, mat2_scales)):
        term = scaled_ops.scaled_mm_rows(a, scale, mat2, mat2_scale, bias if i == 0 else None, mm_dtype, use_fast_accum)
        term = term.to(out_dtype or mm_dtype)  # summed widened, as the op says (scaled_ops)
        full = term if full is None else full + term
    # NCCL scatters ranks stacked along dim 0: the scatter dim moved to the front, as Inductor's
    # graph does
    stacked = full.movedim(scatter_dim, 0).contiguous()
    out = collectives.reduce_scatter(stacked, reduce_op, world_size, group_name)
    return out.movedim(0, scatter_dim).contiguous()


def variants(kind: str, num_inputs: int = 1) -> dict:
    """Name -> implementation, every variant choose.py may pick for a scaled op of ``kind``
    (a reduce-scatter: of a sum of ``num_inputs`` matmuls; the Triton producer takes one)."""
    if kind == AG_KIND:
        fused, copy_engine, nccl = (
            all_gather_fused_scaled_mm, all_gather_copy_engine_scaled_mm, all_gather_nccl_scaled_mm
        )
    else:
        fused, copy_engine, nccl = (
            fused_scaled_mm_reduce_scatter, copy_engine_scaled_mm_reduce_scatter, nccl_scaled_mm_reduce_scatter
        )
    configs = (gemm.FLOAT8_CONFIGS if num_inputs == 1 else []) + gluon_kernels.configs()  # none without Gluon
    table = {f"fused:{cfg}": functools.partial(fused, gemm_config=cfg) for cfg in configs}
    table["copy_engine_cublas"] = copy_engine
    table["nccl_cublas"] = nccl
    return table
