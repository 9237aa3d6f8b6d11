"""overlap::all_gather_scaled_matmul and overlap::scaled_matmul_reduce_scatter: the float8 forms
of matmul_ops.py's two ops, each matmul a ``torch._scaled_mm``.

    all_gather_scaled_matmul:     A = all_gather(shard), As = all_gather(shard_scale) if rowwise
                                  out[i] = _scaled_mm(A, mat2s[i], As or shard_scale,
                                                      mat2_scales[i], biases[i], out_dtype)
                                  -> (A if return_gathered, out, [all_gather(p) for p in passengers])
    scaled_matmul_reduce_scatter: out = reduce_scatter(sum_i _scaled_mm(inputs[i], mat2s[i],
                                        input_scales[i], mat2_scales[i], bias if i == 0,
                                        mm_dtype).to(out_dtype or mm_dtype))

Operands are float8; A and inputs[i] are [..., K] with the gathered or scattered dim a leading
dim, mat2s[i] are [K, N] (column-major, as cuBLAS wants them on CUDA). Scales multiply (they
dequantize), in fp32, as _scaled_mm's do:
- tensorwise: one value, 0-d or [1]. The shard's scale applies to every gathered row as it is
  on this rank (the graph gave each rank's matmul its own);
- rowwise: one per row, shaped like the operand with a last dim of 1 ([..., 1]); the shard's
  rows are gathered with the shard, an input's are cut into chunks with it. mat2's are [1, N].

Passengers are more shards with the shard's rows ([..., X], any dtype) that no matmul reads, gathered
along the same dim in the same call: torchao's rowwise recipe quantizes a gathered tensor twice,
once per row for the matmul and once per column (across the tokens) for the weight gradient, and
the second float8 copy rides with the first's gather, behind its matmul, instead of taking a
collective of its own after it (overlap_pass/passengers.py).

Each term of matmul_reduce_scatter is rounded to ``mm_dtype`` (the _scaled_mm's out_dtype), then
widened to ``out_dtype`` (default: mm_dtype), in which the terms are summed: the graphs it
replaces (torchao's Float8Linear in an fp32 model) widen each matmul's result before adding the
two input gradients of w1 and w3. The reduction over ranks is in fp32, ``out`` in ``out_dtype``.
The reference runs one _scaled_mm per chunk on torch.distributed point-to-point ops (float8
moves as bytes); CUDA tensors run lowering/dispatch.py's variants.
"""

import torch

from . import matmul_ops, schedule

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

SCHEMAS = {
    "all_gather_scaled_matmul": (
        "(Tensor shard, Tensor shard_scale, Tensor[] mat2s, Tensor[] mat2_scales, Tensor?[] biases, "
        "int gather_dim, int world_size, str group_name, ScalarType out_dtype, "
        "bool use_fast_accum=False, bool return_gathered=False, Tensor[]? passengers=None) "
        "-> (Tensor?, Tensor[], Tensor[])"
    ),
    "scaled_matmul_reduce_scatter": (
        "(Tensor[] inputs, Tensor[] input_scales, Tensor[] mat2s, Tensor[] mat2_scales, "
        "Tensor? bias, str reduce_op, int scatter_dim, int world_size, str group_name, "
        "ScalarType mm_dtype, ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor"
    ),
}


def is_tensorwise(scale: torch.Tensor) -> bool:
    return scale.dim() <= 1 and scale.numel() == 1


def _check_scale(scale: torch.Tensor, operand: torch.Tensor, what: str) -> None:
    """A tensorwise scale, or a rowwise one shaped like ``operand`` with a last dim of 1."""
    matmul_ops.check(scale.dtype == torch.float32, lambda: f"{what} must be float32, got {scale.dtype}")
    rowwise = list(scale.shape) == list(operand.shape[:-1]) + [1]
    matmul_ops.check(
        is_tensorwise(scale) or rowwise,
        lambda: f"{what} of shape {list(scale.shape)} is neither one value (0-d or [1]) nor one "
        f"per row of the operand {list(operand.shape)} ([..., 1])",
    )


def _check_mat2s(k: int, mat2s, mat2_scales) -> None:
    matmul_ops.check(len(mat2s) > 0, lambda: "at least one mat2")
    matmul_ops.check(len(mat2_scales) == len(mat2s), lambda: "one mat2 scale per mat2")
    for mat2, scale in zip(mat2s, mat2_scales):
        matmul_ops.check(
            mat2.dim() == 2 and mat2.shape[0] == k,
            lambda: f"mat2 of shape {list(mat2.shape)} does not match K={k}",
        )
        matmul_ops.check(mat2.dtype in FLOAT8, lambda: f"mat2 must be float8, got {mat2.dtype}")
        n = mat2.shape[1]
        matmul_ops.check(
            scale.dtype == torch.float32 and (is_tensorwise(scale) or list(scale.shape) == [1, n]),
            lambda: f"mat2 scale of shape {list(scale.shape)} is neither one float32 value nor [1, {n}]",
        )


