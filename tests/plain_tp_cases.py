"""Hand-written plain TP (Megatron without sequence parallel) through functional collectives,
for the fake-group graph tests and the gloo numerics."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from overlap_pass.regions import passengers

AGM, MRS, SPLIT = "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_split"


def block_decisions() -> list:
    """The candidates of benchmarks.tp_models' block under parallelize_block_plain, forward and
    backward, as (kind, rewritten, reason), sorted. Forward: 2 all-reduces split -> 2 fused
    reduce-scatters, the FFN's gather fused, 2 saved activations riding in it, the block output
    gathered plainly. Backward: 5 all-reduces (Q, K, V, gate, up input grads) -> 2 fused
    reduce-scatters of sums, the gather of the block output's grad fused with O's grads, the
    input grad gathered plainly."""
    plain = (AGM, False, "no matmul reads the gathered rows; users: output (output)")
    no_host = (passengers.KIND, False, "its shard is computed from the results of every fused all-gather op of the same rows")
    return sorted(
        [(SPLIT, True, None)] * 7 + [(AGM, True, None)] * 2 + [plain] * 4 + [(MRS, True, None)] * 4
        + [(passengers.KIND, True, None)] * 2 + [no_host] * 2,
        key=str,
    )  # fmt: skip


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


def sums_over_tokens(x, residual, w_row, w_col, norm_weight, group):
    """A bias added after the all-reduce, then reductions over every token (a bias's gradient,
    float8's amax): on padded shards the padding rows hold the bias, which they must not read."""
    h = funcol.all_reduce(x @ w_row, "sum", group) + norm_weight
    return rms_norm(h, norm_weight) @ w_col, h.sum(0), h.amax(0), h.amin(0)


def max_reduced(x, residual, w_row, w_col, norm_weight, group):
    return rms_norm(funcol.all_reduce(x @ w_row, "max", group), norm_weight) @ w_col
