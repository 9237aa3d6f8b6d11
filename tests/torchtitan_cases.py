"""torchtitan's own models (Llama 3; Qwen3 and DeepSeek-V3, its MoE with shared experts and
MLA), parallelized and compiled by torchtitan's own code, on every rank of a gloo RankPool
(tests/cpu/test_torchtitan_gloo.py). Needs torchtitan 0.3.0 (the package's ``torchtitan`` extra).

What is torchtitan's, called as its Trainer calls it: the model (``Llama3Model.Config`` built
with its ``_build_llama3_layers``, and the like for the others), its TP plan with sequence parallel
(``set_llama3_sharding_config`` -> ``parallelize_llama``, or ``model.parallelize``), its
``apply_compile`` (``block.compile(backend="overlap", fullgraph=True)`` per TransformerBlock),
its input annotation, loss and spmd context. What a CPU run changes, and why:
- torchtitan picks its device type at import ("cuda" when no accelerator is found): set to
  "cpu" before its mesh is built;
- attention: the SDPA its graph_trainer tests swap in (FlexAttention has no backward on CPU);
- under spmd_types, no FSDP wrapping (dp_shard is 1 here): torch 2.13's ``fully_shard``
  rejects spmd_types' plain-tensor parameters; the DTensor backend runs ``parallelize_llama``
  whole, FSDP included.
"""

import glob
import json
import os
import re
import tempfile
import unittest.mock

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.regions import split_cost
from tests.dumps import assert_same_collectives

TP = 2
DIM, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ = 128, 8, 4, 2, 256, 64
TOL = dict(atol=2e-5, rtol=2e-5)
AGM, MRS = "all_gather_matmul", "matmul_reduce_scatter"


def _on_cpu() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools_utils

    tools_utils.device_type = parallel_dims.device_type = "cpu"


def _model_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )  # fmt: skip


def _qwen3_config():
    """Qwen3 (dense): QK norm, an explicit head dim, rotary embeddings as cos/sin tables."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    head_dim = DIM // HEADS
    layers = qwen3._build_qwen3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim, hidden_dim=2 * DIM,
        attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
    )  # fmt: skip


def _deepseek_v3_config():
    """DeepSeek-V3: multi-head latent attention; layer 0 a dense FFN, layer 1 an MoE of 4 routed
    experts (torchtitan's bf16 grouped matmuls) and 2 shared ones; expert parallel off."""
    from torchtitan.models import deepseek_v3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    rope = ComplexRoPE.Config(
        dim=16, max_seq_len=4 * SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0, beta_fast=32.0,
        beta_slow=1.0, original_seq_len=SEQ,
    )  # fmt: skip
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=64,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mscale=0.70, dense_hidden_dim=2 * DIM,
        moe_hidden_dim=64, num_experts=4, num_shared_experts=2, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM, layers=layers, mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=deepseek_v3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=deepseek_v3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=deepseek_v3._output_linear_init(DIM)),
    )  # fmt: skip


def _shard(family: str, model_config, sequence_parallel: bool) -> None:
    """The model's own sharding config (its TP plan), expert parallel off."""
    if family == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(model_config, enable_sp=sequence_parallel)
    elif family == "qwen3":
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(model_config, enable_sp=sequence_parallel, enable_ep=False)
    else:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(model_config, enable_sp=sequence_parallel, enable_ep=False)


MODELS = {"llama3": _model_config, "qwen3": _qwen3_config, "deepseek_v3": _deepseek_v3_config}


def _float8(model_config, compiled: bool):
    """torchtitan's Float8LinearConverter (rowwise, its default recipe) applied as its
    model_registry applies converters: before the sharding config. Its capability check asks
    for an SM89 GPU; torchao's Float8Linear and ``_scaled_mm`` run on CPU (torch 2.13)."""
    import torchtitan.components.quantization.float8 as titan_float8

    with unittest.mock.patch.object(titan_float8, "has_cuda_capability", lambda *_: True):
        converter = titan_float8.Float8LinearConverter.Config(model_compile_enabled=compiled).build()
    return converter.convert(model_config)


def _parallel_model(
    parallelism, parallel_dims, compiled: bool, backend: str = "overlap", float8: bool = False, family: str = "llama3"
):  # fmt: skip
    """The ``family`` model (a key of MODELS) on the meta device, parallelized (and compiled with
    ``backend``) by torchtitan; with ``float8``, its linears converted to torchao's Float8Linear
    first. Models other than Llama 3 under spmd_types only."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.llama3 import parallelize_llama

    training = TrainingConfig(dtype="float32", mixed_precision_param="float32", mixed_precision_reduce="float32")
    compile_config = CompileConfig(enable=compiled, backend=backend, components=["model"])
    model_config = MODELS[family]()
    if float8:
        model_config = _float8(model_config, compiled)
    _shard(family, model_config, parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = model_config.build()
    if parallelism.spmd_backend == "spmd_types":  # parallelize_llama without FSDP (module docstring)
        model.parallelize(parallel_dims)
        if compiled:
            apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
        return model
    folder = tempfile.mkdtemp(prefix="torchtitan-")
    model = parallelize_llama(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=None, dump_folder=folder,
    )  # fmt: skip
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # gloo has no PREMUL_SUM: FSDP's reduce-scatters sum, then divide
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _decisions(folder: str) -> dict:
    """{graph name: [(kind, rewritten, reason), ...]} of this rank's dumps."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, f"rank{dist.get_rank()}", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        found[record["graph"]] = [(c["kind"], c["rewritten"], c["reason"]) for c in record["candidates"]]
    return found


