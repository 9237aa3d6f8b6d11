"""Bodies of the eager op tests, run on every rank of a RankPool (gloo on CPU, NCCL on GPUs):
the ops against torch.distributed's own all_gather / all_reduce on fresh random inputs."""

import torch
import torch.distributed as dist

import overlap_pass  # noqa: F401

# ||out - ref|| / ||ref||: float32 sums in another order, bf16 rounds the matmul and the sum
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert err <= REL_TOL[out.dtype], f"{what}: relative error {err:.2e}"


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


def back_to_back_calls(calls: int = 6, seed: int = 0, device: str = "cpu", dtype=torch.float32) -> int:
    """Varying shapes, dims, several mat2s, biases, sum and avg, call after call."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)  # shapes agree across ranks, data does not
    torch.manual_seed(seed + 17 * rank)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    randn = lambda *shape: torch.randn(*shape, dtype=dtype).to(device)  # noqa: E731
    for call in range(calls):
        rows = [int(r) for r in torch.randint(1, 5, (2,), generator=gen)]
        k = int(torch.randint(1, 9, (1,), generator=gen))
        dim = call % 2
        shard = randn(*rows, k)
        mat2s = [randn(k, 3), randn(5, k).t()]
        biases = [randn(3), None]
        gathered, outs = torch.ops.overlap.all_gather_matmul(
            shard, mat2s, biases, dim, world, group, return_gathered=True
        )
        expected = _all_gather(shard, dim)
        assert torch.equal(gathered, expected)
        for out, mat2, bias in zip(outs, mat2s, biases):
            ref = expected @ mat2 + (0 if bias is None else bias)
            _close(out, ref, f"all_gather_matmul call {call}")
            assert out.is_contiguous()

        a = randn(*[r * world if i == dim else r for i, r in enumerate(rows)], k)
        a2 = randn(*a.shape)
        b = randn(3, k).t()  # non-contiguous mat2
        bias = randn(3)
        reduce_op = ("sum", "avg")[call % 2]
        out = torch.ops.overlap.matmul_reduce_scatter([a, a2], [b, b], bias, reduce_op, dim, world, group)
        full = (a.float() @ b.float() + a2.float() @ b.float() + bias.float()).to(dtype)
        _close(out, _reduce_scatter(full, dim, reduce_op), f"matmul_reduce_scatter call {call}")
        assert out.is_contiguous()
    return calls


def deterministic_reduce_scatter(seed: int = 0, device: str = "cpu") -> bool:
    """The same inputs give bit-identical outputs, call after call."""
    world = dist.get_world_size()
    torch.manual_seed(seed + dist.get_rank())
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    a, b = torch.randn(4 * world, 64, device=device), torch.randn(64, 32, device=device)
    args = ([a], [b], None, "sum", 0, world, dist.group.WORLD.group_name)
    first = torch.ops.overlap.matmul_reduce_scatter(*args)
    return all(torch.equal(first, torch.ops.overlap.matmul_reduce_scatter(*args)) for _ in range(3))


def widened_reduce_scatter(seed: int = 0, device: str = "cpu") -> bool:
    """bf16 inputs with out_dtype=float32: an fp32 result within bf16's rounding of the exact
    one, and exactly the bf16 result before its last rounding (the same partials and sum)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed + rank)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    a1, a2 = torch.randn(3 * world, 16, device=device), torch.randn(3 * world, 8, device=device)
    shared = torch.Generator().manual_seed(seed)
    b1, b2 = torch.randn(16, 5, generator=shared).to(device), torch.randn(8, 5, generator=shared).to(device)
    args = ([a1.bfloat16(), a2.bfloat16()], [b1.bfloat16(), b2.bfloat16()], None, "avg", 0, world)
    wide = torch.ops.overlap.matmul_reduce_scatter(*args, dist.group.WORLD.group_name, torch.float32)
    narrow = torch.ops.overlap.matmul_reduce_scatter(*args, dist.group.WORLD.group_name)
    exact = _reduce_scatter(a1 @ b1 + a2 @ b2, 0, "avg")
    err = ((wide - exact).norm() / exact.norm()).item()
    unrounded = torch.equal(wide.bfloat16(), narrow)
    return wide.dtype == torch.float32 and err <= REL_TOL[torch.bfloat16] and unrounded


