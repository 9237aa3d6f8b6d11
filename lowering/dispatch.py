"""The CUDA kernels of the overlap ops: pick a variant per shape (choose.py) and run it."""

import collections
import functools
import math
import weakref

import torch
import torch.distributed as dist

from overlap_pass import config, torch_compat
from overlap_pass.ops import all_reduce_op, matmul_ops, scaled_ops

from . import all_gather_matmul as agm
from . import all_reduce as ar
from . import choose, replay, scaled, symm
from . import matmul_reduce_scatter as mrs


@functools.cache
def _ag_variants(num_mat2s: int) -> dict:
    return agm.variants(num_mat2s)


@functools.cache
def _rs_variants(num_inputs: int) -> dict:
    return mrs.variants(num_inputs)


@functools.cache
def _rs_tail_variants(num_inputs: int) -> dict:
    return mrs.tail_variants(num_inputs)


def _layouts(mat2s) -> list:
    # "t": a transposed [N, K] weight (a linear's), "n": row-major [K, N]
    return [[*m.shape, "t" if m.stride(0) == 1 and m.dim() == 2 else "n"] for m in mat2s]


def _bucketed(shape) -> tuple[list, int]:
    """``shape`` with its leading (token) dims as "*", and the bucket of their product: the
    rows a matmul runs on, wherever the sequence and the batch sit (DTensor's batch-1 sequence
    gather runs along dim 0 of [1, S / W, K] once the pass has moved its permute)."""
    shape = list(shape)
    return ["*"] * (len(shape) - 1) + shape[-1:], choose.token_bucket(math.prod(shape[:-1]))


def all_gather_matmul_shapes(shard_shape, mat2s, biases, gather_dim, contractions=(), passengers=()) -> dict:
    """What the all_gather_matmul choice depends on; decide.py builds the same from graph
    metadata to show a cached choice in decisions.json. The shard's rows count by their bucket
    (choose.token_bucket). ``contractions``: (K_j, gathered_left); ``passengers``: the bytes of
    a row of each (they travel too)."""
    shard, tokens = _bucketed(shard_shape)
    shapes = {
        "shard": shard,
        "tokens": tokens,
        "gather_dim": gather_dim,
        "mat2s": _layouts(mat2s),
        "bias": [b is not None for b in biases],
    }
    if contractions:
        shapes["contractions"] = [[k, "left" if left else "right"] for k, left in contractions]
    if passengers:
        shapes["passengers"] = list(passengers)
    return shapes


def _row_bytes(passengers) -> list[int]:
    return [p.shape[-1] * p.element_size() for p in passengers]


def matmul_reduce_scatter_shapes(
    input_shapes, mat2s, has_bias, reduce_op, scatter_dim, out_dtype=None
) -> dict:
    """What the matmul_reduce_scatter choice depends on (decide.py builds the same), the
    inputs' rows by their bucket; an ``out_dtype`` other than the inputs' adds a key (the
    reduction writes more bytes)."""
    _, tokens = _bucketed(input_shapes[0])  # the inputs share their rows
    shapes = {
        "inputs": [_bucketed(s)[0] for s in input_shapes],
        "tokens": tokens,
        "mat2s": _layouts(mat2s),
        "bias": has_bias,
        "reduce_op": reduce_op,
        "scatter_dim": scatter_dim,
    }
    if out_dtype is not None:
        shapes["out_dtype"] = str(out_dtype).replace("torch.", "")
    return shapes


def _symmetric_memory_usable(group) -> bool:
    # "nccl", or "cpu:gloo,cuda:nccl" for a group made without naming a backend; asked once a
    # group (a fifth of a millisecond each time: every new signature's first call asks)
    usable = _USABLE.get(group)
    if usable is None:
        usable = _USABLE[group] = group.size() > 1 and "nccl" in str(dist.get_backend(group))
    return usable


_USABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


