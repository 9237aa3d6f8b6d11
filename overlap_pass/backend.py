"""overlap_backend: ``torch.compile(model, backend="overlap")``.

Inductor (compile_fx) with OverlapPass installed for the forward and the backward graphs, and
Inductor's own ``_micro_pipeline_tp`` off. ``mode`` and ``options`` work as for
backend="inductor".
"""

import torch

from .graph_pass import OverlapPass, with_overlap_pass


def overlap_config_patches(mode: str | None = None, options: dict | None = None) -> dict:
    """Inductor config patches for a compile with the overlap pass."""
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(options or {})
    slot = patches.get("post_grad_custom_pre_pass", torch._inductor.config.post_grad_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = with_overlap_pass(slot, OverlapPass(always=True))
    patches["_micro_pipeline_tp"] = False
    return patches


def overlap_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    """The torch.compile backend registered as "overlap" (entry point torch_dynamo_backends)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=overlap_config_patches(mode, options))
