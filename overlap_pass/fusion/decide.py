"""should_fuse(match) -> (bool, reason): whether a matched pair is worth and safe to rewrite,
and which implementation its op will run."""

import os

import torch
import torch.distributed as dist

from .. import config
from ..graph.nodes import meta_val
from ..graph.sizes import divisible, static_shape
from ..ops import scaled_ops
from .matches import AllGatherMatmulMatch, Match, MatmulReduceScatterMatch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tensors(match: Match) -> list[torch.Tensor]:
    if isinstance(match, AllGatherMatmulMatch):
        nodes = [match.shard, match.gathered] + [
            n for use in match.matmuls for n in (use.mm, use.mat2, use.bias) if n is not None
        ]
        nodes += [n for use in match.contractions for n in (use.mm, use.other)]
    else:
        nodes = [
            n for t in match.terms for n in (t.input, t.mat2, t.bias, t.mm) if n is not None
        ]
    return [meta_val(n) for n in nodes]


def _weights(match: Match) -> list[torch.Tensor]:
    """The tensors whose every dim must be an int: the weights and biases (a bmm's shared mat2
    may repeat over a symbolic batch: its matrix is what counts)."""
    if isinstance(match, AllGatherMatmulMatch):
        nodes = [n for use in match.matmuls for n in (use.mat2, use.bias) if n is not None]
    else:
        nodes = [n for t in match.terms for n in (t.mat2, t.bias) if n is not None]
    return [_matrix(meta_val(n)) for n in nodes]


def symbolic(match: Match) -> bool:
    """Whether the match's token dims are symbolic (a dynamic-shape graph)."""
    node = match.shard if isinstance(match, AllGatherMatmulMatch) else match.scattered
    return not static_shape(meta_val(node).shape)


def group_ranks(group_name: str) -> list[int] | None:
    """Global ranks of a group, or None where the group cannot be resolved here."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return dist.get_process_group_ranks(_resolve_process_group(group_name))
    except Exception:
        return None


def spans_hosts(ranks: list[int]) -> bool:
    """Whether ranks sit on different hosts, by torchrun's LOCAL_WORLD_SIZE (ranks are laid
    out host by host). Unknown layouts count as one host."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return per_host > 0 and len({r // per_host for r in ranks}) > 1


def _matrix(mat2: torch.Tensor) -> torch.Tensor:
    """The [K, N] matrix the op takes: a bmm's shared mat2 [B, K, N] gives its first element."""
    return mat2[0] if mat2.dim() == 3 else mat2


def _choice_key(match: Match) -> str:
    """The key lowering/choose.py files the match's per-shape choice under."""
    from overlap_pass.lowering import choose, dispatch

    if isinstance(match, AllGatherMatmulMatch):
        shard = meta_val(match.shard)
        shapes = dispatch.all_gather_matmul_shapes(
            shard.shape,
            [_matrix(meta_val(use.mat2)) for use in match.matmuls],
            [use.bias for use in match.matmuls],
            match.gather_dim % shard.dim(),
            # contract_with is [M, K]: K is the last dim of mm(g^T, other) and the first of
            # other @ g (of each product of a bmm)
            [(meta_val(u.mm).shape[-1 if u.gathered_left else -2], u.gathered_left) for u in match.contractions],
        )
        return choose.shape_key("all_gather_matmul", match.world_size, shapes, shard.dtype)
    # the rewrite reshapes each mm's input to the scattered layout and sums the biases (rewrite.py)
    scattered = meta_val(match.scattered)
    input_shapes = [[*scattered.shape[:-1], meta_val(t.input).shape[-1]] for t in match.terms]
    shapes = dispatch.matmul_reduce_scatter_shapes(
        input_shapes, [_matrix(meta_val(t.mat2)) for t in match.terms],
        any(t.bias is not None for t in match.terms), match.reduce_op,
        match.scatter_dim % scattered.dim(), match.out_dtype,
    )  # fmt: skip
    dtype = meta_val(match.terms[0].input).dtype
    return choose.shape_key("matmul_reduce_scatter", match.world_size, shapes, dtype)


def _variant_names(match: Match) -> list[str]:
    """The variants lowering/choose.py picks the match's op from."""
    from overlap_pass.lowering import dispatch

    if isinstance(match, AllGatherMatmulMatch):
        return list(dispatch._ag_variants(len(match.matmuls)))
    return list(dispatch._rs_variants(len(match.terms)))