# (kind, shapes, strides, dtypes, dims, group, implementation: everything the outputs' layout
# depends on too, _GraphedCall) of a call -> the variant it runs, so that later calls skip
# validation and key building (host time is on the critical path);
# the config.shapes_kept most recently used, with their per-call graphs (shapes that change)
_RESOLVED: collections.OrderedDict[tuple, object] = collections.OrderedDict()


def _resolved(fast_key: tuple):
    run = _RESOLVED.get(fast_key)
    if run is not None:
        _RESOLVED.move_to_end(fast_key)
    return run


# Whether a call signature's first calls run NCCL + cuBLAS (config.fused_from_call): not once a
# graph that runs plain Inductor's code at a token count's first calls has been compiled in this
# process (shapes/new_counts.py turns it off): that graph has done the waiting.
first_calls_on_nccl = True

# call signatures whose first calls ran NCCL + cuBLAS (config.fused_from_call), most recent last
_WARMED: collections.OrderedDict[tuple, None] = collections.OrderedDict()


def _baseline_at_first_calls(fast_key: tuple, baseline, device):
    """The run of ``fast_key``'s first config.fused_from_call - 1 calls: NCCL + cuBLAS, which
    then hands the signature to _first_call's choice; None where its first calls are over, the
    implementation is forced, a graph warms its token counts up on plain Inductor instead
    (first_calls_on_nccl), or CUDA graphs take the host out of the way (a capture records the call;
    graph trees warm a model up, to record its next call: the choice is made now). The same on
    every rank: each calls the op with the same signatures in the same order."""
    fused_from_call = config.fused_from_call  # (each config read costs the host microseconds)
    if (
        fused_from_call <= 1 or config.implementation != "auto" or fast_key in _WARMED or not first_calls_on_nccl
        or torch.cuda.is_current_stream_capturing() or choose.replays_graphs(device)
    ):  # fmt: skip
        return None
    left = fused_from_call - 1

    def run(*args):
        nonlocal left
        left -= 1
        if left == 0:  # the next call chooses
            _RESOLVED.pop(fast_key, None)
            _WARMED[fast_key] = None
            while len(_WARMED) > 4 * max(config.shapes_kept, 1):
                _WARMED.popitem(last=False)
        return baseline(*args)

    return run


# (group name, key) -> the call signatures whose calls ran steps of the key's trial
# (choose.Trial): their variants' per-call graphs are dropped once the choice is made
_TRIED: dict[tuple[str, str], set] = {}


def _remember(fast_key: tuple, run) -> None:
    """Keeps ``run`` for ``fast_key``; drops the least recently used signature past
    config.shapes_kept, and its per-call graphs (a later call of it resolves again: its
    bucket's choice, no measurement)."""
    _RESOLVED[fast_key] = run
    kept = max(config.shapes_kept, 1)
    while len(_RESOLVED) > kept:
        dropped, _ = _RESOLVED.popitem(last=False)
        replay.forget_calls_of(dropped)


def _ag_tensors(args, outputs):
    shard, mat2s, biases, _, _, group_name, _, contract_with, _, passengers = args
    gathered, outs = outputs
    return (shard, *mat2s, *biases, *contract_with, *passengers, gathered, *outs), group_name, shard.device


def _rs_tensors(args, outputs):
    inputs, mat2s, bias, _, _, _, group_name, _ = args
    return (*inputs, *mat2s, bias, outputs), group_name, inputs[0].device


def _rs_tail_tensors(args, outputs):
    *op_args, _, tail_with = args
    out, tail_outs = outputs
    tensors, group_name, device = _rs_tensors(op_args, out)
    return (*tensors, *tail_with, *tail_outs), group_name, device


def _scaled_ag_tensors(args, outputs):
    shard, shard_scale, mat2s, mat2_scales, biases, _, _, group_name, _, _, _, passengers = args
    gathered, outs, passenger_outs = outputs
    tensors = (shard, shard_scale, *mat2s, *mat2_scales, *biases, *passengers, gathered, *outs, *passenger_outs)
    return tensors, group_name, shard.device


def _ar_tensors(args, outputs):
    return (args[0], outputs), args[3], args[0].device


