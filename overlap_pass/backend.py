"""overlap_backend: ``torch.compile(model, backend="overlap")``.

Inductor (compile_fx) with OverlapPass installed for the forward and the backward graphs, and
Inductor's own ``_micro_pipeline_tp`` off. ``mode`` and ``options`` work as for
backend="inductor". Inductor's shape padding is off (SAME_GRAPH_ON_EVERY_RANK). A graph on
symbolic token counts is compiled once per range of counts where its plain-TP splits pay only
from some count on (shapes/size_ranges.py), and once more without the pass, for a count's first
calls (shapes/new_counts.py).
"""

import hashlib

import torch
from torch._inductor import list_mode_options
from torch._inductor import compile_fx as inductor  # (its compile_fx looked up at each call)

from .pipeline.install import with_overlap_pass
from .pipeline.passes import (
    SAME_GRAPH_ON_EVERY_RANK, OverlapPass, RegatherPass, current_rank, settings_key, source_hash,
)
from .shapes import new_counts, size_ranges

# Inductor's mix-order reductions (a norm's backward: its per-token and its per-column sums in
# one kernel) are taken only above sizes that, on a symbolic token count, it checks by guarding
# on the count: each count outside the window the traced one set makes Dynamo recompile the
# whole frame (a block's forward and backward: seconds). Without the size checks there is no
# guard, and the fused kernel runs as fast or faster at the counts that matter
# (docs/rewrites.md#what-a-compile-costs).
NO_GUARDS_ON_TOKEN_COUNTS = {"triton.mix_order_reduction_non_strict_mode": True}


def overlap_config_patches(
    mode: str | None = None, options: dict | None = None, ranges: size_ranges.Ranges | None = None,
    symbolic: bool = False,
) -> dict:
    """Inductor config patches for a compile with the overlap pass (taking ``ranges``; for a
    graph on symbolic token counts where ``symbolic``)."""
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
    if not any(isinstance(x, torch.SymInt) or _symbolic_shape(x) for x in example_inputs):
        return inductor.compile_fx(gm, example_inputs, config_patches=overlap_config_patches(mode, options))

    def compile_with(ranges: size_ranges.Ranges):
        patches = overlap_config_patches(mode, options, ranges, symbolic=True)
        return inductor.compile_fx(gm, example_inputs, config_patches=patches)

    record = _record_key(gm, example_inputs, mode, options)
    compiled = size_ranges.compile_per_range(compile_with, example_inputs, record)
    patches = overlap_config_patches(mode, options, symbolic=True)
    if not new_counts.applies(example_inputs, patches):
        return compiled
    readers = size_ranges.symbol_readers(example_inputs, size_ranges.input_symbols(example_inputs))
    if readers is None:
        return compiled

    def compile_plain():
        return inductor.compile_fx(gm, example_inputs, config_patches=new_counts.plain_patches(patches))

    return new_counts.with_plain_first_calls(compiled, compile_plain, readers)


def _known_settings(settings: dict) -> dict:
    """The Inductor ``settings`` this torch has (dotted names, as config patches take them)."""
    known = torch._inductor.config.get_config_copy()
    return {name: value for name, value in settings.items() if name in known}


def _symbolic_shape(x) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)


def _record_key(gm: torch.fx.GraphModule, example_inputs, mode, options) -> str:
    """A key of everything that decides what the pass finds in this graph (size_ranges.py): the
    graph and its parameters, its inputs' sizes, strides and dtypes and the sizes they were traced
    at, the compile's mode and options, Inductor's, AOTAutograd's and overlap's settings and
    sources, the rank, the torch release. The same in every process that compiles the same graph
    alike (Inductor's settings as its cache reads them, without the objects in its pass slots)."""
    digest = hashlib.sha256()
    for part in (
        gm.code, [(name, _input_key(p)) for name, p in [*gm.named_parameters(), *gm.named_buffers()]],
        [_input_key(x) for x in example_inputs], mode, _options_key(options),
        sorted(torch._inductor.config.save_config_portable().items(), key=str),
        sorted(torch._functorch.config.save_config_portable().items(), key=str),
        settings_key(), source_hash(), current_rank(), torch.__version__,
    ):  # fmt: skip
        digest.update(repr(part).encode())
    return digest.hexdigest()[:32]


def _input_key(x):
    """An input as the key sees it: sizes and strides with their symbols and traced values."""
    if isinstance(x, torch.Tensor):
        return tuple(map(_size_key, x.shape)), tuple(map(_size_key, x.stride())), str(x.dtype), x.device.type
    return _size_key(x) if isinstance(x, torch.SymInt) else type(x).__name__


def _size_key(size) -> str:
    if isinstance(size, torch.SymInt):
        return f"{size.node.expr}={size.node.hint}"
    return str(size)


def _options_key(options: dict | None) -> list:
    """The options by name, and by value where a value reads the same in every process (an
    object's repr may hold its address)."""
    plain = (bool, int, float, str, type(None))
    return sorted((k, v if isinstance(v, plain) else type(v).__name__) for k, v in (options or {}).items())
