"""Launching compiled Triton kernels with little host time.

A JIT launch (``kernel[grid](...)``) binds and specializes its arguments, looks its kernel up and
wraps the launch on every call: 15 µs of host time for the one-program barrier and 40 for the
consumer GEMM with its descriptors on the H200 machines, against 6 and 21 through the compiled
kernel's own launcher. Every op launches several kernels on the critical path, so they
go through ``DirectKernel``: the first call of a specialization compiles through the JIT, later
calls launch the compiled kernel.

The specialization key follows Triton's (runtime/jit.py, specialize_impl): a tensor's dtype and
whether its address is 16-byte aligned, an int's width and whether it is 1 or a multiple of 16,
a tensor descriptor's dtype and block, a tuple's elements each; the constexprs and launch
options as given. A kernel's ``do_not_specialize`` ints are keyed as the others (Triton then hands
the same compiled kernel to each key).
"""

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from overlap_pass.lowering import torch_compat


# the kernels' ints that change with a call's token count (the rows of a chunk, the chunks'
# batch): not specialized (``do_not_specialize``), so that a new count compiles nothing where
# Triton would compile again for each of 1 / a multiple of 16 / neither (400 ms a kernel, H100)
TOKEN_COUNTS = ("outer", "inner")


def specialization(args) -> tuple:
    """What Triton compiles separate kernels for, per runtime argument (see module docstring).
    Exact types first: this runs on every launch."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg >= 2**63))
        elif arg is None:
            key.append(None)
        elif kind is bool:
            key.append(bool)
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif kind is tuple:  # specialized element by element
            key.append(specialization(arg))
        elif hasattr(arg, "block_shape"):  # a host tensor descriptor
            key.append((arg.base.dtype, tuple(arg.block_shape), getattr(arg, "padding", None)))
        elif isinstance(arg, int):  # an int subclass (numpy's, sympy's)
            key.append(specialization((int(arg),))[0])
        else:  # floats: not specialized by value
            key.append(kind)
    return tuple(key)


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): launches then go through the JIT, which calls
    it. Triton 3.6 keeps hooks in a HookChain that is never None; older versions in a callable."""
    hook = knobs.runtime.launch_enter_hook
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


class DirectKernel:
    """``DirectKernel(kernel)[grid](*args, **meta)`` launches like ``kernel[grid](*args, **meta)``
    (args positional, every constexpr and option by name). The kernel's constexpr parameters must
    come after its runtime ones. Under TRITON_INTERPRET=1, or while a launch hook is set (a
    profiler's), every launch goes through the JIT."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args: tuple, meta: dict) -> None:
        if not isinstance(self.kernel, JITFunction) or _hooked():
            self.kernel[grid](*args, **meta)
            return
        device = torch.cuda.current_device()
        key = (device, tuple(meta.items()), specialization(args))
        entry = self._compiled.get(key)
        if entry is None:
            self._compiled[key] = (self.kernel[grid](*args, **meta), self._constexprs(len(args), meta))
            return
        compiled, constexprs = entry
        compiled.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            torch_compat.current_raw_stream(device), compiled.function, compiled.packed_metadata,
            None, None, None, *args, *constexprs,
        )  # fmt: skip

    def _constexprs(self, num_args: int, meta: dict) -> tuple:
        """The constexpr values in parameter order, which the compiled launcher takes after the
        runtime arguments."""
        params = self.kernel.params
        if any(p.is_constexpr for p in params[:num_args]) or len(params) < num_args:
            raise TypeError(
                f"{self.kernel.__name__}: DirectKernel needs the {num_args} runtime arguments first, "
                "then the constexprs by name"
            )
        return tuple(meta.get(p.name, p.default) for p in params[num_args:])