def _rewritten(folder: str) -> dict:
    """{graph name: its rewritten code} of this rank's dumps."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, f"rank{dist.get_rank()}", "*", "after.txt"))):
        with open(path) as f:
            found[os.path.basename(os.path.dirname(path))] = f.read()
    return found


def _fused_ops(graphs: dict) -> dict:
    """{graph name: sorted fused overlap ops in its rewritten code} (overlap::all_reduce apart:
    _all_reduces)."""
    return {
        name: sorted(op for op in re.findall(r"torch\.ops\.overlap\.(\w+)", code) if op != "all_reduce")
        for name, code in graphs.items()
    }


def _all_reduces(graphs: dict) -> dict:
    """{graph name: (overlap::all_reduce calls, functional all-reduces) in its rewritten code}."""
    return {
        name: (len(re.findall(r"torch\.ops\.overlap\.all_reduce\.", code)), len(re.findall(r"_c10d_functional\.all_reduce_?\.", code)))
        for name, code in graphs.items()
    }


def assert_every_block_collective_rewritten(results: list[dict]) -> None:
    """Per rank, the decisions of every compiled block graph (``results[r]["decisions"]``): as
    many backward graphs as forward ones, and in each the gathers before wqkv and w1/w3 and the
    scatters after wo and w2, all rewritten; the collectives of the ranks of each TP group (TP
    consecutive ranks, the inner dim of a 2-D mesh) alike."""
    for first in range(0, len(results), TP):
        assert_same_collectives([r["graphs"] for r in results[first : first + TP]])
    for rank, result in enumerate(results):
        graphs = result["decisions"]
        forward = [g for g in graphs if "forward" in g]
        backward = [g for g in graphs if "backward" in g]
        assert forward and len(forward) == len(backward), f"rank {rank}: graphs {sorted(graphs)}"
        for name, candidates in graphs.items():
            kinds = sorted(kind for kind, _, _ in candidates)
            assert kinds == [AGM, AGM, MRS, MRS], f"rank {rank} {name}: {candidates}"
            skipped = [c for c in candidates if not c[1]]
            assert not skipped, f"rank {rank} {name}: {skipped}"


def forward_backward(
    spmd_backend: str, batch: int, backend: str = "overlap", seed: int = 0, sequence_parallel: bool = True,
    float8: bool = False, tol: dict = TOL, family: str = "llama3", dp_shard: int = 1,
) -> dict:  # fmt: skip
    """One training step of the compiled ``family`` model (a key of MODELS) against the eager
    one (same weights and buffers, same tokens): the loss and every gradient at fp32 tolerance. ``backend``: "overlap"
    (--compile.backend overlap), or "inductor" with the pass turned on in it (what
    ``python3 -m overlap_pass.launch torchtitan.train`` does). ``sequence_parallel=False``:
    --parallelism.enable_sequence_parallel off (plain TP, all-reduces), split at any size
    (split_cost.py's latency term off: the test model is tiny). ``float8``: torchtitan's
    Float8LinearConverter (rowwise) on every linear, compared at ``tol``, the quantizations
    moved before their gathers at any size. ``dp_shard``: FSDP2 over that many data-parallel
    ranks beside TP (a 2-D mesh of dp_shard x TP ranks; the DTensor backend). Returns the pass's
    decisions per graph and the step's losses."""
    import spmd_types
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    _on_cpu()
    torch._dynamo.reset()
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed
    dist_utils.set_spmd_backend(spmd_backend)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=dp_shard, tensor_parallel_degree=TP, enable_sequence_parallel=sequence_parallel,
        spmd_backend=spmd_backend,
    )  # fmt: skip
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    folder = tempfile.mkdtemp(prefix="overlap-torchtitan-")
    eager = _parallel_model(parallelism, parallel_dims, compiled=False, float8=float8, family=family)
    compiled = _parallel_model(parallelism, parallel_dims, compiled=True, backend=backend, float8=float8, family=family)
    for model in (eager, compiled):
        model.to_empty(device="cpu")
    with torch.no_grad(), context():
        torch.manual_seed(seed)
        eager.init_weights(buffer_device=None)
        compiled.init_weights(buffer_device=None)
        for theirs, ours in zip([*eager.parameters(), *eager.buffers()], [*compiled.parameters(), *compiled.buffers()]):
            _local(ours).copy_(_local(theirs))

    gen = torch.Generator().manual_seed(seed + 1)  # the same tokens on every rank (TP)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(batch, SEQ).contiguous()

    def step(model):
        inputs, targets, extra = tokens, labels, {"positions": positions}
        if spmd_backend == "spmd_types":
            inputs, targets, extra = annotate_input_spmd_types(parallel_dims, inputs, targets, extra)
        # the test model is tiny: every split and quantization before a gather pays when a
        # collective's latency is not counted
        tiny = not sequence_parallel or float8
        latency = split_cost.sizes_ignored(tiny)
        with config.patch(debug_dir=folder, enabled=backend == "inductor"), context(), latency:
            loss = cross_entropy_loss(model(inputs, **extra), targets, global_vocab_size=VOCAB) / targets.numel()
            with spmd_types.no_typecheck():
                loss.backward()
        return loss.detach()

    losses = [step(eager), step(compiled)]
    full = [loss.full_tensor() if hasattr(loss, "full_tensor") else loss for loss in losses]
    torch.testing.assert_close(full[1], full[0], **tol)
    for (name, theirs), (_, ours) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert ours.grad is not None and theirs.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(
            _local(ours.grad), _local(theirs.grad), **tol, msg=lambda m, name=name: f"{name}: {m}"
        )
    graphs = _rewritten(folder)
    return {
        "decisions": _decisions(folder), "ops": _fused_ops(graphs), "all_reduces": _all_reduces(graphs),
        "graphs": graphs, "loss": full[0].item(),
    }  # fmt: skip
