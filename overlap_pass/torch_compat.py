"""The private torch names the CUDA path uses (and the caches' folder), in one place.

lowering/ and templates/ take every underscored torch module, function, op and attribute from
here, so that a torch release that moves one breaks one accessor, and tests/cpu/test_torch_compat.py
checks each entry of PRIVATE_NAMES against the installed torch (the name, and that it takes the
arguments the project passes) without a GPU.

Every accessor looks its name up when called, never at import: torch.distributed._symmetric_memory
registers torch.ops.symm_mem's fused ops when imported, torch._inductor is a heavy import, and
torch._C._cuda_getCurrentRawStream exists only in CUDA builds.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One torch name the project relies on, and how it calls it."""

    name: str  # dotted from torch; an op as torch.ops.<namespace>.<op>
    kind: str  # "function", "method" (of the class before its last dot), "op", "class", "attribute"
    positional: tuple[str, ...] = ()  # arguments passed by position, under torch's names for them
    keywords: tuple[str, ...] = ()  # arguments passed by name
    callers: str = ""  # where the project uses it
    schema_of: str = ""  # a builtin without a Python signature: the op whose schema it binds
    cuda_only: bool = False  # absent from CPU builds of torch
    required: bool = True  # False: the callers check hasattr first and do without it


_SYMM = "torch.distributed._symmetric_memory"
_TREES = "torch._inductor.cudagraph_trees"

