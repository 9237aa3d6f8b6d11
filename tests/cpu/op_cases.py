"""Bodies of the eager op tests on gloo ranks: the reference decomposition against
torch.distributed's own all_gather / all_reduce on fresh random inputs."""

import torch
import torch.distributed as dist

import overlap_pass  # noqa: F401

TOL = dict(atol=1e-5, rtol=1e-5)


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def _reduce_scatter(full: torch.Tensor, dim: int, reduce_op: str) -> torch.Tensor:
    total = full.clone()
    dist.all_reduce(total)
    if reduce_op == "avg":
        total /= dist.get_world_size()
    return total.chunk(dist.get_world_size(), dim)[dist.get_rank()]


def back_to_back_calls(calls: int = 6, seed: int = 0) -> int:
    """Varying shapes, dims, several mat2s, biases, sum and avg, call after call."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)  # shapes agree across ranks, data does not
    torch.manual_seed(seed + 17 * rank)
    for call in range(calls):
        rows = [int(r) for r in torch.randint(1, 5, (2,), generator=gen)]
        k = int(torch.randint(1, 9, (1,), generator=gen))
        dim = call % 2
        shard = torch.randn(*rows, k)
        mat2s = [torch.randn(k, 3), torch.randn(5, k).t()]
        biases = [torch.randn(3), None]
        gathered, outs = torch.ops.overlap.all_gather_matmul(
            shard, mat2s, biases, dim, world, group, return_gathered=True
        )
        expected = _all_gather(shard, dim)
        assert torch.equal(gathered, expected)
        for out, mat2, bias in zip(outs, mat2s, biases):
            ref = expected @ mat2 + (0 if bias is None else bias)
            torch.testing.assert_close(out, ref, **TOL)
            assert out.is_contiguous()

        a = torch.randn(*[r * world if i == dim else r for i, r in enumerate(rows)], k)
        b = torch.randn(3, k).t()  # non-contiguous mat2
        bias = torch.randn(3)
        reduce_op = ("sum", "avg")[call % 2]
        out = torch.ops.overlap.matmul_reduce_scatter([a, a * 2], [b, b], bias, reduce_op, dim, world, group)
        ref = _reduce_scatter(a @ b + (a * 2) @ b + bias, dim, reduce_op)
        torch.testing.assert_close(out, ref, **TOL)
        assert out.is_contiguous()
    return calls


def deterministic_reduce_scatter(seed: int = 0) -> bool:
    """The same inputs give bit-identical outputs, call after call."""
    world = dist.get_world_size()
    torch.manual_seed(seed + dist.get_rank())
    a, b = torch.randn(4 * world, 64), torch.randn(64, 32)
    args = ([a], [b], None, "sum", 0, world, dist.group.WORLD.group_name)
    first = torch.ops.overlap.matmul_reduce_scatter(*args)
    return all(torch.equal(first, torch.ops.overlap.matmul_reduce_scatter(*args)) for _ in range(3))
