"""overlap_backend: ``torch.compile(model, backend="overlap")``.

Inductor (compile_fx) with OverlapPass installed for the forward and the backward graphs, and
Inductor's own ``_micro_pipeline_tp`` off. ``mode`` and ``options`` work as for
backend="inductor". Inductor's shape padding is off (SAME_GRAPH_ON_EVERY_RANK). A graph on
symbolic token counts is compiled once per range of counts where its plain-TP splits pay only
from some count on (size_ranges.py).
"""

import torch

from . import size_ranges
from .graph_pass import OverlapPass, with_overlap_pass
from .regather import RegatherPass

# Inductor settings every rank must share for its graphs to be the same: shape padding
# (pad_mm) benchmarks padded and unpadded matmuls on each rank on its own, so at a token count
# that is not a multiple of 8 one rank's graph padded K and V while the other's did not, the
# pass fused Q, K and V on one rank and Q alone on the other, and the ranks' collectives no
# longer matched (seen on 2xH100, 2026-11-27). overlap's ops are collective: off.
SAME_GRAPH_ON_EVERY_RANK = {"shape_padding": False}


def overlap_config_patches(
    mode: str | None = None, options: dict | None = None, ranges: size_ranges.Ranges | None = None
) -> dict:
    """Inductor config patches for a compile with the overlap pass (taking ``ranges``)."""
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(options or {})
    slot = patches.get("post_grad_custom_pre_pass", torch._inductor.config.post_grad_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = with_overlap_pass(slot, OverlapPass(always=True, ranges=ranges))
    joint = patches.get("joint_custom_pre_pass", torch._inductor.config.joint_custom_pre_pass)
    patches["joint_custom_pre_pass"] = with_overlap_pass(joint, RegatherPass(always=True))
    patches["_micro_pipeline_tp"] = False
    patches.update(SAME_GRAPH_ON_EVERY_RANK)
    return patches


def overlap_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The torch.compile backend registered as "overlap" (entry point torch_dynamo_backends)."""
    from torch._inductor.compile_fx import compile_fx

    if not any(isinstance(x, torch.SymInt) or _symbolic_shape(x) for x in example_inputs):
        return compile_fx(gm, example_inputs, config_patches=overlap_config_patches(mode, options))

    def compile_with(ranges: size_ranges.Ranges):
        return compile_fx(gm, example_inputs, config_patches=overlap_config_patches(mode, options, ranges))

    return size_ranges.compile_per_range(compile_with, example_inputs)


def _symbolic_shape(x) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