PRIVATE_NAMES = (
    PrivateName(
        "torch.distributed.distributed_c10d._resolve_process_group", "function", ("group_name",),
        callers="lowering: symm, dispatch, all_gather_matmul, matmul_reduce_scatter, scaled; overlap_pass/ops/matmul_ops.py",
    ),  # fmt: skip
    PrivateName(
        "torch._check", "function", ("cond", "message"),
        callers="overlap_pass/ops/matmul_ops.py (check: the ops' argument checks, lowering/dispatch.py's)",
    ),  # fmt: skip
    PrivateName(
        "torch._scaled_mm", "function", ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result"),
        ("out_dtype", "use_fast_accum", "out"), callers="lowering/replay.py; overlap_pass/ops/scaled_ops.py; tools",
        schema_of="torch.ops.aten._scaled_mm",
    ),  # fmt: skip
    PrivateName(f"{_SYMM}.empty", "function", ("size",), ("dtype", "device"), callers="lowering/symm.py"),
    PrivateName(f"{_SYMM}.rendezvous", "function", ("tensor", "group"), callers="lowering/symm.py"),
    PrivateName(
        "torch._C._distributed_c10d._SymmetricMemory.get_buffer", "method", ("rank", "sizes", "dtype"),
        ("storage_offset",), callers="lowering/symm.py (on the handle rendezvous returns)",
    ),  # fmt: skip
    PrivateName(
        f"{_TREES}.get_manager", "function", ("device_index",), ("create_if_none_exists",),
        callers="lowering/choose.py",
    ),  # fmt: skip
    PrivateName(f"{_TREES}.CUDAGraphTreeManager.in_warmup", "attribute", callers="lowering/choose.py"),
    PrivateName(
        "torch._C._cuda_getCurrentRawStream", "function", ("device",), callers="templates/launch.py", cuda_only=True
    ),
    # (size, stride, dtype), all positional, as Inductor's generated code calls it: no Python
    # signature or schema to check the call against
    PrivateName(
        "torch._C._dynamo.guards._empty_strided_cuda", "attribute",
        callers="lowering/replay.py (the replayed calls' outputs)",
    ),  # fmt: skip
    PrivateName("torch._C._cuda_getDevice", "function", callers="lowering/replay.py", cuda_only=True),
    # public, but a replay.py capture that raises falls back to eager calls for good: checked too
    PrivateName(
        "torch.cuda.CUDAGraph.capture_begin", "method", keywords=("pool", "capture_error_mode"),
        callers="lowering/replay.py",
    ),  # fmt: skip
    PrivateName("torch.cuda.CUDAGraph.pool", "method", callers="lowering/replay.py"),
    # torch's async TP, which the benchmarks run beside ours
    PrivateName(
        "torch.ops.symm_mem.fused_all_gather_matmul", "op", ("A", "Bs", "gather_dim", "group_name"),
        callers="benchmarks/bench_ops.py, benchmarks/titan_llama3.py",
    ),  # fmt: skip
    PrivateName(
        "torch.ops.symm_mem.fused_matmul_reduce_scatter", "op", ("A", "B", "reduce_op", "scatter_dim", "group_name"),
        callers="benchmarks/bench_ops.py, benchmarks/titan_llama3.py",
    ),  # fmt: skip
    PrivateName(
        "torch.ops.symm_mem.fused_all_gather_scaled_matmul", "op",
        ("A", "Bs", "A_scale", "B_scales", "gather_dim", "group_name", "biases", "result_scales", "out_dtypes",
         "use_fast_accum"),
        callers="benchmarks/bench_ops.py",
    ),  # fmt: skip
    PrivateName(
        "torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter", "op",
        ("A", "B", "A_scale", "B_scale", "reduce_op", "orig_scatter_dim", "scatter_dim_after_maybe_reshape",
         "group_name", "output_shape"),
        ("out_dtype", "use_fast_accum"), callers="benchmarks/bench_ops.py",
    ),  # fmt: skip
    PrivateName(
        f"{_SYMM}.enable_symm_mem_for_group", "function", ("group_name",),
        callers="benchmarks/bench_ops.py, bench_model.py, bench_torchtitan.py", required=False,
    ),  # fmt: skip
    # the functional collectives Inductor's graphs call, which the NCCL + cuBLAS variants call too
    PrivateName(
        "torch.ops._c10d_functional.all_gather_into_tensor", "op", ("input", "group_size", "group_name"),
        callers="lowering/collectives.py",
    ),  # fmt: skip
    PrivateName(
        "torch.ops._c10d_functional.reduce_scatter_tensor", "op", ("input", "reduce_op", "group_size", "group_name"),
        callers="lowering/collectives.py",
    ),  # fmt: skip
    PrivateName(
        "torch.ops._c10d_functional.all_reduce", "op", ("input", "reduce_op", "group_name"),
        callers="lowering/collectives.py",
    ),  # fmt: skip
    PrivateName("torch.ops._c10d_functional.wait_tensor", "op", ("tensor",), callers="lowering/collectives.py"),
    PrivateName("torch._C._AutoDispatchBelowAutograd", "class", callers="overlap_pass/ops/registry.py (the CUDA kernels)"),
    PrivateName("torch._C._autograd._profiler_enabled", "function", callers="overlap_pass/pipeline/direct_calls.py"),
    # Inductor's lowering of the ops to direct calls (overlap_pass/pipeline/direct_calls.py)
    PrivateName("torch._inductor.lowering.lowerings", "attribute", callers="overlap_pass/pipeline/direct_calls.py"),
    PrivateName(
        "torch._inductor.lowering.make_fallback", "function", ("op",), ("layout_constraint", "warn"),
        callers="overlap_pass/pipeline/direct_calls.py",
    ),  # fmt: skip
    PrivateName(
        "torch._inductor.lowering.constrain_to_fake_tensors", "attribute",
        callers="overlap_pass/pipeline/direct_calls.py (Inductor calls it)",
    ),  # fmt: skip
    PrivateName("torch._inductor.ir.FallbackKernel", "class", callers="overlap_pass/pipeline/direct_calls.py"),
    PrivateName(
        "torch._inductor.ir.FallbackKernel.codegen", "method", ("wrapper",), callers="overlap_pass/pipeline/direct_calls.py"
    ),
    PrivateName("torch._inductor.virtualized.V", "attribute", callers="overlap_pass/pipeline/direct_calls.py"),
    PrivateName(
        "torch._inductor.runtime.cache_dir_utils.cache_dir", "function",
        callers="overlap_pass/shapes/size_ranges.py (its records beside Inductor's caches)",
    ),  # fmt: skip
    PrivateName("torch._dynamo.reset", "function", callers="tools: bench_model, bench_torchtitan"),
    PrivateName("torch._dynamo.config.recompile_limit", "attribute", callers="tools: bench_model, bench_torchtitan"),
    PrivateName("torch._dynamo.utils.counters", "attribute", callers="tools: bench_model, bench_torchtitan"),
    # the tests' compiles that stop after the post-grad passes (tests/graphs_only.py)
    PrivateName(
        "torch._inductor.compile_fx.compile_fx", "function", ("model_", "example_inputs_"), ("inner_compile",),
        callers="overlap_pass/backend.py; tests/graphs_only.py",
    ),  # fmt: skip
    PrivateName(
        "torch._inductor.fx_passes.post_grad.view_to_reshape", "function", ("gm",), callers="tests/graphs_only.py",
    ),  # fmt: skip
    PrivateName(
        "torch._inductor.compile_fx.fake_tensor_prop", "function", ("gm", "example_inputs"),
        callers="tests/graphs_only.py",
    ),  # fmt: skip
    PrivateName(
        "torch._inductor.compile_fx._recursive_post_grad_passes", "function", ("gm",), ("is_inference",),
        callers="tests/graphs_only.py",
    ),  # fmt: skip
)