def _scaled_rs_tensors(args, outputs):
    inputs, input_scales, mat2s, mat2_scales, bias, _, _, _, group_name, _, _, _ = args
    return (*inputs, *input_scales, *mat2s, *mat2_scales, bias, outputs), group_name, inputs[0].device


# kind -> (its outputs for a call's arguments, the workspace kind its calls run on, every tensor
# a call reads or writes, its group and device)
_GRAPHED_KINDS = {
    agm.KIND: (agm.allocate, agm.KIND, _ag_tensors),
    mrs.KIND: (mrs.allocate, mrs.KIND, _rs_tensors),
    mrs.TAIL_KIND: (mrs.allocate_tail, mrs.KIND, _rs_tail_tensors),
    scaled.AG_KIND: (scaled.allocate_gather, agm.KIND, _scaled_ag_tensors),
    scaled.RS_KIND: (scaled.allocate_scatter, mrs.KIND, _scaled_rs_tensors),
    ar.KIND: (ar.allocate, ar.KIND, _ar_tensors),
}


def _graphed_call(kind: str, run, signature: tuple, *args, outputs=None):
    """One call of the variant ``run`` of an op of ``kind`` through replay.py, on ``outputs`` (made
    here if not given; ``signature``: the call's fast key and the variant's name); returns the
    outputs and the op's device."""
    allocate, workspace_kind, tensors_of = _GRAPHED_KINDS[kind]
    if outputs is None:
        outputs = allocate(*args)
    tensors, group_name, device = tensors_of(args, outputs)
    replay.call(signature, run, args, outputs, tensors, symm.workspace(workspace_kind, group_name, device))
    return outputs, device


class _GraphedCall:
    """The calls of one variant at one call signature through _graphed_call. The signature fixes
    every output's size, stride and dtype, so from the second call on the outputs are made as
    the first call's were, past torch's dispatcher (replay.output_maker): the host's time of an
    allocation call per output."""

    def __init__(self, kind: str, run, signature: tuple) -> None:
        self.kind, self.run, self.signature = kind, run, signature
        self._make_outputs = None

    def __call__(self, *args):
        outputs = self._make_outputs() if self._make_outputs is not None else None
        outputs, device = _graphed_call(self.kind, self.run, self.signature, *args, outputs=outputs)
        if self._make_outputs is None:
            self._make_outputs = replay.output_maker(outputs, device)
        return outputs


def variant_calls(kind: str, fast_key: tuple, variants: dict) -> dict:
    """Name -> the variant as a call of ``fast_key``: every variant but the baseline runs the
    symmetric-memory protocol, which a per-call graph can hold (_GraphedCall), each variant's
    graphs apart (the choice runs them all on the same tensors)."""
    return {
        name: v if name == choose.BASELINE else _GraphedCall(kind, v, (fast_key, name))
        for name, v in variants.items()
    }


