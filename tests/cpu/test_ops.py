"""The overlap ops: schemas, fake kernels (shapes and strides as eager), argument checks, and
the reference decomposition on gloo ranks."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests import op_cases

from .fake_world import fake_world

agm = torch.ops.overlap.all_gather_matmul
mrs = torch.ops.overlap.matmul_reduce_scatter


@pytest.mark.parametrize("shape, dim", [((3, 8), 0), ((2, 3, 8), 1), ((2, 3, 4, 8), -2)])
@pytest.mark.parametrize("return_gathered", [False, True])
def test_fake_kernel_matches_reference_metadata(shape, dim, return_gathered):
    with fake_world(4) as group:
        args = lambda: (  # noqa: E731
            torch.randn(shape),
            [torch.randn(8, 5), torch.randn(6, 8).t()],
            [torch.randn(5), None],
            dim,
            4,
            group,
            return_gathered,
        )
        real = agm(*args())
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = agm(*args())
    flat = lambda r: [t for t in [r[0], *r[1]] if t is not None]  # noqa: E731
    assert (real[0] is None) == (not return_gathered) == (fake[0] is None)
    for r, f in zip(flat(real), flat(fake)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_reduce_scatter_fake_kernel_matches_reference_metadata(dim, dtype, out_dtype):
    with fake_world(4) as group:
        args = lambda: (  # noqa: E731
            [torch.randn(8, 8, 6, dtype=dtype)], [torch.randn(6, 5, dtype=dtype)], torch.randn(5, dtype=dtype),
            "avg", dim, 4, group, out_dtype,
        )  # fmt: skip
        real = mrs(*args())
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = mrs(*args())
    assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
    assert real.dtype == (out_dtype or dtype)


BAD_ALL_GATHER = [
    (dict(mat2s=[]), "at least one mat2"),
    (dict(biases=[]), "biases for 1 mat2s"),
    (dict(gather_dim=1), "contraction dim"),
    (dict(mat2s=[torch.randn(7, 5)]), "does not match K=8"),
    (dict(biases=[torch.randn(4)]), "does not match N=5"),
    (dict(mat2s=[torch.randn(8, 5, dtype=torch.float64)]), "dtype"),
]


@pytest.mark.parametrize("change, message", BAD_ALL_GATHER, ids=[m for _, m in BAD_ALL_GATHER])
def test_all_gather_matmul_rejects_bad_arguments(change, message):
    args = dict(
        shard=torch.randn(3, 8),
        mat2s=[torch.randn(8, 5)],
        biases=[None],
        gather_dim=0,
        world_size=2,
        group_name="unused",
    )
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        agm(**args)


BAD_REDUCE_SCATTER = [
    (dict(reduce_op="max"), "reduce_op must be one of"),
    (dict(scatter_dim=1), "leading dim"),
    (dict(inputs=[torch.randn(5, 8)]), "not divisible"),
    (dict(mat2s=[torch.randn(7, 5)]), "does not match input"),
    (dict(bias=torch.randn(2)), "bias must be 1-D of size N"),
    (dict(out_dtype=torch.float16), "out_dtype must be the inputs' dtype or float32"),
]


@pytest.mark.parametrize("change, message", BAD_REDUCE_SCATTER, ids=[m for _, m in BAD_REDUCE_SCATTER])
def test_matmul_reduce_scatter_rejects_bad_arguments(change, message):
    args = dict(
        inputs=[torch.randn(4, 8)],
        mat2s=[torch.randn(8, 5)],
        bias=None,
        reduce_op="sum",
        scatter_dim=0,
        world_size=2,
        group_name="unused",
    )
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        mrs(**args)


@pytest.mark.parametrize("world_size", [2, 3])
def test_reference_against_torch_distributed(gloo_world, world_size):
    assert gloo_world(world_size).run(op_cases.back_to_back_calls) == [6] * world_size


def test_reference_reduce_scatter_is_deterministic(gloo_world):
    assert all(gloo_world(3).run(op_cases.deterministic_reduce_scatter))


def test_reference_reduce_scatter_writes_float32_from_bf16(gloo_world):
    assert all(gloo_world(2).run(op_cases.widened_reduce_scatter))


def test_nccl_variants_gather_in_row_order(gloo_world):
    assert all(gloo_world(2).run(op_cases.nccl_gather_in_order))


@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_reduce_scatter_variant_matches_the_reference(gloo_world, world_size):
    assert all(gloo_world(world_size).run(op_cases.nccl_reduce_scatter_as_reference))


def test_cuda_tensors_dispatch_to_the_lowering():
    """Both ops have a CUDA kernel of their own (lowering/dispatch.py)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("overlap::all_gather_matmul", "CUDA")
    assert has("overlap::matmul_reduce_scatter", "CUDA")


def test_cuda_kernels_run_below_autograd(monkeypatch):
    """A CUDA kernel calls its entry point as a C++ kernel runs, past autograd: the functional
    collectives inside then skip their Python autograd wrappers (host time on every call)."""
    from overlap_pass.ops import registry
    from overlap_pass.lowering import dispatch

    recorded = []
    monkeypatch.setattr(registry, "_CUDA_KERNELS", {})
    monkeypatch.setattr(dispatch, "all_reduce", lambda x: recorded.append((x * 2).grad_fn) or x)
    x = torch.randn(3, requires_grad=True)
    registry.cuda_kernel("all_reduce", x)
    assert recorded == [None]  # no autograd node: dispatched below autograd
    assert (x * 2).grad_fn is not None  # and only inside


def test_the_tools_count_op_calls_the_kernels_made(monkeypatch):
    """benchmarks/measure.py's counter wraps dispatch's entry points; a CUDA kernel that looked its
    entry point up before the counter opened still goes through the wrapper while it is open,
    and through the real one after it closes."""
    from overlap_pass.ops import registry
    from overlap_pass.lowering import dispatch
    from benchmarks.measure import overlap_op_calls

    calls = []
    monkeypatch.setattr(registry, "_CUDA_KERNELS", {})
    monkeypatch.setattr(dispatch, "all_reduce", lambda x: calls.append("real") or x)
    x = torch.randn(3)
    registry.cuda_kernel("all_reduce", x)  # looked up and kept
    with overlap_op_calls() as counts:
        registry.cuda_kernel("all_reduce", x)
        registry.cuda_kernel("all_reduce", x)
    registry.cuda_kernel("all_reduce", x)
    assert counts["all_reduce"] == 2
    assert calls == ["real"] * 4
    assert registry._CUDA_KERNELS["all_reduce"] is dispatch.all_reduce  # the wrapper is gone


@pytest.mark.parametrize("world_size", [2, 3])
def test_scaled_gather_carries_passengers(gloo_world, world_size):
    """overlap.all_gather_scaled_matmul's passengers (overlap_pass/regions/passengers.py) on gloo."""
    assert all(gloo_world(world_size).run(op_cases.scaled_gather_with_passengers))


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_carries_passengers(gloo_world, world_size):
    """overlap.all_gather_matmul's passengers (plain TP's saved activations) on gloo."""
    assert all(gloo_world(world_size).run(op_cases.gather_with_passengers))
