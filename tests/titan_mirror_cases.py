"""Per-rank bodies of tests/cpu/test_titan_mirror_gloo.py: benchmarks/titan_llama3.py's mirror against
torchtitan 0.3.0's own Llama 3 blocks (same weights, same sharded hidden state), and the mirror
compiled with backend="overlap" against itself in eager.

torchtitan's model is built and sharded by its own code as tests/torchtitan_cases.py does (small
config, fp32, SDPA, sequence parallel), minus FSDP: with dp_shard 1 it only wraps, and its
blocks are called here one by one, as torchtitan's Decoder.forward calls them. Its dist_gemm
modules call torch.ops.symm_mem ops that have only CUDA kernels; on these CPU ranks they get
torch's own reference implementations (register_symm_mem_cpu_fallbacks, in this process only).
"""

import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from overlap_pass import config
from tests import torchtitan_cases as titan
from benchmarks.titan_llama3 import (
    LayerArgs,
    TitanLayers,
    compile_titan,
    load_from_torchtitan,
    parallelize_titan,
)

ARGS = LayerArgs(dim=titan.DIM, n_heads=titan.HEADS, n_kv_heads=titan.KV_HEADS, ffn_multiple_of=64)
# the dist_gemm backend exists only under spmd_types (validate_dist_gemm_preconditions)
SPMD_BACKEND = {"default": "partial_dtensor", "dist_gemm": "spmd_types"}
_aten_cpu_kernels: list = []  # our aten Library: its kernel stays registered while it lives


def register_symm_mem_cpu_fallbacks() -> None:
    """CPU kernels for what torchtitan's dist_gemm calls: the symm_mem ops get torch's reference
    implementations (funcol collective + matmul), and aten::mm.dtype (LinearReduceScatter's fp32
    wgrad, CUDA-only) an upcast matmul. Once per process."""
    if _aten_cpu_kernels:
        return
    import torch.distributed._symmetric_memory as symm

    symm.lib.impl("fused_all_gather_matmul", symm._fused_all_gather_matmul_fallback, "CPU")
    symm.lib.impl("fused_matmul_reduce_scatter", symm._fused_matmul_reduce_scatter_fallback, "CPU")
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.to(out_dtype), b.to(out_dtype)), "CPU")
    _aten_cpu_kernels.append(aten)


def _titan_config(tp_gemm_backend: str):
    """tests/torchtitan_cases' config; for dist_gemm with its layers built for that backend."""
    config_ = titan._model_config()
    if tp_gemm_backend == "dist_gemm":
        from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import _build_llama3_layers

        config_.layers = _build_llama3_layers(
            fuse_qkv=True, n_layers=titan.LAYERS, dim=titan.DIM, n_heads=titan.HEADS,
            n_kv_heads=titan.KV_HEADS, hidden_dim=compute_ffn_hidden_dim(titan.DIM, multiple_of=64),
            rope=ComplexRoPE.Config(
                dim=titan.DIM // titan.HEADS, max_seq_len=titan.SEQ, theta=500000, scaling="llama"
            ),
            attn_backend="flex", tp_gemm_backend="dist_gemm",
        )  # fmt: skip
        for layer in config_.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config_


def _titan_model(tp_gemm_backend: str, seed: int):
    """torchtitan's Llama 3 under its TP + SP plan (parallelize_llama's TP step), initialized,
    with the spmd context its blocks run in."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    spmd_backend = SPMD_BACKEND[tp_gemm_backend]
    titan._on_cpu()
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed
    dist_utils.set_spmd_backend(spmd_backend)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=1, tensor_parallel_degree=titan.TP,
        enable_sequence_parallel=True, spmd_backend=spmd_backend,
    )  # fmt: skip
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    model_config = _titan_config(tp_gemm_backend)
    set_llama3_sharding_config(model_config, enable_sp=True)
    with torch.device("meta"):
        model = model_config.build()
    model.parallelize(parallel_dims)
    model.to_empty(device="cpu")
    with torch.no_grad(), context():
        torch.manual_seed(seed)
        model.init_weights(buffer_device=None)
    return model, parallel_dims.get_mesh("tp"), context


def _sharded(global_tensor: torch.Tensor) -> torch.Tensor:
    """This rank's sequence shard of a tensor that is the same on every rank."""
    return global_tensor.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


