"""Mirror of /work/main/tests/torchtitan_cases.py::llama3_forward_backward for other torchtitan
0.3.0 models (qwen3, deepseek_v3, gpt_oss, ...). Importable by RankPool ranks."""
import collections
import glob
import json
import os
import tempfile
import traceback
import unittest.mock

import torch
import torch.distributed as dist

from overlap_pass import all_reduce_split, config
from tests.torchtitan_cases import _on_cpu, _local, _decisions, _fused_ops, _rewritten

TP = 2
DIM, LAYERS, VOCAB, SEQ = 128, 2, 256, 32
TOL = dict(atol=2e-5, rtol=2e-5)


def _sdpa():
    from torchtitan.models.common.attention import ScaledDotProductAttention
    return ScaledDotProductAttention.Config()


def qwen3_config(tie=False, moe=False):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models import qwen3 as q
    common_experts_fp32()
    head_dim = 16
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0)
    if moe:
        layers = q._build_qwen3_moe_layers(
            n_layers=LAYERS, dim=DIM, n_heads=8, n_kv_heads=4, head_dim=head_dim, moe_hidden_dim=64,
            num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard", rope=rope)
    else:
        layers = q._build_qwen3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=8, n_kv_heads=4, head_dim=head_dim, hidden_dim=256,
            attn_backend="flex", rope=rope)
    for layer in layers:
        layer.attention.inner_attention = _sdpa()
    return q.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=q._qwen3_norm(DIM), enable_weight_tying=tie,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=q._LINEAR_INIT),
        layers=layers)


def qwen3_shard(cfg, sp):
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    set_qwen3_sharding_config(cfg, enable_sp=sp, enable_ep=False)


def dsv3_config(n_dense_layers=1):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models import deepseek_v3 as d
    common_experts_fp32()
    rope_dim = 16
    layers = d._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=n_dense_layers, dim=DIM, n_heads=8, q_lora_rank=0, kv_lora_rank=64,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70, dense_hidden_dim=256,
        moe_hidden_dim=64, num_experts=4, num_shared_experts=2, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=SEQ * 4, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=SEQ))
    for layer in layers:
        layer.attention.inner_attention = _sdpa()
    return d.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=d._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=d._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=d._output_linear_init(DIM)),
        layers=layers, mtp_layers=[])


def dsv3_shard(cfg, sp):
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    set_deepseek_v3_sharding_config(cfg, enable_sp=sp, enable_ep=False)



from dataclasses import dataclass
from torchtitan.models.common.attention import ScaledDotProductAttention as _SDPA