def nccl_gather_in_order() -> bool:
    """lowering's NCCL-variant gather (any backend's all_gather_into_tensor): a [batch, seq, dim]
    shard gathered along seq, in bf16 and as float8 bytes, equals the shards concatenated."""
    from overlap_pass.lowering import all_gather_matmul as agm

    gen = torch.Generator().manual_seed(11)
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = [torch.randn(2, 3, 8, generator=gen) for _ in range(world)]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for dim, parts in ((1, shards), (0, [s[0] for s in shards])):
            want = torch.cat([p.to(dtype) for p in parts], dim).view(torch.uint8)  # bytes: float8 has no equal
            got = agm.nccl_gather(parts[rank].to(dtype), dim, world, dist.group.WORLD.group_name)
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want), (dtype, dim)
    return True


def nccl_reduce_scatter_as_reference() -> bool:
    """lowering's NCCL + cuBLAS reduce-scatter (the variant a call signature's first calls run)
    against the reference decomposition: scattered along the sequence of [batch, seq, K] inputs
    (batch 1 and 2: ranks' rows in one block, and in blocks per sequence), along rows, a sum of
    two matmuls with a bias, a sum and an average, and fp32 out of bf16 partials."""
    from overlap_pass.ops import matmul_ops
    from overlap_pass.lowering import matmul_reduce_scatter as mrs

    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    torch.manual_seed(5 + dist.get_rank())  # every rank's partials differ
    shared = torch.Generator().manual_seed(5)
    mat2s = [torch.randn(16, 8, generator=shared), torch.randn(12, 8, generator=shared)]
    bias = torch.randn(8, generator=shared)
    cases = [
        (dict(shape=(1, 3 * world), scatter_dim=1), 1, None, "sum", None),
        (dict(shape=(2, 2 * world), scatter_dim=1), 2, bias, "avg", None),
        (dict(shape=(3 * world,), scatter_dim=0), 1, None, "sum", None),
        (dict(shape=(2, 2 * world), scatter_dim=1), 1, None, "sum", torch.float32),
    ]
    for layout, matmuls, bias_, reduce_op, out_dtype in cases:
        dtype = torch.float32 if out_dtype is None else torch.bfloat16
        inputs = [torch.randn(*layout["shape"], m.shape[0]).to(dtype) for m in mat2s[:matmuls]]
        weights = [m.to(dtype) for m in mat2s[:matmuls]]
        b = None if bias_ is None else bias_.to(dtype)
        args = (inputs, weights, b, reduce_op, layout["scatter_dim"], world, group, out_dtype)
        got = mrs.nccl_cublas(*args)
        want = matmul_ops.matmul_reduce_scatter_reference(*args)
        _close(got, want, f"{layout} x{matmuls} {reduce_op} {out_dtype}")
    return True


def scaled_gather_with_passengers(seed: int = 0, device: str = "cpu") -> bool:
    """all_gather_scaled_matmul with passengers (float8 and bf16 shards of the shard's rows),
    rowwise and tensorwise, gathered along seq and along batch: every passenger arrives bit for
    bit as torch.distributed gathers it, the matmuls as _scaled_mm on the gathered rows."""
    from overlap_pass.ops import scaled_ops

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    torch.manual_seed(seed + 31 * rank)  # every rank's data differs
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    fp8 = torch.float8_e4m3fn
    shared = torch.Generator().manual_seed(seed)
    mat2 = torch.randn(8, 16, generator=shared).to(fp8).to(device).t()  # a linear's weight, column-major
    for rowwise in (False, True):
        for dim in (1, 0):
            shard = torch.randn(2, 3, 16).to(fp8).to(device)
            scale = (torch.rand(2, 3, 1) if rowwise else torch.rand(())).add(0.25).to(device)
            mat2_scale = (torch.rand(1, 8, generator=shared) if rowwise else torch.rand((), generator=shared)).to(device)
            riders = [torch.randn(2, 3, 16).to(fp8).to(device), torch.randn(2, 3, 5).bfloat16().to(device)]
            gathered, outs, got = torch.ops.overlap.all_gather_scaled_matmul(
                shard, scale, [mat2], [mat2_scale], [None], dim, world, group, torch.bfloat16,
                return_gathered=True, passengers=riders,
            )  # fmt: skip
            as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
            assert torch.equal(as_bytes(gathered), as_bytes(_all_gather(as_bytes(shard), dim)))
            for rider, out in zip(riders, got):
                assert out.dtype == rider.dtype and torch.equal(as_bytes(out), _all_gather(as_bytes(rider), dim))
            rows_scale = _all_gather(scale, dim) if rowwise else scale
            ref = scaled_ops.scaled_mm_rows(gathered, rows_scale, mat2, mat2_scale, None, torch.bfloat16, False)
            assert torch.equal(outs[0], ref), (rowwise, dim)
    return True


