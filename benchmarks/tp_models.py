"""Small tensor-parallel models for the demo and the tests.

Sequence parallel in the torchtitan layout: activations between blocks are sharded along the
sequence (dim 1); each block all-gathers its normed input once, runs column-parallel linears on
it, and reduce-scatters the output of its row-parallel linear. Plain TP (``parallelize_block_plain``):
activations are replicated, each row-parallel linear ends in an all-reduce.
"""

from collections.abc import Collection

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


Bias = bool | Collection[str]


def has_bias(bias: Bias, name: str) -> bool:
    """``bias``: True or False for every linear, or the names of the linears that get one
    (q, k, v, o, gate, up, down)."""
    return bias if isinstance(bias, bool) else name in bias


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: Bias = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=has_bias(bias, "gate"))
        self.up = nn.Linear(dim, hidden, bias=has_bias(bias, "up"))
        self.down = nn.Linear(hidden, dim, bias=has_bias(bias, "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Causal self-attention with separate Q, K, V linears; heads are split across ranks.
    ``kv_heads`` < ``heads`` is grouped-query attention (Llama 3): each K/V head serves
    heads / kv_heads query heads."""

    def __init__(self, dim: int, heads: int, bias: Bias = False, kv_heads: int | None = None) -> None:
        super().__init__()
        kv_heads = kv_heads or heads
        self.head_dim = dim // heads
        self.group = heads // kv_heads
        self.q = nn.Linear(dim, dim, bias=has_bias(bias, "q"))
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=has_bias(bias, "k"))
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=has_bias(bias, "v"))
        self.o = nn.Linear(dim, dim, bias=has_bias(bias, "o"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        if self.group > 1:
            k, v = (t.repeat_interleave(self.group, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(
        self, dim: int = 64, heads: int = 4, hidden: int = 128, bias: Bias = False,
        kv_heads: int | None = None,
    ):  # fmt: skip
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, bias, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class MLP(nn.Module):
    """up -> gelu -> down."""

    def __init__(self, dim: int = 64, hidden: int = 128, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _gathered_input() -> PrepareModuleInput:
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def parallelize_block(block: TransformerBlock, mesh) -> TransformerBlock:
    """Megatron TP + sequence parallel; the block takes and returns [batch, seq / W, dim]."""
    plan = {
        "attention": _gathered_input(),
        "attention.q": ColwiseParallel(),
        "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(),
        "attention.o": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward": _gathered_input(),
        "feed_forward.gate": ColwiseParallel(),
        "feed_forward.up": ColwiseParallel(),
        "feed_forward.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(block, mesh, plan)


def parallelize_block_plain(block: TransformerBlock, mesh) -> TransformerBlock:
    """Megatron TP without sequence parallel (Hugging Face's tp_plan, torchtitan with SP off):
    the block takes and returns the whole [batch, seq, dim] on every rank."""
    plan = {f"attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {f"feed_forward.{name}": ColwiseParallel() for name in ("gate", "up")}
    plan |= {"attention.o": RowwiseParallel(), "feed_forward.down": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)


def parallelize_mlp(mlp: MLP, mesh) -> MLP:
    """up column-parallel, down row-parallel, sequence-parallel input and output (dim 1)."""
    plan = {
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(mlp, mesh, plan)


if __name__ == "__main__":  # a module the tools import, not a tool: --help says what it is
    print(__doc__)
