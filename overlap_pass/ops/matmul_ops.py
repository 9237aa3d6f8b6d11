"""overlap::all_gather_matmul and overlap::matmul_reduce_scatter: schemas, fake kernels and the
reference decomposition.

    all_gather_matmul:      A = all_gather(shard, gather_dim);  out[i] = A @ mat2s[i] + biases[i]
                            then, over A's M rows (the gathered dim is contracted):
                            out[len(mat2s) + j] = A^T @ contract_with[j]   (gathered_left[j])
                                                  contract_with[j]^T @ A   (otherwise)
                            then each passenger (a shard of the same rows that no matmul
                            reads, passengers.py), gathered as the shard is:
                            out[len(mat2s) + len(contract_with) + p] = all_gather(passengers[p])
    matmul_reduce_scatter:  out = reduce_scatter(sum_i inputs[i] @ mat2s[i] + bias, scatter_dim)
                            each rank's partial (the sum) in the inputs' dtype, the reduction over
                            ranks in fp32, ``out`` in ``out_dtype`` (default: the inputs' dtype)
    matmul_reduce_scatter.tail: the same, and
                            tail[j] = rows(inputs[tail_of[j]])^T @ rows(tail_with[j])
                            (rows: [-1, last dim]), contractions over the tokens: the weight
                            gradients of the op's own linears (regions/tail_matmuls.py), run
                            while the partials travel

Matmuls contract the last dim of A (or inputs[i]) with dim 0 of mat2 ([K, N]); the gathered or
scattered dim is any other dim. The contractions are a column-parallel linear's weight gradient
(A the gathered input, contract_with the output gradient) and a row-parallel one's (A the gathered
output gradient): A flattened to [M, D] rows, contract_with[j] given as [M, K_j] in the same row
order. All outputs are contiguous, as eager's would be.

The reference implementation is the decomposed algorithm itself, on torch.distributed point-to-
point ops, so it runs on gloo and NCCL alike: per-rank chunks in the order of schedule.py, the
local chunk first, each chunk's matmul as soon as its data is there. CUDA tensors run the
variants of lowering/dispatch.py instead (symmetric memory, fused kernels), which falls back to
this decomposition for groups without NCCL.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from . import schedule

REDUCE_OPS = ("sum", "avg")

SCHEMAS = {
    "all_gather_matmul": (
        "(Tensor shard, Tensor[] mat2s, Tensor?[] biases, int gather_dim, "
        "int world_size, str group_name, bool return_gathered=False, "
        "Tensor[]? contract_with=None, bool[]? gathered_left=None, Tensor[]? passengers=None) "
        "-> (Tensor?, Tensor[])"
    ),
    "matmul_reduce_scatter": (
        "(Tensor[] inputs, Tensor[] mat2s, Tensor? bias, str reduce_op, "
        "int scatter_dim, int world_size, str group_name, ScalarType? out_dtype=None) -> Tensor"
    ),
    "matmul_reduce_scatter.tail": (
        "(Tensor[] inputs, Tensor[] mat2s, Tensor? bias, str reduce_op, int scatter_dim, "
        "int world_size, str group_name, ScalarType? out_dtype, int[] tail_of, Tensor[] tail_with) "
        "-> (Tensor, Tensor[])"
    ),
}


# ---------------------------------------------------------------------------------------------
# Shapes, shared by the fake kernels and the reference


def check(cond, message) -> None:
    """torch._check(cond, message), returning at once on a concrete True: the argument checks
    run on the host at every new call signature (each token count's first call), where
    torch._check costs microseconds a check; a symbolic condition still becomes a runtime
    assert of the traced graph."""
    if cond is not True:
        torch._check(cond, message)


def _gathered_shape(shard: torch.Tensor, gather_dim: int, world_size: int) -> list[int]:
    shape = list(shard.shape)
    shape[gather_dim] *= world_size
    return shape


def _scattered_shape(full: list[int], scatter_dim: int, world_size: int) -> list[int]:
    shape = list(full)
    shape[scatter_dim] //= world_size
    return shape


def _contracted_shape(gathered_shape, other, left: bool) -> list[int]:
    return [gathered_shape[-1], other.shape[-1]] if left else [other.shape[-1], gathered_shape[-1]]


def _check_all_gather_matmul(
    shard, mat2s, biases, gather_dim, world_size, contract_with=(), gathered_left=(), passengers=()
) -> int:
    """Validates arguments; returns gather_dim normalized to a non-negative dim."""
    check_passengers(shard, passengers)
    check(
        len(mat2s) + len(contract_with) > 0,
        lambda: "all_gather_matmul needs at least one mat2 or contract_with operand",
    )
    check(
        len(gathered_left) == len(contract_with),
        lambda: f"{len(gathered_left)} gathered_left flags for {len(contract_with)} contract_with",
    )
    check(
        len(biases) == len(mat2s),
        lambda: f"all_gather_matmul: {len(biases)} biases for {len(mat2s)} mat2s",
    )
    check(shard.dim() >= 2, lambda: f"shard must be at least 2-D, got {shard.dim()}-D")
    dim = gather_dim % shard.dim()
    check(
        dim != shard.dim() - 1,
        lambda: "gather_dim is the contraction dim (K); only leading dims can be gathered",
    )
    for mat2, bias in zip(mat2s, biases):
        check(
            mat2.dim() == 2 and mat2.shape[0] == shard.shape[-1],
            lambda: f"mat2 of shape {list(mat2.shape)} does not match K={shard.shape[-1]}",
        )
        check(mat2.dtype == shard.dtype, lambda: "mat2 dtype differs from shard dtype")
        if bias is not None:
            check(
                bias.dim() == 1 and bias.shape[0] == mat2.shape[1],
                lambda: f"bias of shape {list(bias.shape)} does not match N={mat2.shape[1]}",
            )
    check(world_size >= 1, lambda: f"world_size must be positive, got {world_size}")
    rows = math.prod(_gathered_shape(shard, dim, world_size)[:-1])
    for other in contract_with:
        check(
            other.dim() == 2 and other.shape[0] == rows,
            lambda: f"contract_with of shape {list(other.shape)} is not [{rows} gathered rows, K]",
        )
        check(other.dtype == shard.dtype, lambda: "contract_with dtype differs from shard dtype")
    return dim


def check_passengers(shard, passengers) -> None:
    """Passengers are gathered with the shard's chunks: the same rows (leading dims)."""
    for passenger in passengers:
        check(
            passenger.dim() == shard.dim() and passenger.shape[:-1] == shard.shape[:-1],
            lambda: f"passenger of shape {list(passenger.shape)} does not have the rows of the shard {list(shard.shape)}",
        )


def gathered_passengers(passengers, gather_dim: int, world_size: int) -> list[torch.Tensor]:
    """Each passenger's gathered tensor, empty."""
    return [p.new_empty(_gathered_shape(p, gather_dim, world_size)) for p in passengers]


def _check_matmul_reduce_scatter(
    inputs, mat2s, bias, reduce_op, scatter_dim, world_size, out_dtype=None
) -> int:
    """Validates arguments; returns scatter_dim normalized to a non-negative dim."""
    check(len(inputs) > 0, lambda: "matmul_reduce_scatter needs at least one input")
    check(
        out_dtype in (None, inputs[0].dtype, torch.float32),
        lambda: f"out_dtype must be the inputs' dtype or float32 (the reduction's), got {out_dtype}",
    )
    check(len(inputs) == len(mat2s), lambda: "one mat2 per input")
    check(reduce_op in REDUCE_OPS, lambda: f"reduce_op must be one of {REDUCE_OPS}")
    first = inputs[0]
    check(first.dim() >= 2, lambda: f"inputs must be at least 2-D, got {first.dim()}-D")
    dim = scatter_dim % first.dim()
    check(
        dim != first.dim() - 1, lambda: "scatter_dim must be a leading dim, not the output's N"
    )
    n = mat2s[0].shape[1]
    for a, mat2 in zip(inputs, mat2s):
        check(
            a.shape[:-1] == first.shape[:-1], lambda: "all inputs must share their leading dims"
        )
        check(
            mat2.dim() == 2 and mat2.shape[0] == a.shape[-1] and mat2.shape[1] == n,
            lambda: f"mat2 of shape {list(mat2.shape)} does not match input {list(a.shape)}",
        )
    check(
        first.shape[dim] % world_size == 0,
        lambda: f"scatter dim size {first.shape[dim]} is not divisible by world size {world_size}",
    )
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == n, lambda: "bias must be 1-D of size N")
    return dim


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def tail_operands(inputs, tail_of, tail_with) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(left, right) of each tail matmul: the rows of the op's input ``tail_of[j]`` transposed,
    and the rows of ``tail_with[j]``. Given by index, the input is the op's own: Inductor stores
    each argument of an op apart, and a second view of an input was stored a second time."""
    return [(_rows(inputs[i]).t(), _rows(w)) for i, w in zip(tail_of, tail_with)]


def check_tail_matmuls(inputs, tail_of, tail_with) -> None:
    check(len(tail_of) == len(tail_with), lambda: "one tensor per tail matmul")
    for i, w in zip(tail_of, tail_with):
        check(0 <= i < len(inputs), lambda: f"tail_of {i}: the op has {len(inputs)} inputs")
        a = inputs[i]
        check(
            w.dim() >= 2 and math.prod(w.shape[:-1]) == math.prod(a.shape[:-1]) and w.dtype == a.dtype,
            lambda: f"a tail matmul contracts input {i} {list(a.shape)} ({a.dtype}) with {list(w.shape)} "
            f"({w.dtype}) over their rows",
        )


# ---------------------------------------------------------------------------------------------
# Fake kernels


def _all_gather_matmul_fake(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=None, gathered_left=None, passengers=None,
):  # fmt: skip
    contract_with, gathered_left, passengers = contract_with or [], gathered_left or [], passengers or []
    dim = _check_all_gather_matmul(
        shard, mat2s, biases, gather_dim, world_size, contract_with, gathered_left, passengers
    )
    gathered_shape = _gathered_shape(shard, dim, world_size)
    outputs = [shard.new_empty(gathered_shape[:-1] + [mat2.shape[1]]) for mat2 in mat2s]
    outputs += [
        shard.new_empty(_contracted_shape(gathered_shape, other, left))
        for other, left in zip(contract_with, gathered_left)
    ]
    gathered = shard.new_empty(gathered_shape) if return_gathered else None
    return gathered, outputs + gathered_passengers(passengers, dim, world_size)


def _matmul_reduce_scatter_fake(
    inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None
):
    dim = _check_matmul_reduce_scatter(
        inputs, mat2s, bias, reduce_op, scatter_dim, world_size, out_dtype
    )
    full = list(inputs[0].shape[:-1]) + [mat2s[0].shape[1]]
    return inputs[0].new_empty(
        _scattered_shape(full, dim, world_size), dtype=out_dtype or inputs[0].dtype
    )


def _matmul_reduce_scatter_tail_fake(*args):
    *op_args, tail_of, tail_with = args
    inputs = op_args[0]
    check_tail_matmuls(inputs, tail_of, tail_with)
    tail = [a.new_empty(a.shape[0], b.shape[1]) for a, b in tail_operands(inputs, tail_of, tail_with)]
    return _matmul_reduce_scatter_fake(*op_args), tail


# ---------------------------------------------------------------------------------------------
# Reference decomposition


def _global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def _exchange(group, send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int):
    """Posts one send and one receive as a batch (so NCCL cannot deadlock on the pair);
    returns the works to wait on."""
    ops = [
        dist.P2POp(dist.isend, send, _global_rank(group, send_to), group),
        dist.P2POp(dist.irecv, recv, _global_rank(group, recv_from), group),
    ]
    return dist.batch_isend_irecv(ops)


def post_all_gather(group, shard: torch.Tensor):
    """Posts every transfer of a rank-rotated all-gather of ``shard`` up front; returns
    ``received(src)``, which waits for rank src's chunk only. Bytes move as uint8, so float8
    travels on backends without float8 (gloo)."""
    rank, world_size = group.rank(), group.size()
    raw = shard.view(torch.uint8) if shard.dtype.itemsize == 1 else shard
    buffers, works = {rank: shard}, {}
    for step in range(1, world_size):
        send_to, recv_from = schedule.all_gather_peers(rank, world_size, step)
        buffers[recv_from] = torch.empty_like(shard)
        into = buffers[recv_from].view(torch.uint8) if raw is not shard else buffers[recv_from]
        works[recv_from] = _exchange(group, raw, send_to, into, recv_from)

    def received(src: int) -> torch.Tensor:
        for work in works.pop(src, ()):
            work.wait()
        return buffers[src]

    return received


def reduce_scatter_partials(group, partial, reduce_op: str, out_dtype=None) -> torch.Tensor:
    """Rank-rotated reduce-scatter of the partials ``partial(index)`` (this rank's partial of
    rank index's chunk), each sent to its owner as soon as it exists, the own one last; the
    owner sums all partials of its chunk in fp32, in rank order (deterministic)."""
    rank, world_size = group.rank(), group.size()
    partials, works = {}, []
    for step, dst in enumerate(schedule.reduce_scatter_order(rank, world_size), start=1):
        if dst == rank:
            partials[rank] = partial(rank)
            continue
        send_to, recv_from = schedule.reduce_scatter_peers(rank, world_size, step)
        mine = partial(dst)
        partials[recv_from] = torch.empty_like(mine)
        works += _exchange(group, mine, send_to, partials[recv_from], recv_from)
    for work in works:
        work.wait()

    total = torch.zeros_like(partials[rank], dtype=torch.float32)
    for src in range(world_size):
        total += partials[src]
    if reduce_op == "avg":
        total /= world_size
    return total.to(out_dtype or partials[rank].dtype)


def resolve_group(group_name: str, world_size: int):
    group = _resolve_process_group(group_name)
    check(
        group.size() == world_size,
        lambda: f"group {group_name} has {group.size()} ranks, the op was given {world_size}",
    )
    return group


def _as_gathered(other: torch.Tensor, gathered_shape) -> torch.Tensor:
    """contract_with's [M, K] rows in the gathered tensor's leading layout, so that one rank's
    chunk of it is schedule.chunk of the same dim."""
    return other.reshape(list(gathered_shape[:-1]) + [other.shape[-1]])


def _linear(a: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.matmul(a, mat2)
    return out if bias is None else out + bias


def all_gather_matmul_reference(
    shard, mat2s, biases, gather_dim, world_size, group_name, return_gathered=False,
    contract_with=None, gathered_left=None, passengers=None,
):  # fmt: skip
    """Rank-rotated all-gather on point-to-point ops, overlapped with per-chunk matmuls; the
    contractions over the gathered rows accumulate chunk by chunk, in fp32; the passengers'
    transfers posted after the shard's."""
    contract_with, gathered_left, passengers = contract_with or [], gathered_left or [], passengers or []
    dim = _check_all_gather_matmul(
        shard, mat2s, biases, gather_dim, world_size, contract_with, gathered_left, passengers
    )
    group = resolve_group(group_name, world_size)
    rank = group.rank()
    shard = shard.contiguous()
    gathered_shape = _gathered_shape(shard, dim, world_size)
    outputs = [shard.new_empty(gathered_shape[:-1] + [m.shape[1]]) for m in mat2s]
    gathered = shard.new_empty(gathered_shape) if return_gathered else None
    sums = [
        shard.new_zeros(_contracted_shape(gathered_shape, other, left), dtype=torch.float32)
        for other, left in zip(contract_with, gathered_left)
    ]

    received = post_all_gather(group, shard)
    riders = [post_all_gather(group, p.contiguous()) for p in passengers]
    for src in schedule.all_gather_order(rank, world_size):
        chunk = received(src)
        for out, mat2, bias in zip(outputs, mat2s, biases):
            schedule.chunk(out, dim, src, world_size).copy_(_linear(chunk, mat2, bias))
        if gathered is not None:
            schedule.chunk(gathered, dim, src, world_size).copy_(chunk)
        rows = chunk.reshape(-1, chunk.shape[-1]).float()
        for total, other, left in zip(sums, contract_with, gathered_left):
            theirs = schedule.chunk(_as_gathered(other, gathered_shape), dim, src, world_size)
            theirs = theirs.reshape(rows.shape[0], -1).float()
            total += rows.t() @ theirs if left else theirs.t() @ rows
    return gathered, outputs + [total.to(shard.dtype) for total in sums] + collect_passengers(riders, passengers, dim, world_size)


def collect_passengers(riders, passengers, gather_dim: int, world_size: int) -> list[torch.Tensor]:
    """The reference's gathered passengers: ``riders``, post_all_gather's ``received`` of each
    passenger, waited for chunk by chunk."""
    outs = gathered_passengers(passengers, gather_dim, world_size)
    for received, out in zip(riders, outs):
        for src in range(world_size):
            schedule.chunk(out, gather_dim, src, world_size).copy_(received(src))
    return outs


def matmul_reduce_scatter_reference(
    inputs, mat2s, bias, reduce_op, scatter_dim, world_size, group_name, out_dtype=None
):
    """Per-chunk matmuls, the chunk for rank + 1 first, each partial sent to its owner as soon as
    it exists; the owner sums all partials of its chunk in fp32, in rank order (deterministic)."""
    dim = _check_matmul_reduce_scatter(
        inputs, mat2s, bias, reduce_op, scatter_dim, world_size, out_dtype
    )
    group = resolve_group(group_name, world_size)

    def partial(index: int) -> torch.Tensor:
        acc = None
        for a, mat2 in zip(inputs, mat2s):
            term = torch.matmul(schedule.chunk(a, dim, index, world_size), mat2)
            acc = term if acc is None else acc + term
        return (acc if bias is None else acc + bias).contiguous()

    return reduce_scatter_partials(group, partial, reduce_op, out_dtype)


def matmul_reduce_scatter_tail_reference(*args):
    """The op, then its tail matmuls (on one stream, the order is all one could see)."""
    *op_args, tail_of, tail_with = args
    check_tail_matmuls(op_args[0], tail_of, tail_with)
    out = matmul_reduce_scatter_reference(*op_args)
    return out, [torch.mm(a, b) for a, b in tail_operands(op_args[0], tail_of, tail_with)]


# op name -> (fake kernel, reference): registry.py registers them
KERNELS = {
    "all_gather_matmul": (_all_gather_matmul_fake, all_gather_matmul_reference),
    "matmul_reduce_scatter": (_matmul_reduce_scatter_fake, matmul_reduce_scatter_reference),
    "matmul_reduce_scatter.tail": (_matmul_reduce_scatter_tail_fake, matmul_reduce_scatter_tail_reference),
}
