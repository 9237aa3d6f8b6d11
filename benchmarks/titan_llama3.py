"""torchtitan 0.3.0's Llama 3 TransformerBlock, its TP + sequence-parallel plan and its per-block
compile, rebuilt on torch 2.11's public APIs: torchtitan itself cannot be imported there (it
needs torch.distributed.fsdp.DataParallelMeshDims), and the GPU benchmarks run on torch 2.11.
tests/cpu/test_titan_mirror_gloo.py checks on CPU that this computes exactly what torchtitan's own
blocks compute (outputs and every gradient, fp32), with both gemm backends.

What each part mirrors (paths under torchtitan/):
- FLAVORS: models/llama3/__init__.py ``_8b`` / ``_70b`` per-layer arguments; the SwiGLU width is
  models/common/feed_forward.py ``compute_ffn_hidden_dim``; norm eps is RMSNorm.Config's 1e-5.
- TransformerBlock: models/llama3/model.py ``Llama3TransformerBlock.forward``
  (``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``), nn.RMSNorm.
- Attention: models/common/attention.py ``GQAttention.forward`` with ``FusedQKVLinear`` (one wqkv
  whose rows are laid out [n_kv_heads, heads_per_kv + 2, head_dim]: each KV group's query heads,
  then its key, then its value) and ``ScaledDotProductAttention`` (causal, enable_gqa, backends
  cuDNN > Flash > Math) -- the SDPA that torchtitan's tests swap in for FlexAttention.
- RoPE: models/common/rope.py ``ComplexRoPE`` with "llama" scaling: complex cache, adjacent-pair
  rotation in fp32. torchtitan gathers the cache at ``positions``; positions here are always
  0..seq-1, which is the same rows.
- FeedForward: models/common/feed_forward.py ``FeedForward`` (w2(silu(w1 x) * w3 x)).
- parallelize_titan, "default": the placements of models/llama3/sharding.py +
  models/common/decoder_sharding.py under spmd_backend="partial_dtensor", enable_sp=True, spelled
  with DTensor's parallel styles. Blocks take and return Shard(1) DTensors; norms run on them
  with Replicate weights; attention and feed_forward all-gather their input to Replicate; wqkv,
  w1, w3 are Shard(0) (colwise), wo and w2 Shard(1) (rowwise) and reduce-scatter to Shard(1).
- parallelize_titan, "dist_gemm": models/common/dist_gemm.py (AllGatherFusedQKVLinear,
  RowParallelLinear, AllGatherFusedFeedForward) over distributed/linear.py's algorithm
  (AllGatherLinear, AllGatherLinearMulti, LinearReduceScatter), re-implemented below. torchtitan
  requires spmd_backend="spmd_types" and sequence parallel for it: weights are plain local shards
  and activations plain local tensors, flattened sequence-major around each fused op.
- compile_titan: distributed/compile.py ``apply_compile`` (``block.compile(fullgraph=True)`` per
  block of ``model.layers``).

As in torchtitan, the norm weights' gradients are this rank's partial sums (torchtitan leaves
their TP all-reduce to FSDP): Partial(sum) DTensors under "default", plain tensors under
"dist_gemm".

What differs, none of it in the numbers:
- Between wqkv and wo (and w1/w3 and w2) the mirror computes on local tensors (ColwiseParallel's
  use_local_output=True); torchtitan keeps DTensors there and drops to local tensors only inside
  its local_map regions (qkv split, SDPA). RoPE, the split, silu * mul and the views are the same
  per-shard arithmetic either way.
- The RoPE cache is a plain buffer, not a Replicate DTensor, computed at construction on
  ``device`` (build the model on the device it will run on).
- "dist_gemm" without bias support (Llama 3 has none) and with the TP group fixed at
  parallelize time rather than read from the spmd_types mesh context at each forward.
- No embedding, final norm, lm_head or loss: this is the block stack the benchmark times. No
  FSDP either (with dp_shard 1 it only casts; give ``dtype`` instead), and compile_titan leaves
  Dynamo's capture_scalar_outputs alone (apply_compile turns it on for MoE routing).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

GEMM_BACKENDS = ("default", "dist_gemm")

# ScaledDotProductAttention.sdpa_backends, in its priority order.
SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def swiglu_hidden_dim(dim: int, multiple_of: int, multiplier: float | None = None) -> int:
    """torchtitan's compute_ffn_hidden_dim: 2/3 of 4 * dim, times the multiplier, rounded up."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LayerArgs:
    """One Llama 3 TransformerBlock's shape, as torchtitan's flavors configure it."""

    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_multiple_of: int
    ffn_multiplier: float | None = None
    rope_theta: float = 500000.0
    rope_scaling: str = "llama"  # "llama" or "none"
    # ComplexRoPE.Config's llama-scaling defaults (Llama 3.1's)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return swiglu_hidden_dim(self.dim, self.ffn_multiple_of, self.ffn_multiplier)


