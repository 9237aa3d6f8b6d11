"""The one-shot all-reduce kernel under TRITON_INTERPRET=1 with simulated peers: every rank's
elements land in its slot of every rank with the epoch in its flag, and each rank's reduction
over the slots (rank order, fp32) equals the reduce op over ranks; a rank that never pushed is
named in the timeout words, not waited for forever."""

import pytest
import torch

pytest.importorskip("triton")

from overlap_pass.templates import all_reduce as ar  # noqa: E402

EPOCH = 7
SPIN_LIMIT = 50


def _world(world: int, numel: int, dtype: torch.dtype):
    """Each rank's data region (NaN-poisoned slots, flags at the previous epoch), the table of
    their addresses, and fresh random inputs."""
    gen = torch.Generator().manual_seed(numel + world)
    flag_bytes = ar.flag_bytes(world)
    regions = []
    for _ in range(world):
        region = torch.empty(flag_bytes + world * numel * dtype.itemsize, dtype=torch.uint8)
        region[:flag_bytes].view(torch.int32).fill_(EPOCH - 1)
        region[flag_bytes:].view(dtype).fill_(float("nan"))
        regions.append(region)
    table = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    inputs = [(torch.randn(numel, generator=gen) * 3).to(dtype) for _ in range(world)]
    return regions, table, inputs


def _launch(rank, world, x, out, table, timeouts, op, push, reduce):
    grid = (ar.programs(x.numel()),)
    ar.one_shot_all_reduce_kernel[grid](
        x, out, table, torch.tensor([EPOCH], dtype=torch.int32), timeouts, x.numel(), rank, world,
        OP=ar.OPS[op], FLAG_BYTES=ar.flag_bytes(world), SPIN_LIMIT=SPIN_LIMIT, BLOCK=ar.BLOCK,
        PUSH=push, REDUCE=reduce, num_warps=ar.NUM_WARPS,
    )  # fmt: skip


def _expected(inputs, op, world):
    stacked = torch.stack([x.double() for x in inputs])
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    total = torch.zeros_like(inputs[0], dtype=torch.float64)
    for x in inputs:  # the kernel's order
        total += x.double()
    return total / world if op == "avg" else total


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize(
    "world, numel, dtype",
    [(2, 1, torch.float32), (3, 1000, torch.bfloat16), (4, 2 * ar.BLOCK + 17, torch.float32), (2, 300, torch.float64)],
)
def test_every_rank_gets_the_reduce_over_ranks(op, world, numel, dtype):
    regions, table, inputs = _world(world, numel, dtype)
    timeouts = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    outs = [torch.full((numel,), float("nan"), dtype=dtype) for _ in range(world)]
    for rank in range(world):
        _launch(rank, world, inputs[rank], outs[rank], table, timeouts[rank], op, True, False)
    flag_bytes = ar.flag_bytes(world)
    used = ar.programs(numel)
    for region in regions:
        slots = region[flag_bytes:].view(dtype).view(world, numel)
        for rank in range(world):  # each rank's elements, in its slot, bit for bit
            assert torch.equal(slots[rank], inputs[rank])
        flags = region[:flag_bytes].view(torch.int32)[: ar.MAX_PROGRAMS * world].view(ar.MAX_PROGRAMS, world)
        assert (flags[:used] == EPOCH).all() and (flags[used:] == EPOCH - 1).all()
    for rank in range(world):
        _launch(rank, world, inputs[rank], outs[rank], table, timeouts[rank], op, False, True)
    want = _expected(inputs, op, world)
    for rank in range(world):
        assert not timeouts[rank].any()
        tol = 0 if op in ("max", "min") else (2e-2 if dtype == torch.bfloat16 else 1e-6)
        torch.testing.assert_close(outs[rank].double(), want.to(dtype).double(), atol=tol, rtol=tol)
        assert torch.equal(outs[rank], outs[0]), "every rank holds the same bits"


def test_a_rank_that_never_pushed_is_named():
    world, numel = 3, 100
    regions, table, inputs = _world(world, numel, torch.float32)
    timeouts = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    outs = [torch.empty(numel) for _ in range(world)]
    for rank in (0, 2):  # rank 1 is absent
        _launch(rank, world, inputs[rank], outs[rank], table, timeouts[rank], "sum", True, False)
    for rank in (0, 2):
        _launch(rank, world, inputs[rank], outs[rank], table, timeouts[rank], "sum", False, True)
        assert timeouts[rank].tolist() == [0, EPOCH, 0]
