"""Hand-written plain TP (Megatron without sequence parallel) through functional collectives,
for the fake-group graph tests and the gloo numerics."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def row_then_column(x, residual, w_row, w_col, norm_weight, group):
    """residual + all_reduce(x @ w_row) -> RMSNorm -> @ w_col (Megatron without SP)."""
    h = residual + funcol.all_reduce(x @ w_row, "sum", group)
    return F.silu(rms_norm(h, norm_weight) @ w_col), h


def mean_over_tokens(x, residual, w_row, w_col, norm_weight, group):
    """A mean over the sequence is not row-wise: it reads the gathered tensor."""
    h = residual + funcol.all_reduce(x @ w_row, "sum", group)
    return rms_norm(h, norm_weight) @ w_col, h.mean(0)


def rank_local_operand(x, residual, w_row, w_col, norm_weight, group):
    """x @ w_row2 differs between ranks, so it cannot be cut to the shard: the add reads the
    gathered tensor."""
    h = funcol.all_reduce(x @ w_row, "sum", group)
    return rms_norm(h, norm_weight) @ w_col, h + x @ (w_row * 2)


def max_reduced(x, residual, w_row, w_col, norm_weight, group):
    return rms_norm(funcol.all_reduce(x @ w_row, "max", group), norm_weight) @ w_col