def _first_call(kind, fast_key, group_name, world_size, variants, shapes, dtype, device, args, reference):
    """The first call of a signature: runs the reference decomposition (forced, or a group
    without symmetric memory), NCCL + cuBLAS at its first calls (config.fused_from_call: the
    signature comes back here after them), else choose.py's pick, made on the calls it will
    run; the variant is kept for the signature's later calls. While the pick is measured over
    the calls of its key (choose.Trial), each call is a step of that and comes back here. A
    pick made at another token count of its bucket that refuses this count (choose.refusals:
    the same on every rank) leaves this signature to NCCL + cuBLAS."""
    group = torch_compat.resolve_process_group(group_name)
    matmul_ops.check(
        group.size() == world_size,
        lambda: f"group {group_name} has {group.size()} ranks, the op was given {world_size}",
    )
    if config.implementation == "reference" or not _symmetric_memory_usable(group):
        return reference(*args)
    early = _baseline_at_first_calls(fast_key, variants[choose.BASELINE], device)
    if early is not None:
        _remember(fast_key, early)
        return early(*args)
    calls = variant_calls(kind, fast_key, variants)
    key = choose.shape_key(kind, world_size, shapes, dtype)
    name = choose.choose(key, calls, args, group, device)
    if name == choose.TRIAL:  # the key's measurement runs over its calls: this call is a step
        _TRIED.setdefault((group_name, key), set()).add(fast_key)
        return choose.trial_call(key, calls, group, device, *args)  # not kept: the next call comes back
    try:
        result = calls[name](*args)
    except choose.refusals() as error:
        if name == choose.BASELINE:
            raise
        choose.tell_refused(name, error)
        name = choose.BASELINE
        result = calls[name](*args)
    # the graphs the variants not chosen captured here, and those of the trial's other signatures
    tried = _TRIED.pop((group_name, key), set()) - {fast_key}
    replay.forget((fast_key, other) for other in calls if other != name)
    replay.forget((tried_key, other) for tried_key in tried for other in calls)
    # a capture's fallback is not a choice, nor one made for this call alone
    if not torch.cuda.is_current_stream_capturing() and not isinstance(name, choose.ForNow):
        _remember(fast_key, calls[name])
    return result


def all_gather_matmul(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=None, gathered_left=None, passengers=None,
):  # fmt: skip
    contract_with, gathered_left, passengers = contract_with or [], gathered_left or [], passengers or []
    fast_key = (
        agm.KIND, _signature(shard), gather_dim, world_size, group_name, return_gathered,
        tuple(_signature(m) for m in mat2s), tuple(_signature(b) for b in biases),
        tuple(_signature(o) for o in contract_with), tuple(gathered_left),
        tuple(_signature(p) for p in passengers), config.hot().implementation,
    )  # fmt: skip
    run = _resolved(fast_key)
    if run is not None:
        return run(
            shard, mat2s, biases, gather_dim % shard.dim(), world_size, group_name, return_gathered,
            contract_with, gathered_left, passengers,
        )  # fmt: skip
    dim = matmul_ops._check_all_gather_matmul(
        shard, mat2s, biases, gather_dim, world_size, contract_with, gathered_left, passengers
    )
    args = (
        shard, mat2s, biases, dim, world_size, group_name, return_gathered, contract_with, gathered_left, passengers,
    )  # fmt: skip
    contractions = [(o.shape[-1], left) for o, left in zip(contract_with, gathered_left)]
    shapes = all_gather_matmul_shapes(shard.shape, mat2s, biases, dim, contractions, _row_bytes(passengers))
    variants = _ag_variants(len(mat2s))
    reference = matmul_ops.all_gather_matmul_reference
    return _first_call(agm.KIND, fast_key, group_name, world_size, variants, shapes, shard.dtype, shard.device, args, reference)


def matmul_reduce_scatter(
    inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None
):
    if out_dtype == inputs[0].dtype:
        out_dtype = None  # one key, one choice for both spellings
    fast_key = (
        mrs.KIND, tuple(_signature(a) for a in inputs), tuple(_signature(m) for m in mat2s),
        _signature(bias), reduce_op, scatter_dim, world_size, group_name, out_dtype, config.hot().implementation,
    )  # fmt: skip
    run = _resolved(fast_key)
    if run is not None:
        dim = scatter_dim % inputs[0].dim()
        return run(inputs, mat2s, bias, reduce_op, dim, world_size, group_name, out_dtype)
    dim = matmul_ops._check_matmul_reduce_scatter(inputs, mat2s, bias, reduce_op, scatter_dim, world_size, out_dtype)
    args = (inputs, mat2s, bias, reduce_op, dim, world_size, group_name, out_dtype)
    shapes = matmul_reduce_scatter_shapes(
        [a.shape for a in inputs], mat2s, bias is not None, reduce_op, dim, out_dtype
    )
    variants = _rs_variants(len(inputs))
    reference, dtype, device = matmul_ops.matmul_reduce_scatter_reference, inputs[0].dtype, inputs[0].device
    return _first_call(mrs.KIND, fast_key, group_name, world_size, variants, shapes, dtype, device, args, reference)