class MathSinkAttention(_SDPA):
    """CPU inner attention for GPT-OSS: causal math attention that returns lse and applies
    ``out_transform`` (the sinks), as torchtitan's Flex/Varlen backends do on GPU."""

    @dataclass(kw_only=True, slots=True)
    class Config(_SDPA.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, out_transform=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if enable_gqa and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        s = (q @ k.transpose(-1, -2)) * scale
        L = s.shape[-1]
        mask = torch.ones(L, L, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)  # B N L
        out = (torch.softmax(s, -1) @ v).transpose(1, 2)  # B L N H
        if out_transform is None:
            return out
        return out_transform(out, lse.transpose(1, 2))


def _fp32_experts(cls, module):
    """Generic fp32-experts patch (common GroupedExperts: see _gptoss_experts_fp32's notes)."""
    if getattr(cls, "_sweep_fp32", False):
        return
    import inspect, textwrap
    src = textwrap.dedent(inspect.getsource(cls.forward)).replace(".bfloat16()", "")
    ns = {}
    exec(compile(src, inspect.getsourcefile(cls.forward), "exec"), module.__dict__, ns)
    cls.forward = ns["forward"]
    cls._grouped_mm = _fp32_grouped_mm
    cls._sweep_fp32 = True


def _fp32_grouped_mm(self, *, A, B_t, offs):
    R = A.shape[0]
    rows = torch.arange(R, device=A.device, dtype=offs.dtype)
    eid = torch.bucketize(rows, offs, right=True)
    valid = (eid < B_t.shape[0]).unsqueeze(-1)
    eid = eid.clamp(max=B_t.shape[0] - 1)
    return torch.bmm(A.float().unsqueeze(1), B_t.float()[eid]).squeeze(1) * valid


def common_experts_fp32():
    if os.environ.get("SWEEP_BF16_EXPERTS") == "1":
        return
    from torchtitan.models.common import moe as cmoe
    _fp32_experts(cmoe.GroupedExperts, cmoe)


def _gptoss_experts_fp32():
    """GptOssGroupedExperts.forward runs its grouped mms in bf16 (torch._grouped_mm takes only
    bf16) and, unlike common GroupedExperts (``.type_as(x_RD)``), returns bf16; in an fp32 run the
    combine's scatter_add then fails on dtypes (eager, not compile). Cast its output back to the
    input's dtype, as common GroupedExperts does."""
    from torchtitan.models.gpt_oss import moe as gmoe
    cls = gmoe.GptOssGroupedExperts
    if getattr(cls, "_sweep_fp32", False):
        return
    # its forward with the .bfloat16() casts removed (inductor does not emulate the rounding of
    # a bf16 round trip inside a fused kernel, so eager and compiled would differ by bf16 eps)
    import inspect, textwrap
    src = textwrap.dedent(inspect.getsource(cls.forward)).replace(".bfloat16()", "")
    ns = {}
    exec(compile(src, inspect.getsourcefile(cls.forward), "exec"), gmoe.__dict__, ns)
    orig = ns["forward"]

    def forward(self, x_RD, num_tokens_per_expert_E):
        return orig(self, x_RD, num_tokens_per_expert_E).type_as(x_RD)

    def _grouped_mm(self, *, A, B_t, offs):
        # fp32 grouped mm (the class's documented override seam): the bf16 roundings of its
        # inputs stay (elementwise, the same in eager and compiled), the products and their
        # accumulation are fp32, so eager and compiled agree at fp32 tolerance.
        R = A.shape[0]
        rows = torch.arange(R, device=A.device, dtype=offs.dtype)
        eid = torch.bucketize(rows, offs, right=True)
        valid = (eid < B_t.shape[0]).unsqueeze(-1)
        eid = eid.clamp(max=B_t.shape[0] - 1)
        out = torch.bmm(A.float().unsqueeze(1), B_t.float()[eid]).squeeze(1)
        return out * valid

    cls.forward = forward
    cls._grouped_mm = _grouped_mm
    cls._sweep_fp32 = True


def gptoss_config():
    _gptoss_experts_fp32()
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models import gpt_oss as g
    rope = CosSinRoPE.Config(dim=16, max_seq_len=SEQ * 4, theta=150000.0, scaling="yarn", rope_factor=32,
                             beta_fast=32.0, beta_slow=1.0, truncate=False, original_seq_len=SEQ)
    layers = []
    for layer_id in range(LAYERS):
        attn = g._make_gptoss_attn_config(dim=DIM, layer_id=layer_id, attn_backend="flex", n_heads=8, n_kv_heads=4,
                                          head_dim=16, sliding_window_size=None, fuse_qkv=True, rope=rope)
        attn.inner_attention = MathSinkAttention.Config()
        experts = g._make_gptoss_experts_config(dim=DIM, hidden_dim=64, num_experts=4, layer_id=layer_id, top_k=2,
                                                moe_comm_backend="standard")
        moe = g.GptOssMoE.Config(
            num_experts=4, load_balance_coeff=1e-3, routed_experts=experts,
            router=TokenChoiceTopKRouter.Config(
                num_experts=4, score_func="softmax", route_norm=True, top_k=2,
                gate=Linear.Config(in_features=DIM, out_features=4, bias=True, param_init=g._depth_init(layer_id))))
        layers.append(g.GptOssTransformerBlock.Config(
            attention=attn, moe=moe,
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=g._NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=g._NORM_INIT)))
    return g.GptOssModel.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=g._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=g._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=g._output_linear_init(DIM)),
        layers=layers)


def gptoss_shard(cfg, sp):
    from torchtitan.models.gpt_oss.sharding import set_gpt_oss_sharding_config
    set_gpt_oss_sharding_config(cfg, enable_sp=sp, enable_ep=False)


MODELS = {
    "gpt_oss": (gptoss_config, gptoss_shard),
    "qwen3": (qwen3_config, qwen3_shard),
    "qwen3_tied": (lambda: qwen3_config(tie=True), qwen3_shard),
    "qwen3_moe": (lambda: qwen3_config(moe=True), qwen3_shard),
    "deepseek_v3": (dsv3_config, dsv3_shard),
}