def _check_out_dtype(dtype) -> None:
    matmul_ops.check(dtype in OUT_DTYPES, lambda: f"out_dtype must be one of {OUT_DTYPES}, got {dtype}")


def _check_all_gather(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, out_dtype, passengers=()
) -> int:
    matmul_ops.check(shard.dim() >= 2, lambda: f"shard must be at least 2-D, got {shard.dim()}-D")
    matmul_ops.check(shard.dtype in FLOAT8, lambda: f"shard must be float8, got {shard.dtype}")
    dim = gather_dim % shard.dim()
    matmul_ops.check(
        dim != shard.dim() - 1,
        lambda: "gather_dim is the contraction dim (K); only leading dims can be gathered",
    )
    matmul_ops.check(world_size >= 1, lambda: f"world_size must be positive, got {world_size}")
    _check_scale(shard_scale, shard, "shard_scale")
    _check_mat2s(shard.shape[-1], mat2s, mat2_scales)
    matmul_ops.check(len(biases) == len(mat2s), lambda: f"{len(biases)} biases for {len(mat2s)} mat2s")
    for mat2, bias in zip(mat2s, biases):
        matmul_ops.check(
            bias is None or (bias.dim() == 1 and bias.shape[0] == mat2.shape[1]),
            lambda: f"bias does not match N={mat2.shape[1]}",
        )
    _check_out_dtype(out_dtype)
    matmul_ops.check_passengers(shard, passengers)
    return dim


def _check_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, mm_dtype, out_dtype
) -> int:  # fmt: skip
    matmul_ops.check(len(inputs) > 0, lambda: "at least one input")
    matmul_ops.check(len(input_scales) == len(inputs), lambda: "one scale per input")
    matmul_ops.check(len(mat2s) == len(inputs), lambda: "one mat2 per input")
    matmul_ops.check(reduce_op in matmul_ops.REDUCE_OPS, lambda: f"reduce_op must be one of {matmul_ops.REDUCE_OPS}")
    first = inputs[0]
    matmul_ops.check(first.dim() >= 2, lambda: f"inputs must be at least 2-D, got {first.dim()}-D")
    dim = scatter_dim % first.dim()
    matmul_ops.check(dim != first.dim() - 1, lambda: "scatter_dim must be a leading dim, not N")
    matmul_ops.check(len(mat2_scales) == len(mat2s), lambda: "one mat2 scale per mat2")
    for a, scale, mat2, mat2_scale in zip(inputs, input_scales, mat2s, mat2_scales):
        matmul_ops.check(a.dtype in FLOAT8, lambda: f"inputs must be float8, got {a.dtype}")
        matmul_ops.check(a.shape[:-1] == first.shape[:-1], lambda: "inputs must share their leading dims")
        _check_scale(scale, a, "input scale")
        _check_mat2s(a.shape[-1], [mat2], [mat2_scale])
    n = mat2s[0].shape[1]
    matmul_ops.check(all(m.shape[1] == n for m in mat2s), lambda: "all mat2s must have the same N")
    matmul_ops.check(
        first.shape[dim] % world_size == 0,
        lambda: f"scatter dim size {first.shape[dim]} is not divisible by world size {world_size}",
    )
    matmul_ops.check(bias is None or list(bias.shape) == [n], lambda: "bias must be 1-D of size N")
    _check_out_dtype(mm_dtype)
    matmul_ops.check(out_dtype in (None, mm_dtype, torch.float32), lambda: "out_dtype must be mm_dtype or float32")
    return dim


# ---------------------------------------------------------------------------------------------
# Fake kernels


def _all_gather_scaled_matmul_fake(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=None,
):  # fmt: skip
    passengers = passengers or ()
    dim = _check_all_gather(
        shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, out_dtype, passengers
    )
    gathered_shape = matmul_ops._gathered_shape(shard, dim, world_size)
    outputs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]], dtype=out_dtype) for m in mat2s]
    riders = matmul_ops.gathered_passengers(passengers, dim, world_size)
    return (shard.new_empty(gathered_shape) if return_gathered else None), outputs, riders


