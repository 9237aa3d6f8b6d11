"""overlap::all_gather_scaled_matmul and overlap::scaled_matmul_reduce_scatter on CUDA.

One variant so far, nccl_scaled_mm: the NCCL collective (float8 moved as bytes), then
_scaled_mm (scaled_ops.scaled_mm_rows) on the whole tensor: what Inductor runs for these graphs
without overlap. The overlapped variants (copy-engine chunks feeding one _scaled_mm per chunk,
and the Triton fp8 consumer and producer) follow the bf16 ops' protocol once measured on two
GPUs; until then the rewrite costs nothing over Inductor's own graph, bar the rowwise scales of
an all-gather moving in their own collective.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from overlap_pass import ops, scaled_ops

from .row_layout import RowLayout


def _gather(shard: torch.Tensor, gather_dim: int, world_size: int, group) -> torch.Tensor:
    """NCCL all-gather along ``gather_dim``; 1-byte dtypes move as uint8."""
    shard = shard.contiguous()
    raw = shard.view(torch.uint8) if shard.element_size() == 1 else shard
    stacked = raw.new_empty((world_size,) + tuple(shard.shape))
    dist.all_gather_into_tensor(stacked, raw, group=group)
    stacked = stacked.view(shard.dtype)
    if RowLayout.of(shard.shape, gather_dim, world_size).outer == 1:  # ranks stacked: in order
        return stacked.view(ops._gathered_shape(shard, gather_dim, world_size))
    return torch.cat(stacked.unbind(0), dim=gather_dim)


def all_gather_nccl_scaled_mm(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False,
):  # fmt: skip
    group = _resolve_process_group(group_name)
    gathered = _gather(shard, gather_dim, world_size, group)
    scale = shard_scale
    if not scaled_ops.is_tensorwise(shard_scale):
        scale = _gather(shard_scale, gather_dim, world_size, group)
    outs = [
        scaled_ops.scaled_mm_rows(gathered, scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum)
        for mat2, mat2_scale, bias in zip(mat2s, mat2_scales, biases)
    ]
    return (gathered if return_gathered else None), outs


def nccl_scaled_mm_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    full = None
    for a, scale, mat2, mat2_scale in zip(inputs, input_scales, mat2s, mat2_scales):
        term = scaled_ops.scaled_mm_rows(a, scale, mat2, mat2_scale, None, mm_dtype, use_fast_accum)
        full = term if full is None else full + term
    if bias is not None:
        full = full + bias
    if out_dtype is not None and out_dtype != full.dtype:
        full = full.to(out_dtype)
    # NCCL scatters ranks stacked along dim 0: the scatter dim moved to the front, as Inductor's
    # graph does
    stacked = full.movedim(scatter_dim, 0).contiguous()
    out = stacked.new_empty((stacked.shape[0] // world_size, *stacked.shape[1:]))
    op = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
    dist.reduce_scatter_tensor(out, stacked, op=op, group=_resolve_process_group(group_name))
    return out.movedim(0, scatter_dim).contiguous()