def matmul_reduce_scatter_tail(
    inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype, tail_of, tail_with
):  # fmt: skip
    """The op with its tail matmuls (matmul_ops.py's ``.tail`` overload), chosen and replayed apart
    from the op alone: the tail changes what each variant hides."""
    if out_dtype == inputs[0].dtype:
        out_dtype = None
    fast_key = (
        mrs.TAIL_KIND, tuple(_signature(a) for a in inputs), tuple(_signature(m) for m in mat2s),
        _signature(bias), reduce_op, scatter_dim, world_size, group_name, out_dtype,
        tuple(tail_of), tuple(_signature(w) for w in tail_with), config.hot().implementation,
    )  # fmt: skip
    run = _resolved(fast_key)
    if run is not None:
        dim = scatter_dim % inputs[0].dim()
        return run(inputs, mat2s, bias, reduce_op, dim, world_size, group_name, out_dtype, tail_of, tail_with)
    dim = matmul_ops._check_matmul_reduce_scatter(inputs, mat2s, bias, reduce_op, scatter_dim, world_size, out_dtype)
    matmul_ops.check_tail_matmuls(inputs, tail_of, tail_with)
    args = (inputs, mat2s, bias, reduce_op, dim, world_size, group_name, out_dtype, tail_of, tail_with)
    shapes = matmul_reduce_scatter_shapes(
        [a.shape for a in inputs], mat2s, bias is not None, reduce_op, dim, out_dtype
    )
    # each tail matmul's input and columns: it contracts over the tokens, so the key changes
    # with the bucket alone and a neighbour's choice still applies
    shapes["tail"] = [[i, w.shape[-1]] for i, w in zip(tail_of, tail_with)]
    variants = _rs_tail_variants(len(inputs))
    reference, dtype, device = matmul_ops.matmul_reduce_scatter_tail_reference, inputs[0].dtype, inputs[0].device
    return _first_call(mrs.TAIL_KIND, fast_key, group_name, world_size, variants, shapes, dtype, device, args, reference)


def _scale_kind(scale: torch.Tensor) -> str:
    return "tensorwise" if scaled_ops.is_tensorwise(scale) else "rowwise"


def all_gather_scaled_matmul_shapes(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, out_dtype, use_fast_accum, passengers=()
) -> dict:  # fmt: skip
    """What the float8 all-gather's choice depends on: the bf16 op's keys, its scales (rowwise
    ones travel too; cuBLAS runs another kernel for rowwise weights), what the matmuls compute
    and the bytes of a row of each passenger (they travel too)."""
    shapes = all_gather_matmul_shapes(shard.shape, mat2s, biases, gather_dim, passengers=_row_bytes(passengers))
    shapes.update(
        scales=_scale_kind(shard_scale), weight_scales=",".join(_scale_kind(s) for s in mat2_scales),
        out_dtype=str(out_dtype), fast_accum=use_fast_accum,
    )  # fmt: skip
    return shapes


def scaled_matmul_reduce_scatter_shapes(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, mm_dtype, out_dtype, use_fast_accum
) -> dict:  # fmt: skip
    """What the float8 reduce-scatter's choice depends on (as all_gather_scaled_matmul_shapes)."""
    shapes = matmul_reduce_scatter_shapes(
        [a.shape for a in inputs], mat2s, bias is not None, reduce_op, scatter_dim, out_dtype
    )
    shapes.update(
        scales=_scale_kind(input_scales[0]), weight_scales=",".join(_scale_kind(s) for s in mat2_scales),
        mm_dtype=str(mm_dtype), fast_accum=use_fast_accum,
    )  # fmt: skip
    return shapes