def _inputs(batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, titan.SEQ, titan.DIM, generator=gen)
    grad_out = torch.randn(batch, titan.SEQ, titan.DIM, generator=gen)
    return _sharded(hidden), _sharded(grad_out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grads(model) -> dict:
    """{name: (placements or None, local gradient)} of the block parameters."""
    found = {}
    for name, param in model.layers.named_parameters():
        assert param.grad is not None, f"{name}: no gradient"
        placements = tuple(param.grad.placements) if isinstance(param.grad, DTensor) else None
        found[name] = (placements, _local(param.grad))
    return found


def _assert_same_step(ours: tuple, theirs: tuple) -> None:
    (out, dx, grads), (out_t, dx_t, grads_t) = ours, theirs
    torch.testing.assert_close(out, out_t, **titan.TOL, msg="output")
    torch.testing.assert_close(dx, dx_t, **titan.TOL, msg="input gradient")
    assert grads.keys() == grads_t.keys()
    for name, (placements, grad) in grads.items():
        assert placements == grads_t[name][0], (
            f"{name}: grad placements {placements} vs {grads_t[name][0]}"
        )
        torch.testing.assert_close(grad, grads_t[name][1], **titan.TOL, msg=name)


def _step_titan(model, mesh, context, x_local, grad_local, spmd_backend: str) -> tuple:
    """The blocks as torchtitan's Decoder.forward runs them: layer(h, attention_masks, positions)."""
    import spmd_types

    batch = x_local.shape[0]
    positions = torch.arange(titan.SEQ).expand(batch, titan.SEQ).contiguous()
    x = x_local.clone().requires_grad_()
    h = (
        x
        if spmd_backend == "spmd_types"
        else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    )
    with context():
        for layer in model.layers.values():
            h = layer(h, None, positions)
        out = _local(h)
        with spmd_types.no_typecheck():
            out.backward(grad_local)
    return out.detach(), x.grad, _grads(model)


def _step_mirror(model, x_local, grad_local) -> tuple:
    x = x_local.clone().requires_grad_()
    out = model(x)
    out.backward(grad_local)
    return out.detach(), x.grad, _grads(model)


def mirror_matches_torchtitan(gemm_backend: str, batch: int, seed: int = 0) -> dict:
    """One forward and backward of torchtitan's blocks and of the mirror loaded with their weights:
    the output shard, the input's gradient and every weight's gradient (placements and local
    values) agree at fp32 tolerance. Returns what the ranks' answers are compared on."""
    if gemm_backend == "dist_gemm":
        register_symm_mem_cpu_fallbacks()
    theirs, mesh, context = _titan_model(gemm_backend, seed)
    ours = parallelize_titan(TitanLayers(ARGS, titan.LAYERS, titan.SEQ, gemm_backend), mesh)
    load_from_torchtitan(ours, theirs)
    x_local, grad_local = _inputs(batch, seed + 1)
    expected = _step_titan(theirs, mesh, context, x_local, grad_local, SPMD_BACKEND[gemm_backend])
    if gemm_backend == "dist_gemm":
        from torchtitan.models.common import dist_gemm

        assert not dist_gemm._WARNED_NO_TP, "torchtitan ran its stock projections, not dist_gemm"
    got = _step_mirror(ours, x_local, grad_local)
    _assert_same_step(got, expected)
    return {"output_sum": got[0].sum().item(), "n_grads": len(got[2])}


def overlap_rewrites_mirror(batch: int, seed: int = 0) -> dict:
    """The mirror under parallelize_titan + compile_titan(backend="overlap") against an eager
    copy: same output and gradients. Returns the pass's decisions per graph and the rewritten
    graphs (torchtitan_cases._decisions, _rewritten)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(parallelize_titan(TitanLayers(ARGS, titan.LAYERS, titan.SEQ), mesh))
    eager, compiled = models
    compile_titan(compiled, backend="overlap")
    x_local, grad_local = _inputs(batch, seed + 1)
    folder = tempfile.mkdtemp(prefix="overlap-titan-mirror-")
    expected = _step_mirror(eager, x_local, grad_local)
    with config.patch(debug_dir=folder):
        got = _step_mirror(compiled, x_local, grad_local)
    _assert_same_step(got, expected)
    return {"decisions": titan._decisions(folder), "graphs": titan._rewritten(folder)}
