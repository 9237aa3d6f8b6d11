"""Inductor's generated code calls the overlap ops' CUDA kernels directly, past torch's dispatcher.

Inductor's Python wrapper calls a custom op as ``torch.ops.overlap.<op>.default(...)``: the
dispatcher boxes every argument, passes the autograd and other dispatch keys (the ops have no
kernel there) and hands the arguments back to Python for ops/registry.py's CUDA kernel. That costs
about as much host time as the per-call CUDA graph's replay the call ends in (docs/benchmarks.md,
host time of an op call). So each op's lowering here makes the wrapper of a graph whose op runs on
CUDA import this module and call the kernel through it:

    buf9 = overlap_direct_calls.matmul_reduce_scatter([...], [...], None, 'sum', 0, 2, '0', out_dtype=None)

Everything else about the op's lowering is Inductor's own fallback (its layout constraint, the
outputs' size asserts). Under a profiler the call goes through the op still, so that traces
name it; ``config.direct_op_calls = False`` keeps every call on the op.
"""

import functools
import logging

import torch

from overlap_pass import config
from overlap_pass.ops import registry

log = logging.getLogger("overlap_pass")

ALIAS = "overlap_direct_calls"  # the name the generated code imports this module under
DEVICE_TYPES = ("cuda",)  # where the ops' kernels are this project's (elsewhere the reference)
_LOWERED: set = set()  # the ops whose lowering is this module's


def call(name: str, /, *args, **kwargs):
    """The op ``name``'s CUDA kernel on these arguments, as the dispatcher would call it; under
    torch's profiler the op itself, which the trace then names. (The profiler's state is read
    here, not through overlap_pass/torch_compat.py: this runs on every call, and the lowering is
    imported on first use.)"""
    if torch._C._autograd._profiler_enabled():
        return registry.overload(name)(*args, **kwargs)
    return registry.cuda_kernel(name, *args, **kwargs)


def attribute(name: str) -> str:
    """This module's attribute that calls the op ``name`` ("matmul_reduce_scatter.tail")."""
    return name.replace(".", "__")


def __getattr__(attribute_name: str):
    """The call of each registered op, made once per process on first use (a generated module
    loaded from Inductor's cache in a new process asks here too)."""
    name = attribute_name.replace("__", ".")
    if attribute_name.startswith("_") or not registry.is_registered(name):
        raise AttributeError(f"module {__name__!r} has no attribute {attribute_name!r}")
    made = globals()[attribute_name] = functools.partial(call, name)
    return made


def install_lowerings() -> None:
    """Makes Inductor lower each overlap op that runs on CUDA to a direct call: wraps its
    fallback lowering, once per op and process. Where Inductor's internals differ from what this
    expects, the ops keep their plain fallback (logged once)."""
    try:
        from torch._inductor import lowering
    except ImportError:
        return
    for name in registry.CUDA_OPS:
        op = registry.overload(name)
        if op in _LOWERED:
            continue
        try:
            if op not in lowering.lowerings:
                lowering.make_fallback(op, layout_constraint=lowering.constrain_to_fake_tensors, warn=False)
            lowering.lowerings[op] = _lowered_to_direct_calls(lowering.lowerings[op], op, name)
        except Exception as error:
            _tell_once(f"overlap: the ops' calls stay on torch's dispatcher: Inductor's lowering of {name}: {error!r}")
            return
        _LOWERED.add(op)


def _lowered_to_direct_calls(fallback, op, name: str):
    """``fallback`` (Inductor's lowering of ``op``), whose kernel node, where its tensors are on
    CUDA, generates a call of this module's ``attribute(name)``."""

    @functools.wraps(fallback)  # (keeps Inductor's mark of a fallback handler)
    def lower(*args, **kwargs):
        from torch._inductor import ir
        from torch._inductor.virtualized import V

        operations = getattr(V.graph, "operations", None)
        start = len(operations) if operations is not None and config.direct_op_calls else None
        result = fallback(*args, **kwargs)
        if start is not None:
            for node in operations[start:]:
                if isinstance(node, ir.FallbackKernel) and getattr(node, "op_overload", None) is op:
                    _call_directly(node, name)
        return result

    return lower


def _call_directly(node, name: str) -> None:
    """Makes ``node``'s code, in a Python wrapper, call ``attribute(name)`` of this module."""
    device = node.get_device()
    if device is None or device.type not in DEVICE_TYPES:
        return
    generate = node.codegen

    def codegen(wrapper):
        from torch._inductor.virtualized import V

        add_import = getattr(wrapper, "add_import_once", None)
        if add_import is not None and not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False):
            add_import(f"from overlap_pass.pipeline import direct_calls as {ALIAS}")
            node.python_kernel_name = f"{ALIAS}.{attribute(name)}"
        generate(wrapper)

    node.codegen = codegen


@functools.cache
def _tell_once(message: str) -> None:
    log.warning(message)
