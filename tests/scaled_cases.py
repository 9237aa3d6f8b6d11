"""Per-rank bodies of the GPU tests of the float8 ops (lowering/scaled.py) on NCCL ranks: calls
through the op that replay per-call CUDA graphs (lowering/replay.py), tensorwise and rowwise,
batch 1 and 4 sequence-parallel shards. References are the dequantized products in fp32, every
rank's operands regenerated from its seed (no collective between the calls under test)."""

import torch
import torch.distributed as dist

from tests.gpu_common import calls_that_replay, group_name

FP8 = torch.float8_e4m3fn
K, N = 256, 384
# (batch, tokens per rank, rowwise): a [batch, seq, dim] shard gathered or scattered along seq
CASES = [(1, 96, False), (1, 96, True), (4, 64, True), (4, 64, False)]


def _gen(seed: int, rank: int | None = None) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed * 1000 + (997 if rank is None else rank))


def _float8(shape, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device="cuda").to(FP8)


def _scale(shape, gen) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device="cuda") + 0.25


def _operand(shape, rowwise, gen):
    """Float8 rows and their scale: one per row ([..., 1]) or one for all."""
    return _float8(shape, gen), _scale((*shape[:-1], 1) if rowwise else (), gen)


def _weight(rowwise, seed):
    """A linear's float8 weight ([N, K], used transposed) and its scale, equal on every rank."""
    gen = _gen(seed)
    return _float8((N, K), gen).t(), _scale((1, N) if rowwise else (), gen)


def _dequantized(data, scale) -> torch.Tensor:
    return data.float() * scale


def _gather_problem(batch, rows, rowwise, seed, rank):
    shard, scale = _operand((batch, rows, K), rowwise, _gen(seed, rank))
    if not rowwise:  # tensorwise: one scale for the whole gathered tensor, equal on every rank
        scale = _scale((), _gen(seed + 700))
    passenger = torch.randn(batch, rows, 24, generator=_gen(seed + 500, rank), device="cuda").bfloat16()
    return shard, scale, passenger


def all_gather_replayed(calls: int, seed: int = 0) -> int:
    """all_gather_scaled_matmul, its gathered float8 shard and a bf16 passenger returned too,
    through calls_that_replay. Returns the graphs this rank captured."""
    world, rank, captured = dist.get_world_size(), dist.get_rank(), 0
    for batch, rows, rowwise in CASES:

        def problem(s, batch=batch, rows=rows, rowwise=rowwise):
            return [*_gather_problem(batch, rows, rowwise, seed + s, rank), *_weight(rowwise, seed + s)]

        def run(tensors):
            shard, scale, passenger, mat2, mat2_scale = tensors
            gathered, (out,), (rider,) = torch.ops.overlap.all_gather_scaled_matmul(
                shard, scale, [mat2], [mat2_scale], [None], 1, world, group_name(), torch.bfloat16,
                return_gathered=True, passengers=[passenger],
            )  # fmt: skip
            return [gathered, out, rider]

        def reference(s, batch=batch, rows=rows, rowwise=rowwise):
            parts = [_gather_problem(batch, rows, rowwise, seed + s, r) for r in range(world)]
            gathered = torch.cat([p[0] for p in parts], dim=1)
            scale = torch.cat([p[1] for p in parts], dim=1) if rowwise else parts[rank][1]
            mat2, mat2_scale = _weight(rowwise, seed + s)
            out = _dequantized(gathered, scale) @ _dequantized(mat2, mat2_scale)
            return [gathered.float(), out, torch.cat([p[2] for p in parts], dim=1).float()]

        captured += calls_that_replay(calls, ("fused", "copy_engine_cublas"), problem, run, reference)
    return captured


def reduce_scatter_replayed(calls: int, seed: int = 0) -> int:
    """scaled_matmul_reduce_scatter through calls_that_replay, scattered along seq. Returns the
    graphs this rank captured."""
    world, rank, captured = dist.get_world_size(), dist.get_rank(), 0
    for batch, rows, rowwise in CASES:

        def problem(s, batch=batch, rows=rows, rowwise=rowwise, r=rank):
            return [*_operand((batch, rows * world, K), rowwise, _gen(seed + s, r)), *_weight(rowwise, seed + s)]

        def run(tensors):
            a, scale, mat2, mat2_scale = tensors
            out = torch.ops.overlap.scaled_matmul_reduce_scatter(
                [a], [scale], [mat2], [mat2_scale], None, "sum", 1, world, group_name(), torch.bfloat16
            )
            return [out]

        def reference(s, rows=rows):
            full = sum(
                _dequantized(*tensors[:2]) @ _dequantized(*tensors[2:])
                for tensors in (problem(s, r=r) for r in range(world))
            )
            return [full[:, rank * rows : (rank + 1) * rows]]

        captured += calls_that_replay(calls, ("fused", "copy_engine_cublas"), problem, run, reference)
    return captured
