"""Registers overlap's ops with torch: each family's schemas, fake kernels and references, and
one CUDA kernel per op that calls the op's entry point in lowering/dispatch.py.

Importing this module registers every op (``import overlap_pass`` does; so does every pass
stage that inserts them). The lowering is imported at an op's first CUDA call, not here: it
imports triton, which a CPU install need not have, and it imports the op families below this
module, never this module.
"""

import functools

import torch

from .. import torch_compat
from . import all_reduce_op, matmul_ops, scaled_ops

FAMILIES = (matmul_ops, scaled_ops, all_reduce_op)


def is_registered(name: str) -> bool:
    """``name``: an op ("all_reduce") or an overload ("matmul_reduce_scatter.tail")."""
    try:
        overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True


def overload(name: str):
    """The OpOverload of ``name`` ("all_reduce", "matmul_reduce_scatter.tail")."""
    op_name, _, overload_name = name.partition(".")
    return getattr(getattr(torch.ops.overlap, op_name), overload_name or "default")


# every op with a CUDA kernel (cuda_kernel), by name: pipeline/direct_calls.py lowers each
CUDA_OPS: list[str] = []


def register(schemas: dict[str, str], kernels: dict) -> None:
    """Defines ops ``{name: (fake, reference)}`` with their fake and reference kernels and the
    CUDA dispatch, once per process, so that reloading a module is harmless."""
    for name, (fake, reference) in kernels.items():
        if name not in CUDA_OPS:
            CUDA_OPS.append(name)
        if is_registered(name):
            continue
        # Inductor then requires each input in the strides the pass saw (the node's
        # eager_input_vals, graph/edits.call); untagged, an op a custom pass inserted gets its
        # inputs in whatever layout Inductor picks, and cuBLASLt's _scaled_mm wants a
        # column-major mat2
        torch.library.define(f"overlap::{name}", schemas[name], tags=(torch.Tag.needs_exact_strides,))
        torch.library.register_fake(f"overlap::{name}", fake)
        torch.library.impl(f"overlap::{name}", "CompositeExplicitAutograd", reference)
        torch.library.impl(f"overlap::{name}", "CUDA", functools.partial(cuda_kernel, name))


def cuda_kernel(name: str, *args, **kwargs):
    """CUDA tensors: the variant lowering/choose.py picks, below autograd, as a C++ kernel runs:
    the op has no derivative of its own (a graph's backward calls other ops), and the
    collectives inside then skip their Python autograd wrappers."""
    kernel = _CUDA_KERNELS.get(name)
    if kernel is None:
        # deferred: the lowering imports triton (optional on a CPU install); it never imports
        # this module, so this is no circle
        from ..lowering import dispatch

        kernel = _CUDA_KERNELS[name] = getattr(dispatch, name.replace(".", "_"))
    with torch_compat.below_autograd():
        return kernel(*args, **kwargs)


# op name -> its entry point in lowering/dispatch.py, looked up once (an import statement costs
# the host microseconds on every call)
_CUDA_KERNELS: dict = {}


def look_up_entry_points_again() -> None:
    """The CUDA kernels' next calls look their entry points up in lowering/dispatch.py anew:
    for a tool that wraps them there (benchmarks/measure.py counts the op calls)."""
    _CUDA_KERNELS.clear()


for family in FAMILIES:
    register(family.SCHEMAS, family.KERNELS)