def functional_collectives():
    """torch.ops._c10d_functional: the collectives as C++ ops, each returning its output to be
    waited for (wait_tensor), as Inductor's graphs call them."""
    return torch.ops._c10d_functional


def below_autograd():
    """A guard under which ops dispatch past their autograd kernels, as inside a C++ kernel: the
    functional collectives' autograd is Python (torch.library.register_autograd), a few
    microseconds of the host's time per call that a kernel's inner calls need not pay."""
    return torch._C._AutoDispatchBelowAutograd()


def resolve_process_group(group_name: str):
    """The ProcessGroup that an op's ``group_name`` names (the ops carry names, not groups)."""
    return torch.distributed.distributed_c10d._resolve_process_group(group_name)


def scaled_mm(*args, **kwargs) -> torch.Tensor:
    """torch._scaled_mm: cuBLASLt's float8 matmul with scales (arguments as in PRIVATE_NAMES)."""
    return torch._scaled_mm(*args, **kwargs)


def symmetric_empty(*size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor from the symmetric-memory allocator (rendezvous can map it on every rank)."""
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.empty(*size, dtype=dtype, device=device)


def rendezvous(tensor: torch.Tensor, group_name: str):
    """Collective: the _SymmetricMemory handle of ``tensor`` (from symmetric_empty) on every rank
    of the group; its get_buffer(rank, sizes, dtype, storage_offset=) views a rank's buffer."""
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.rendezvous(tensor, group_name)


def graph_trees_warming_up(device_index: int) -> bool:
    """Whether CUDA graph trees (torch.compile's reduce-overhead mode) are warming a model up
    on this device; raises where their internals moved (the caller decides what then)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    return manager is not None and bool(manager.in_warmup)


def empty_strided_cuda():
    """The function ``(size, stride, dtype) -> an empty tensor on the current CUDA device``, past
    torch's dispatcher (Inductor's generated code allocates its buffers with it); returned, so
    that a caller on the host's critical path looks it up once."""
    return torch._C._dynamo.guards._empty_strided_cuda


def current_device_index():
    """The function ``() -> the current CUDA device's index``, without
    torch.cuda.current_device()'s lazy-init check (returned, as above)."""
    return torch._C._cuda_getDevice


def current_raw_stream(device: int) -> int:
    """The current CUDA stream of ``device`` as a raw cudaStream_t (a compiled Triton kernel's
    launcher takes it)."""
    return torch._C._cuda_getCurrentRawStream(device)


def inductor_cache_dir() -> str:
    """The folder of Inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR where set)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()
