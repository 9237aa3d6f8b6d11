"""overlap_backend: ``torch.compile(model, backend="overlap")``.

Inductor (compile_fx) with OverlapPass installed for the forward and the backward graphs, and
Inductor's own ``_micro_pipeline_tp`` off. ``mode`` and ``options`` work as for
backend="inductor". Inductor's shape padding is off (SAME_GRAPH_ON_EVERY_RANK). A graph on
symbolic token counts is compiled once per range of counts where its plain-TP splits pay only
from some count on (size_ranges.py), and once more without the pass, for a count's first calls
(new_counts.py).
"""

import torch

from . import new_counts, size_ranges
from .graph_pass import OverlapPass, with_overlap_pass
from .regather import RegatherPass

# Inductor settings every rank must share for its graphs to be the same: shape padding
# (pad_mm) benchmarks padded and unpadded matmuls on each rank on its own, so at a token count
# that is not a multiple of 8 one rank's graph padded K and V while the other's did not, the
# pass fused Q, K and V on one rank and Q alone on the other, and the ranks' collectives no
# longer matched (seen on 2xH100, 2026-11-27). overlap's ops are collective: off.
SAME_GRAPH_ON_EVERY_RANK = {"shape_padding": False}


# Inductor's mix-order reductions (a norm's backward: its per-token and its per-column sums in
# one kernel) are taken only above sizes that, on a symbolic token count, it checks by guarding
# on the count: each count outside the window the traced one set makes Dynamo recompile the
# whole frame (a block's forward and backward, 11-13 s on an H200). Without the size checks
# there is no guard, and the fused kernel ran as fast or faster from 2048 tokens on (one H200,
# 2026-11-29, RMSNorm forward and backward at dim 4096 bf16 on one symbolic graph, µs of kernel
# time: 37 / 55 / 104 / 399 at 2048 / 4096 / 8192 / 32768 tokens, against 44 / 80 / 104 / 398
# with the checks, which recompiled twice; 16.5 against 14.5 at 512).
NO_GUARDS_ON_TOKEN_COUNTS = {"triton.mix_order_reduction_non_strict_mode": True}


def overlap_config_patches(
    mode: str | None = None, options: dict | None = None, ranges: size_ranges.Ranges | None = None,
    symbolic: bool = False,
) -> dict:
    """Inductor config patches for a compile with the overlap pass (taking ``ranges``; for a
    graph on symbolic token counts where ``symbolic``)."""
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode)) if mode else {}
    if symbolic:
        patches.update(_known_settings(NO_GUARDS_ON_TOKEN_COUNTS))
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
        patches = overlap_config_patches(mode, options, ranges, symbolic=True)
        return compile_fx(gm, example_inputs, config_patches=patches)

    compiled = size_ranges.compile_per_range(compile_with, example_inputs)
    patches = overlap_config_patches(mode, options, symbolic=True)
    if not new_counts.applies(example_inputs, patches):
        return compiled
    readers = size_ranges.symbol_readers(example_inputs, _symbols(example_inputs))
    if readers is None:
        return compiled

    def compile_plain():
        return compile_fx(gm, example_inputs, config_patches=new_counts.plain_patches(patches))

    return new_counts.with_plain_first_calls(compiled, compile_plain, readers)


def _known_settings(settings: dict) -> dict:
    """The Inductor ``settings`` this torch has (dotted names, as config patches take them)."""
    known = torch._inductor.config.get_config_copy()
    return {name: value for name, value in settings.items() if name in known}


def _symbolic_shape(x) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)


def _symbols(example_inputs) -> set:
    """Every symbol of the graph's inputs' sizes (SymInt inputs and symbolic dims)."""
    sizes = [x for x in example_inputs if isinstance(x, torch.SymInt)]
    sizes += [s for x in example_inputs if isinstance(x, torch.Tensor) for s in x.shape if isinstance(s, torch.SymInt)]
    return {symbol for size in sizes for symbol in size.node.expr.free_symbols}