FIRST_CALL = "auto: measured at the first call"
PER_SHAPE = "auto: chosen per shape at run time (symbolic token dims)"


def choose_implementation(match: Match) -> str:
    """Which implementation the rewritten op runs, as decisions.json shows it. CUDA tensors: a
    forced variant, the cached per-shape choice, or "auto" until the first call measures
    (lowering/choose.py). Everything else runs the reference decomposition."""
    device = meta_val(match.shard if isinstance(match, AllGatherMatmulMatch) else match.scattered).device
    if device.type != "cuda":
        return "reference"
    if config.implementation != "auto":
        return config.implementation
    if symbolic(match):
        return PER_SHAPE
    if getattr(match, "scaled", None) is not None:
        # float8 (lowering/scaled.py): its key holds the passengers, attached after this
        return FIRST_CALL
    try:
        from torch._inductor import config as inductor_config

        from overlap_pass.lowering import choose

        key = _choice_key(match)
        if inductor_config.triton.cudagraphs:  # reduce-overhead: the choice timed as replays
            key += choose.GRAPHS_KEY
        cached = choose.cached_choice(key, _variant_names(match))
    except Exception as e:  # the choice is only shown here; never fail compilation over it
        return f"auto (no cached choice: {e})"
    return f"auto: {cached} (cached)" if cached else FIRST_CALL


def _plain_dtypes(tensors: list[torch.Tensor]) -> str:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(d) for d in dtypes)}"
    (dtype,) = dtypes
    return "" if dtype in SUPPORTED_DTYPES else f"dtype {dtype} is not supported"


def _scaled_dtypes(match: Match) -> str:
    """Float8 matches: float8 operands, results in a dtype the ops write."""
    if isinstance(match, AllGatherMatmulMatch):
        operands = [match.gathered] + [use.mat2 for use in match.matmuls]
        results = [use.mm for use in match.matmuls]
    else:
        operands = [n for t in match.terms for n in (t.input, t.mat2)]
        results = [t.mm for t in match.terms]
    dtypes = {meta_val(n).dtype for n in operands}
    if not dtypes <= set(scaled_ops.FLOAT8):
        return f"scaled matmul operands of dtypes {sorted(str(d) for d in dtypes)}"
    out = {meta_val(n).dtype for n in results} | {match.scaled.out_dtype}
    if len(out) != 1 or not out <= set(SUPPORTED_DTYPES):
        return f"scaled matmul results of dtypes {sorted(str(d) for d in out)}"
    return ""


def should_fuse(match: Match) -> tuple[bool, str]:
    """(True, "") when the match should be rewritten, else (False, reason)."""
    if isinstance(match, AllGatherMatmulMatch) and not config.all_gather_matmul:
        return False, "disabled by overlap_pass.config.all_gather_matmul"
    if isinstance(match, MatmulReduceScatterMatch) and not config.matmul_reduce_scatter:
        return False, "disabled by overlap_pass.config.matmul_reduce_scatter"
    if config.implementation not in config.IMPLEMENTATIONS:
        return False, (
            f"overlap_pass.config.implementation={config.implementation!r}; "
            f"expected one of {config.IMPLEMENTATIONS}"
        )
    if match.world_size == 1:
        return False, "group of size 1: the collective is a copy, nothing to overlap"
    tensors = _tensors(match)
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return False, "missing tensor metadata on a matched node"
    if not all(static_shape(t.shape) for t in _weights(match)):
        return False, "a weight or bias of symbolic shape: only token dims may be dynamic"
    reason = _scaled_dtypes(match) if match.scaled is not None else _plain_dtypes(tensors)
    if reason:
        return False, reason
    devices = {t.device.type for t in tensors}
    if len(devices) != 1 or devices & {"meta"}:
        return False, f"tensors on devices {sorted(devices)}"
    if devices == {"cuda"}:
        ranks = group_ranks(match.group_name)
        if ranks is not None and spans_hosts(ranks):
            return False, "group spans hosts: the overlapped ops need every rank on one host"
    if isinstance(match, MatmulReduceScatterMatch):
        rows = meta_val(match.scattered).shape[match.scatter_dim]
        if not divisible(rows, match.world_size):
            known = "divisible" if isinstance(rows, int) else "known to be divisible"
            return False, f"scatter dim size {rows} is not {known} by world size {match.world_size}"
    return True, ""