def gather_with_passengers(seed: int = 0, device: str = "cpu", dtype=torch.float32) -> bool:
    """all_gather_matmul with passengers (a norm's [rows, 1] fp32 rsqrt and a wider shard of the
    same rows, plain TP's saved activations), after a matmul and a contraction, gathered along
    seq and along batch, the gathered shard returned: each passenger arrives bit for bit as
    torch.distributed gathers it, after the matmul's and the contraction's outputs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    torch.manual_seed(seed + 31 * rank)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    shared = torch.Generator().manual_seed(seed)
    mat2 = torch.randn(16, 8, generator=shared).to(device, dtype)
    for dim in (1, 0):
        shard = torch.randn(2, 3, 16).to(device, dtype)
        rows = 2 * 3 * world
        other = torch.randn(rows, 4, generator=shared).to(device, dtype)  # the same on every rank
        riders = [torch.rand(2, 3, 1).to(device), torch.randn(2, 3, 5).to(device, dtype)]
        gathered, outs = torch.ops.overlap.all_gather_matmul(
            shard, [mat2], [None], dim, world, group, True, [other], [True], riders
        )
        assert len(outs) == 4
        full = _all_gather(shard, dim)
        assert torch.equal(gathered, full)
        _close(outs[0], full @ mat2, "matmul")
        _close(outs[1], full.reshape(rows, 16).t() @ other, "contraction")
        for rider, out in zip(riders, outs[2:]):
            assert out.dtype == rider.dtype and torch.equal(out, _all_gather(rider, dim)), dim
    return True


def measured_over_calls(calls: int = 90, seed: int = 0, dtype=torch.bfloat16) -> dict:
    """config.measure_over_calls on NCCL ranks: ``calls`` calls of one all-gather and one
    reduce-scatter shape, fresh inputs each, every result checked against torch.distributed's;
    their keys' trials run their steps on these calls and choose. Returns the choices made
    (name, source, times) and the calls checked."""
    import tempfile

    from overlap_pass import config
    from overlap_pass.lowering import choose

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(seed + 17 * rank)
    randn = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    weight = torch.randn(768, 512, dtype=dtype, generator=torch.Generator().manual_seed(seed)).to(device)
    before = set(choose.CHOICES)
    patches = {"measure_over_calls": True, "fused_from_call": 1, "implementation": "auto"}
    with tempfile.TemporaryDirectory() as folder, config.patch(choice_cache=f"{folder}/choices.json", **patches):
        for call in range(calls):
            shard = randn(256, 512)
            _, (out,) = torch.ops.overlap.all_gather_matmul(shard, [weight.t()], [None], 0, world, group)
            _close(out, _all_gather(shard, 0) @ weight.t(), f"all_gather_matmul call {call}")
            a = randn(256 * world, 768)
            scattered = torch.ops.overlap.matmul_reduce_scatter([a], [weight], None, "sum", 0, world, group)
            expected = _reduce_scatter((a.float() @ weight.float()).to(dtype), 0, "sum")
            _close(scattered, expected, f"matmul_reduce_scatter call {call}")
    made = {k: v for k, v in choose.CHOICES.items() if k not in before}
    return {"calls": calls, "choices": made, "trials_left": len(choose._TRIALS)}
