"""What the matchers accept of a matmul, on either side of a collective: a static contraction
dim, an addmm's bias, a _scaled_mm's scales and out_dtype, and a bmm that is a linear (one
matrix for every batch element, or a product summed over its batch). Each check raises NoMatch
with the reason, or says yes or no.
"""

import torch
from torch.fx import Node

from ..graph.nodes import meta_val, scaled_mm_args, tensor_shape
from ..graph.sizes import same, same_shape, static_shape
from .matches import NoMatch

aten = torch.ops.aten

SYMBOLIC_FEATURES = "a symbolic feature dim (the matmul's K): only token dims may be dynamic"


def require_static_features(*nodes: Node) -> None:
    """The last dim (a matmul's K) must be an int; the leading (token) dims may be symbolic."""
    for node in nodes:
        shape = tensor_shape(node)
        if shape and not static_shape(shape[-1:]):
            raise NoMatch(SYMBOLIC_FEATURES)


def shared_matrix(mat2: Node) -> bool:
    """Whether a bmm's mat2 [B, K, N] is one matrix for every batch element: a batch of 1, or a
    batch dim of stride 0 (a 2-D weight unsqueezed and expanded, as NeMo Automodel's linear
    writes it under torch.compile). Such a bmm is one matmul over its flattened rows."""
    val = meta_val(mat2)
    return isinstance(val, torch.Tensor) and val.dim() == 3 and (same(val.shape[0], 1) or same(val.stride(0), 0))


def batch_sum(bmm: Node) -> Node | None:
    """The node holding sum over the batch of ``bmm``'s products: the bmm itself for a batch
    of 1, else its only user where that sums dim 0; None otherwise."""
    if same(tensor_shape(bmm)[0], 1):
        return bmm
    users = list(bmm.users)
    if len(users) != 1 or users[0].target is not aten.sum.dim_IntList or users[0].kwargs.get("dtype") is not None:
        return None
    dims = users[0].args[1] if len(users[0].args) > 1 else None
    return users[0] if dims is not None and [d % 3 for d in dims] == [0] else None


def _is_unit(value) -> bool:
    return value in (1, 1.0)


def bias_of_addmm(mm: Node) -> Node:
    """The 1-D bias of an addmm with default alpha and beta, or NoMatch."""
    if not (_is_unit(mm.kwargs.get("alpha", 1)) and _is_unit(mm.kwargs.get("beta", 1))):
        raise NoMatch("addmm with alpha or beta other than 1")
    bias, out = mm.args[0], tensor_shape(mm)
    shape = tensor_shape(bias)
    if shape is None or out is None or not same_shape(shape, out[-1:]):
        described = list(shape) if shape is not None else "?"
        raise NoMatch(f"addmm bias of shape {described} is not one value per output column")
    return bias


def check_scaled_mm(mm: Node) -> dict:
    """The arguments of a _scaled_mm the scaled ops take, or NoMatch."""
    named = scaled_mm_args(mm)
    if named["scale_result"] is not None:
        raise NoMatch("_scaled_mm with a result scale (a float8 output)")
    if named["out_dtype"] not in (torch.bfloat16, torch.float16, torch.float32):
        raise NoMatch(f"_scaled_mm with out_dtype {named['out_dtype']}")
    for name in ("scale_a", "scale_b"):
        val = meta_val(named[name])
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            raise NoMatch(f"_scaled_mm whose {name} is not a float32 tensor")
    b_scale = meta_val(named["scale_b"])
    if not (tensorwise(b_scale) or tuple(b_scale.shape) == (1, tensor_shape(mm)[-1])):
        raise NoMatch(f"_scaled_mm whose scale_b of shape {list(b_scale.shape)} is neither one value nor [1, N]")
    return named


def tensorwise(scale: torch.Tensor) -> bool:
    return scale.dim() <= 1 and same(scale.numel(), 1)