def all_gather_scaled_matmul(
    shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, group_name, out_dtype,
    use_fast_accum=False, return_gathered=False, passengers=None,
):  # fmt: skip
    passengers = tuple(passengers or ())
    fast_key = (
        scaled.AG_KIND, _signature(shard), _signature(shard_scale), tuple(_signature(m) for m in mat2s),
        tuple(_signature(m) for m in mat2_scales), tuple(_signature(b) for b in biases), gather_dim,
        world_size, group_name, out_dtype, use_fast_accum, return_gathered,
        tuple(_signature(p) for p in passengers), config.hot().implementation,
    )  # fmt: skip
    run = _resolved(fast_key)
    if run is None:  # first call of these arguments: checked before anything indexes them
        scaled_ops._check_all_gather(
            shard, shard_scale, mat2s, mat2_scales, biases, gather_dim, world_size, out_dtype, passengers
        )
    args = (
        shard, shard_scale, mat2s, mat2_scales, biases, gather_dim % shard.dim(), world_size, group_name,
        out_dtype, use_fast_accum, return_gathered, passengers,
    )  # fmt: skip
    if run is not None:
        return run(*args)
    shapes = all_gather_scaled_matmul_shapes(
        shard, shard_scale, mat2s, mat2_scales, biases, args[5], out_dtype, use_fast_accum, passengers
    )
    variants = scaled.variants(scaled.AG_KIND)
    reference = scaled_ops.all_gather_scaled_matmul_reference
    return _first_call(scaled.AG_KIND, fast_key, group_name, world_size, variants, shapes, shard.dtype, shard.device, args, reference)


def scaled_matmul_reduce_scatter(
    inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, group_name,
    mm_dtype, out_dtype=None, use_fast_accum=False,
):  # fmt: skip
    if out_dtype == mm_dtype:
        out_dtype = None  # one key, one choice for both spellings
    fast_key = (
        scaled.RS_KIND, tuple(_signature(a) for a in inputs), tuple(_signature(s) for s in input_scales),
        tuple(_signature(m) for m in mat2s), tuple(_signature(m) for m in mat2_scales), _signature(bias),
        reduce_op, scatter_dim, world_size, group_name, mm_dtype, out_dtype, use_fast_accum,
        config.hot().implementation,
    )  # fmt: skip
    run = _resolved(fast_key)
    if run is None:  # first call of these arguments: checked before anything indexes them
        scaled_ops._check_reduce_scatter(
            inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim, world_size, mm_dtype, out_dtype
        )
    args = (
        inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, scatter_dim % inputs[0].dim(), world_size,
        group_name, mm_dtype, out_dtype, use_fast_accum,
    )  # fmt: skip
    if run is not None:
        return run(*args)
    shapes = scaled_matmul_reduce_scatter_shapes(
        inputs, input_scales, mat2s, mat2_scales, bias, reduce_op, args[6], mm_dtype, out_dtype, use_fast_accum
    )
    variants = scaled.variants(scaled.RS_KIND, len(inputs))
    reference, dtype, device = scaled_ops.scaled_matmul_reduce_scatter_reference, inputs[0].dtype, inputs[0].device
    return _first_call(scaled.RS_KIND, fast_key, group_name, world_size, variants, shapes, dtype, device, args, reference)


def all_reduce(inp, reduce_op, world_size, group_name):
    fast_key = (ar.KIND, _signature(inp), reduce_op, world_size, group_name, config.hot().implementation)
    run = _resolved(fast_key)
    args = (inp, reduce_op, world_size, group_name)
    if run is not None:
        return run(*args)
    matmul_ops.check(reduce_op in all_reduce_op.REDUCE_OPS, lambda: f"all_reduce: reduce_op {reduce_op!r}")
    if inp.numel() * inp.element_size() > config.small_all_reduce_bytes:  # (a symbolic size, grown)
        if not torch.cuda.is_current_stream_capturing():
            _remember(fast_key, ar.nccl)
        return ar.nccl(*args)
    shapes = {"elements": choose.token_bucket(inp.numel()), "reduce_op": reduce_op}
    reference = all_reduce_op.all_reduce_reference
    return _first_call(ar.KIND, fast_key, group_name, world_size, ar.variants(), shapes, inp.dtype, inp.device, args, reference)