FLAVORS = {
    # models/llama3/__init__.py _8b: SwiGLU hidden 14336, head_dim 128
    "llama3-8b": LayerArgs(
        dim=4096, n_heads=32, n_kv_heads=8, ffn_multiple_of=1024, ffn_multiplier=1.3
    ),
    # models/llama3/__init__.py _70b: SwiGLU hidden 28672, head_dim 128
    "llama3-70b": LayerArgs(
        dim=8192, n_heads=64, n_kv_heads=8, ffn_multiple_of=4096, ffn_multiplier=1.3
    ),
}


# ---- RoPE and attention, as torchtitan computes them ------------------------------------------


def rope_cache(args: LayerArgs, seq_len: int, device=None) -> torch.Tensor:
    """ComplexRoPE._precompute_cache: [seq_len, head_dim / 2] complex64."""
    dim, theta = args.head_dim, args.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: (dim // 2)].float() / dim))
    if args.rope_scaling == "llama":
        factor, low, high = (
            args.rope_scaling_factor,
            args.rope_low_freq_factor,
            args.rope_high_freq_factor,
        )
        original = args.rope_original_max_positions
        wavelen = 2 * math.pi / freqs
        high_freq_wavelen, low_freq_wavelen = original / high, original / low
        freqs = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        freqs = torch.where(is_medium, smoothed, freqs)
    elif args.rope_scaling != "none":
        raise ValueError(f"rope_scaling {args.rope_scaling!r}: 'llama' or 'none'")
    angles = torch.outer(torch.arange(seq_len, device=device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ComplexRoPE.apply_rotary_emb on [B, S, heads, head_dim], in fp32, adjacent-pair rotation."""
    cache = cache.view(1, cache.shape[0], 1, cache.shape[1])
    q_c = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    k_c = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    q_out = torch.view_as_real(q_c * cache).flatten(3)
    k_out = torch.view_as_real(k_c * cache).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)


def split_fused_qkv(qkv: torch.Tensor, heads_per_kv: int, head_dim: int):
    """FusedQKVLinear's split of [B, S, kv_heads, heads_per_kv + 2, head_dim] into contiguous
    q [B, S, kv_heads * heads_per_kv, head_dim], k and v [B, S, kv_heads, head_dim]."""
    batch, seq = qkv.shape[0], qkv.shape[1]
    q, k, v = torch.split(qkv, [heads_per_kv, 1, 1], dim=-2)
    return tuple(t.reshape(batch, seq, -1, head_dim).contiguous() for t in (q, k, v))


def causal_attention(q, k, v, enable_gqa: bool, backends=SDPA_BACKENDS) -> torch.Tensor:
    """ScaledDotProductAttention.forward: [B, S, heads, head_dim] in and out."""
    with sdpa_kernel(backends, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=enable_gqa,
        )
    return out.transpose(1, 2)


# ---- dist_gemm: the TP collective fused into the GEMM (torchtitan/distributed/linear.py) ------
# Rows are tokens, sequence-major: [S/W * B] on a rank, [S * B] gathered. The symm_mem ops are
# registered by importing torch.distributed._symmetric_memory (parallelize_titan does).


def _k_shard(x_full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's columns of the gathered input: all that wgrad needs, 1/W of its memory."""
    return x_full.chunk(world, dim=1)[rank].contiguous()


class AllGatherMatmul(torch.autograd.Function):
    """y = all_gather(x_rows) @ w.T with the gather fused into the matmul.

    x_rows [M/W, K], w [N/W, K] -> y [M, N/W]; saves x_cols [M, K/W] (gathered x, K-sharded)
    dgrad  dx_rows = reduce_scatter(dy @ w)                 (fused_matmul_reduce_scatter)
    wgrad  dw      = (all_gather(x_cols.T) [K, M] @ dy).T   (fused_all_gather_matmul again)
    """

    @staticmethod
    def forward(ctx, x_rows, w, group_name: str, rank: int, world: int):
        x_full, ys = torch.ops.symm_mem.fused_all_gather_matmul(
            x_rows.contiguous(), [w.t()], 0, group_name
        )
        ctx.save_for_backward(_k_shard(x_full, rank, world), w)
        ctx.group_name = group_name
        return ys[0]

    @staticmethod
    def backward(ctx, dy):
        x_cols, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx_rows = torch.ops.symm_mem.fused_matmul_reduce_scatter(dy, w, "sum", 0, ctx.group_name)
        # x_cols.T puts the gathered K on dim 0: the op's fused path gathers dim 0 only.
        _, dw_t = torch.ops.symm_mem.fused_all_gather_matmul(
            x_cols.t().contiguous(), [dy], 0, ctx.group_name
        )
        return dx_rows, dw_t[0].t().contiguous(), None, None, None


class AllGatherMatmulPair(torch.autograd.Function):
    """AllGatherMatmul for two weights on one input (SwiGLU's w1, w3): one gather per pass.
    Two explicit weights, not *weights: Dynamo does not trace tensors passed through *args here.
    dgrad concatenates (dy_a | dy_b) and (w_a ; w_b) so it stays one reduce-scatter."""

    @staticmethod
    def forward(ctx, x_rows, w_a, w_b, group_name: str, rank: int, world: int):
        x_full, ys = torch.ops.symm_mem.fused_all_gather_matmul(
            x_rows.contiguous(), [w_a.t(), w_b.t()], 0, group_name
        )
        ctx.save_for_backward(_k_shard(x_full, rank, world), w_a, w_b)
        ctx.group_name = group_name
        return ys[0], ys[1]

    @staticmethod
    def backward(ctx, dy_a, dy_b):
        x_cols, w_a, w_b = ctx.saved_tensors
        dy_a, dy_b = dy_a.contiguous(), dy_b.contiguous()
        dx_rows = torch.ops.symm_mem.fused_matmul_reduce_scatter(
            torch.cat([dy_a, dy_b], dim=1), torch.cat([w_a, w_b], dim=0), "sum", 0, ctx.group_name
        )
        _, dw_t = torch.ops.symm_mem.fused_all_gather_matmul(
            x_cols.t().contiguous(), [dy_a, dy_b], 0, ctx.group_name
        )
        return dx_rows, dw_t[0].t().contiguous(), dw_t[1].t().contiguous(), None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """y_rows = reduce_scatter(x_cols @ w.T) with the scatter fused into the matmul.

    x_cols [M, K/W], w [N, K/W] -> y_rows [M/W, N]
    dgrad  dx_cols = all_gather(dy_rows) @ w    (fused_all_gather_matmul, which returns dy too)
    wgrad  dw      = dy.T @ x_cols              (local, accumulated in fp32)
    """

    @staticmethod
    def forward(ctx, x_cols, w, group_name: str):
        x_cols = x_cols.contiguous()
        ctx.save_for_backward(x_cols, w)
        ctx.group_name = group_name
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x_cols, w.t(), "sum", 0, group_name)

    @staticmethod
    def backward(ctx, dy_rows):
        x_cols, w = ctx.saved_tensors
        dy, dxs = torch.ops.symm_mem.fused_all_gather_matmul(
            dy_rows.contiguous(), [w], 0, ctx.group_name
        )
        dw = torch.mm(dy.t(), x_cols, out_dtype=torch.float32).to(w.dtype)
        return dxs[0], dw, None


@dataclass(frozen=True)
class TpGroup:
    """What a dist_gemm module needs of its TP group (set by parallelize_titan)."""

    name: str
    rank: int
    size: int


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """[B, S, X] -> [S * B, X]: the gathered / scattered rows then split the sequence, not the
    batch (a copy when B > 1)."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1]).contiguous()


def _batch_major(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """[S * B, X] -> [B, S, X]."""
    return rows.view(-1, batch, rows.shape[-1]).transpose(0, 1)


# ---- modules; attribute names are torchtitan's, so parameter names match its model.layers ----


class FusedQKV(nn.Module):
    """FusedQKVLinear: one wqkv matmul, split into q, k, v [B, S, heads, head_dim]."""

    def __init__(self, args: LayerArgs, **factory) -> None:
        super().__init__()
        self.heads_per_kv = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        rows = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, rows, bias=False, **factory)
        self.tp: TpGroup | None = None

    def _split(self, qkv: torch.Tensor):
        qkv = qkv.view(qkv.shape[0], qkv.shape[1], -1, self.heads_per_kv + 2, self.head_dim)
        return split_fused_qkv(qkv, self.heads_per_kv, self.head_dim)

    def forward(self, x: torch.Tensor):
        if self.tp is None:
            return self._split(self.wqkv(x))
        # AllGatherFusedQKVLinear: x is this rank's [B, S/W, D]
        batch = x.shape[0]
        qkv = AllGatherMatmul.apply(
            _seq_major(x), self.wqkv.weight, self.tp.name, self.tp.rank, self.tp.size
        )
        return self._split(_batch_major(qkv, batch))


class RowLinear(nn.Linear):
    """wo / w2: a plain linear (DTensor's RowwiseParallel shards it under "default"); under
    "dist_gemm", RowParallelLinear: [B, S, K/W] in, the reduce-scattered [B, S/W, N] out."""

    tp: TpGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        y = MatmulReduceScatter.apply(_seq_major(x), self.weight, self.tp.name)
        return _batch_major(y, x.shape[0]).contiguous()


class Attention(nn.Module):
    """GQAttention with FusedQKVLinear, ComplexRoPE and causal SDPA."""

    def __init__(self, args: LayerArgs, seq_len: int, sdpa_backends: list, **factory) -> None:
        super().__init__()
        self.enable_gqa = args.n_heads > args.n_kv_heads
        self.sdpa_backends = sdpa_backends
        self.qkv_linear = FusedQKV(args, **factory)
        self.wo = RowLinear(args.n_heads * args.head_dim, args.dim, bias=False, **factory)
        self.register_buffer(
            "rope_cache", rope_cache(args, seq_len, factory.get("device")), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_linear(x)
        q, k = apply_rope(q, k, self.rope_cache[: q.shape[1]])
        out = causal_attention(q, k, v, self.enable_gqa, self.sdpa_backends).contiguous()
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    """SwiGLU; once parallelized for dist_gemm, AllGatherFusedFeedForward (one gather feeds w1
    and w3, w2 reduce-scatters)."""

    def __init__(self, args: LayerArgs, **factory) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False, **factory)
        self.w2 = RowLinear(args.hidden_dim, args.dim, bias=False, **factory)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False, **factory)
        self.tp: TpGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        tp = self.tp
        h1, h3 = AllGatherMatmulPair.apply(
            _seq_major(x), self.w1.weight, self.w3.weight, tp.name, tp.rank, tp.size
        )
        y = MatmulReduceScatter.apply(F.silu(h1) * h3, self.w2.weight, tp.name)
        return _batch_major(y, x.shape[0]).contiguous()


class TransformerBlock(nn.Module):
    """Llama3TransformerBlock."""

    def __init__(self, args: LayerArgs, seq_len: int, sdpa_backends: list, **factory) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps, **factory)
        self.attention = Attention(args, seq_len, sdpa_backends, **factory)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps, **factory)
        self.feed_forward = FeedForward(args, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLayers(nn.Module):
    """``n_layers`` Llama 3 blocks in ``layers`` (keys "0", "1", ... as torchtitan's).

    Unparallelized, forward takes and returns the whole hidden state [B, S, D]. After
    parallelize_titan it takes and returns this rank's sequence shard [B, S / W, D], as
    torchtitan's hidden state flows between its blocks; positions are 0..S-1 in every sequence.
    ``seq_len`` is the RoPE cache's length (torchtitan sizes it to training.seq_len). Give
    ``dtype`` here: ``.to(dtype)`` would cast the complex RoPE cache too.

    ``sdpa_backends`` defaults to torchtitan's (cuDNN first). Torch 2.11's cuDNN attention caches
    its backward plan by shape, not by the output gradient's strides (fixed upstream in
    pytorch/pytorch#191576): in one process, a later call whose gradient is laid out otherwise
    gets wrong gradients (relative error ~1). "default" and "dist_gemm" at batch > 1 lay it out
    differently (dist_gemm's sequence-major flatten before wo), and so may eager and compiled:
    run such variants in separate processes, or pass [FLASH_ATTENTION, MATH] here.
    """

    def __init__(
        self, args: LayerArgs | str, n_layers: int, seq_len: int, gemm_backend: str = "default",
        device=None, dtype=None, sdpa_backends: list = SDPA_BACKENDS,
    ) -> None:  # fmt: skip
        super().__init__()
        if gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend {gemm_backend!r}: one of {GEMM_BACKENDS}")
        self.args = FLAVORS[args] if isinstance(args, str) else args
        self.gemm_backend = gemm_backend
        self.tp_mesh = None  # set by parallelize_titan under "default"
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    self.args, seq_len, sdpa_backends, device=device, dtype=dtype
                )
                for i in range(n_layers)
            }
        )
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """torchtitan's llama3 inits: std 0.02 for wqkv and w1, 0.02 / sqrt(2 (layer + 1)) for wo,
        w2 and w3 (truncated normals), norms at one."""
        for layer_id, block in enumerate(self.layers.values()):
            depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
            ffn = block.feed_forward
            for linear, std in (
                (block.attention.qkv_linear.wqkv, 0.02), (block.attention.wo, depth_std),
                (ffn.w1, 0.02), (ffn.w2, depth_std), (ffn.w3, depth_std),
            ):  # fmt: skip
                nn.init.trunc_normal_(linear.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.tp_mesh is not None:
            h = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
            # A DTensor op's output, as every later block's input is (global strides, a local
            # tensor that does not require grad): compiled block 0 then serves them all.
            h = h.view(h.shape)
        for block in self.layers.values():
            h = block(h)
        return h.to_local() if isinstance(h, DTensor) else h


# ---- parallelize, compile, load ----------------------------------------------------------------


def _gathered_input() -> PrepareModuleInput:
    """The attention / feed_forward boundary: in_src Shard(1) -> in_dst Replicate (all-gather)."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def block_plan() -> dict:
    """torchtitan's partial_dtensor placements for one block (decoder_sharding.py: norm_config,
    set_gqa_attention_sharding, set_dense_ffn_sharding with enable_sp=True)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": _gathered_input(),
        "attention.qkv_linear.wqkv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": _gathered_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _shard_weight_locally(linear: nn.Linear, mesh, dim: int) -> None:
    """This rank's plain shard of the weight (rank 0's values, scattered as DTensor does)."""
    local = distribute_tensor(linear.weight.detach(), mesh, [Shard(dim)]).to_local()
    linear.weight = nn.Parameter(local, requires_grad=linear.weight.requires_grad)


def _parallelize_dist_gemm(model: TitanLayers, mesh) -> None:
    """torchtitan's dist_gemm under spmd_types: local weight shards, local activations, the TP
    collectives inside the GEMMs. Its preconditions: sequence parallel (always here), fused QKV
    (always here), no bias on w1/w3 (none here)."""
    import torch.distributed._symmetric_memory  # noqa: F401  registers torch.ops.symm_mem

    group = mesh.get_group()
    tp = TpGroup(group.group_name, group.rank(), group.size())
    for block in model.layers.values():
        attention, ffn = block.attention, block.feed_forward
        for linear, dim in (
            (attention.qkv_linear.wqkv, 0), (attention.wo, 1), (ffn.w1, 0), (ffn.w3, 0), (ffn.w2, 1)
        ):  # fmt: skip
            _shard_weight_locally(linear, mesh, dim)
        attention.qkv_linear.tp = attention.wo.tp = ffn.tp = tp


def parallelize_titan(model: TitanLayers, mesh) -> TitanLayers:
    """torchtitan's TP + sequence parallel over the 1-D ``mesh``, per ``model.gemm_backend``."""
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_titan takes a 1-D TP mesh, got {mesh.ndim}-D")
    if mesh.size() == 1:
        return model  # torchtitan runs the stock projections at TP=1 (dist_gemm warns so)
    args = model.args
    if args.n_heads % mesh.size() or args.n_kv_heads % mesh.size():
        raise ValueError(f"TP degree {mesh.size()} must divide n_heads and n_kv_heads ({args})")
    if model.gemm_backend == "dist_gemm":
        _parallelize_dist_gemm(model, mesh)
        return model
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan())
    model.tp_mesh = mesh
    return model


def compile_titan(model: TitanLayers, **compile_kwargs) -> TitanLayers:
    """apply_compile: each block compiled on its own, whole-graph."""
    for block in model.layers.values():
        block.compile(fullgraph=True, **compile_kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def load_from_torchtitan(mirror: TitanLayers, titan_model: nn.Module) -> None:
    """Copy a parallelized torchtitan Llama 3's block weights into the mirror parallelized the
    same way: the names are the same, and so must be the placements and the local shards."""
    theirs = dict(titan_model.layers.named_parameters())
    ours = dict(mirror.layers.named_parameters())
    if theirs.keys() != ours.keys():
        raise ValueError(f"parameter names differ: {sorted(theirs.keys() ^ ours.keys())}")
    for name, param in ours.items():
        source = theirs[name]
        if (
            isinstance(param, DTensor)
            and isinstance(source, DTensor)
            and param.placements != source.placements
        ):
            raise ValueError(
                f"{name}: placements {param.placements} here, {source.placements} in torchtitan"
            )
        _local(param).copy_(_local(source))


if __name__ == "__main__":  # a module the tools import, not a tool: --help says what it is
    print(__doc__)