def _parallel_model(name, parallel_dims, compiled, backend):
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    build, shard = MODELS[name]
    cfg = build()
    shard(cfg, True)
    with torch.device("meta"):
        model = cfg.build()
    model.parallelize(parallel_dims)
    if compiled:
        apply_compile(model, compile_config=CompileConfig(enable=True, backend="inductor" if backend == "inductor_plain" else backend, components=["model"]),
                      parallel_dims=parallel_dims)
    return model


def summarize(dec):
    counts = collections.Counter()
    reasons = collections.Counter()
    for g, cands in dec.items():
        kind_g = "fwd" if "forward" in g else ("bwd" if "backward" in g else g)
        for kind, ok, reason in cands:
            counts[(kind_g, kind, ok)] += 1
            if not ok:
                reasons[(kind, reason)] += 1
    return {"counts": {"|".join(map(str, k)): v for k, v in sorted(counts.items())},
            "reasons": {"%s: %s" % k: v for k, v in reasons.items()}, "graphs": sorted(dec)}


def forward_backward(name, backend="overlap", batch=2, seed=0, spmd_backend="spmd_types"):
    import spmd_types
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    _on_cpu()
    torch._dynamo.reset()
    torch.autograd.set_multithreading_enabled(False)
    dist_utils.set_spmd_backend(spmd_backend)
    parallelism = ParallelismConfig(data_parallel_shard_degree=1, tensor_parallel_degree=TP,
                                    enable_sequence_parallel=True, spmd_backend=spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    folder = tempfile.mkdtemp(prefix=f"sweep-{name}-", dir=tempfile.gettempdir())
    out = {"folder": folder}
    try:
        eager = _parallel_model(name, parallel_dims, False, backend)
        compiled = _parallel_model(name, parallel_dims, True, backend)
        for model in (eager, compiled):
            model.to_empty(device="cpu")
        with torch.no_grad(), context():
            torch.manual_seed(seed)
            eager.init_weights(buffer_device=None)
            compiled.init_weights(buffer_device=None)
            for (_, theirs), (_, ours) in zip(eager.named_parameters(), compiled.named_parameters()):
                _local(ours).copy_(_local(theirs))
            for (_, theirs), (_, ours) in zip(eager.named_buffers(), compiled.named_buffers()):
                _local(ours).copy_(_local(theirs))
        gen = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
        positions = torch.arange(SEQ).expand(batch, SEQ).contiguous()

        def step(model):
            inputs, targets, extra = tokens, labels, {"positions": positions}
            if spmd_backend == "spmd_types":
                inputs, targets, extra = annotate_input_spmd_types(parallel_dims, inputs, targets, extra)
            with config.patch(debug_dir=folder, enabled=backend == "inductor"), context():
                loss = cross_entropy_loss(model(inputs, **extra), targets, global_vocab_size=VOCAB) / targets.numel()
                with spmd_types.no_typecheck():
                    loss.backward()
            return loss.detach()

        losses = [step(eager), step(compiled)]
        full = [l.full_tensor() if hasattr(l, "full_tensor") else l for l in losses]
        out["loss"] = [full[0].item(), full[1].item()]
        mism = []
        d = (full[1] - full[0]).abs().max().item()
        if not torch.allclose(full[1], full[0], **TOL):
            mism.append(("loss", d))
        for (pname, theirs), (_, ours) in zip(eager.named_parameters(), compiled.named_parameters()):
            if ours.grad is None or theirs.grad is None:
                mism.append((pname, f"no grad eager={theirs.grad is not None} compiled={ours.grad is not None}"))
                continue
            a, b = _local(ours.grad), _local(theirs.grad)
            if not torch.allclose(a, b, **TOL):
                mism.append((pname, (a - b).abs().max().item()))
        out["mismatch"] = mism
        out["status"] = "PASS" if not mism else "MISMATCH"
    except BaseException:
        out["status"] = "ERROR"
        out["traceback"] = traceback.format_exc()
    try:
        out["decisions"] = summarize(_decisions(folder))
        out["ops"] = _fused_ops(_rewritten(folder))
    except Exception:
        out["decisions"] = "unreadable: " + traceback.format_exc()
    return out