def _scaled_matmul_reduce_scatter_fake(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    dim = _check_reduce_scatter(
        inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, mm_dtype, out_dtype
    )
    full = list(inputs[0].shape[:-1]) + [mat2s[0].shape[1]]
    return inputs[0].new_empty(matmul_ops._scattered_shape(full, dim, world_size), dtype=out_dtype or mm_dtype)


# ---------------------------------------------------------------------------------------------
# Reference decomposition


def _standard_strides(scale: torch.Tensor) -> torch.Tensor:
    """_scaled_mm checks a rowwise scale's strides literally (a stride of 0 or M on a dim of
    size 1 fails), which .contiguous() leaves as they are; cuBLAS also refuses a scale vector
    that does not start on 16 bytes (CUBLAS_STATUS_NOT_SUPPORTED), as a chunk's rows of a
    gathered scale do when a rank holds a number of rows not divisible by 4."""
    aligned = scale.data_ptr() % 16 == 0
    if aligned and scale.stride() == torch.empty(scale.shape, device="meta").stride():
        return scale
    return scale.new_empty(scale.shape).copy_(scale)


def scaled_mm_rows(a, a_scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum, out=None) -> torch.Tensor:
    """_scaled_mm of ``a`` ([..., K]) with its scale (tensorwise, or rowwise [..., 1]), as
    [..., N]; written into ``out`` where given (its rows contiguous)."""
    rows = a.reshape(-1, a.shape[-1])
    n = mat2.shape[1]
    target = None if out is None else out.view(-1, n)
    if not is_tensorwise(a_scale):
        a_scale = _standard_strides(a_scale.reshape(-1, 1))
    if not is_tensorwise(mat2_scale):
        mat2_scale = _standard_strides(mat2_scale)
    # rowwise without fast accumulation too: torchao avoids that kernel ("so slow without
    # fast-accum") and runs the tensorwise one with the scales applied after, but on torch 2.11
    # it runs only a little slower than the fast one, and the after-scaling, unfused as a
    # variant runs it, up to several times slower (docs/float8.md#on-cuda); it also rounds
    # once, as the fused kernels do
    result = torch._scaled_mm(
        rows, mat2, a_scale, mat2_scale, bias, None, out_dtype=out_dtype, use_fast_accum=use_fast_accum, out=target
    )
    return (result if out is None else out).view(*a.shape[:-1], n)


def all_gather_scaled_matmul_reference(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=None,
):  # fmt: skip
    """Rank-rotated all-gather of the shard (and its rowwise scale) on point-to-point ops,
    one _scaled_mm per chunk as soon as the chunk is there; the passengers' transfers posted
    after the shard's."""
    passengers = passengers or ()
    dim = _check_all_gather(
        shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, out_dtype, passengers
    )
    group = matmul_ops.resolve_group(group_name, world_size)
    shard = shard.contiguous()
    rowwise = not is_tensorwise(shard_scale)
    gathered_shape = matmul_ops._gathered_shape(shard, dim, world_size)
    outputs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]], dtype=out_dtype) for m in mat2s]
    gathered = shard.new_empty(gathered_shape) if return_gathered else None

    received = matmul_ops.post_all_gather(group, shard)
    received_scale = matmul_ops.post_all_gather(group, shard_scale.contiguous()) if rowwise else None
    riders = [matmul_ops.post_all_gather(group, p.contiguous()) for p in passengers]
    for src in schedule.all_gather_order(group.rank(), world_size):
        chunk = received(src)
        scale = received_scale(src) if rowwise else shard_scale
        for out, mat2, mat2_scale, bias in zip(outputs, mat2s, mat2_scales, biases):
            result = scaled_mm_rows(chunk, scale, mat2, mat2_scale, bias, out_dtype, use_fast_accum)
            schedule.chunk(out, dim, src, world_size).copy_(result)
        if gathered is not None:
            schedule.chunk(gathered, dim, src, world_size).copy_(chunk)
    return gathered, outputs, matmul_ops.collect_passengers(riders, passengers, dim, world_size)


def scaled_matmul_reduce_scatter_reference(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    """One _scaled_mm per chunk and input, the chunk for rank + 1 first, each partial sent to
    its owner as soon as it exists (matmul_ops.reduce_scatter_partials)."""
    dim = _check_reduce_scatter(
        inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, mm_dtype, out_dtype
    )
    group = matmul_ops.resolve_group(group_name, world_size)

    def partial(index: int) -> torch.Tensor:
        acc = None
        for i, (a, scale, mat2, mat2_scale) in enumerate(zip(inputs, input_scales, mat2s, mat2_scales)):
            rows = schedule.chunk(a, dim, index, world_size)
            if not is_tensorwise(scale):
                scale = schedule.chunk(scale, dim, index, world_size)
            term = scaled_mm_rows(rows, scale, mat2, mat2_scale, bias if i == 0 else None, mm_dtype, use_fast_accum)
            term = term.to(out_dtype or mm_dtype)
            acc = term if acc is None else acc + term
        return acc.contiguous()

    return matmul_ops.reduce_scatter_partials(group, partial, reduce_op, out_dtype)


KERNELS = {
    "all_gather_scaled_matmul": (_all_gather_scaled_matmul_fake, all_gather_scaled_matmul_reference),
    "scaled_matmul_reduce_scatter": (_scaled_matmul_reduce_scatter_fake, scaled_matmul_reduce_scatter_reference),
}
