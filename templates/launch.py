"""Launching compiled Triton kernels with little host time.

A JIT launch (``kernel[grid](...)``) binds and specializes its arguments, looks its kernel up and
wraps the launch on every call: about twice the host time or more of a launch through the
compiled kernel's own launcher, for the one-program barrier as for the consumer GEMM with its
descriptors. Every op launches several kernels on the critical path, so they go through
``DirectKernel``: the first call of a specialization compiles through the JIT, later calls
launch the compiled kernel.

The specialization key follows Triton's (runtime/jit.py, specialize_impl): a tensor's dtype and
whether its address is 16-byte aligned, an int's width and whether it is 1 or a multiple of 16,
a tensor descriptor's dtype and block, a tuple's elements each; the constexprs and launch
options as given. A kernel's ``do_not_specialize`` ints are keyed as the others (Triton then hands
the same compiled kernel to each key).

Compiling ahead: a variant's first call compiles its kernels (a persistent GEMM takes up to a
couple of seconds for sm_90a), and a shape's first measurement (choose.py) calls every variant,
one after another. Triton compiles mostly outside the GIL, so threads take them at once: the
first calls of every config of both ops take about half as long compiled ahead, the float8 ops'
about two thirds (docs/ops.md#the-per-shape-choice, first calls compile). Inside
``compiling_ahead()``, a template decorated ``compiles_other_configs`` hands, before its call's
first compile, what the same call would launch under each other config of its family to a
thread pool (``compile_only``: the kernels are compiled, nothing is launched), and a launch
whose kernel is still compiling there waits for it instead of compiling it again.
"""

import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from overlap_pass import torch_compat

log = logging.getLogger("overlap_pass")


# the kernels' ints that change with a call's token count (the rows of a chunk, the chunks'
# batch): not specialized (``do_not_specialize``), so that a new count compiles nothing where
# Triton would compile again for each of 1 / a multiple of 16 / neither (hundreds of ms a kernel)
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
        elif hasattr(arg, "block_shape"):  # a host tensor descriptor (Gluon's has a layout)
            key.append((arg.base.dtype, tuple(arg.block_shape), getattr(arg, "padding", None), getattr(arg, "layout", None)))
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
        self._pending: dict[tuple, concurrent.futures.Future] = {}  # compiling on the pool

    def _compile_on_pool(self, key: tuple, device: int, grid, args: tuple, meta: dict) -> None:
        if key in self._pending:
            return
        kernel = self.kernel
        caches = getattr(kernel, "device_caches", None)  # (a defaultdict in triton 3.6 to 3.9)
        if caches is not None:
            caches[device]  # the JIT's cache of this device made here, not by two pool threads at once

        def compile_kernel():
            try:
                with torch.cuda.device(device):
                    kernel.warmup(*args, grid=grid, **meta)
            except Exception:  # not kept: its traceback's frames would hold the call's tensors
                pass  # the launch of this config compiles it again and raises there

        self._pending[key] = future = _pool().submit(compile_kernel)
        started = _AHEAD.get()
        if started is not None:
            started.append(future)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args: tuple, meta: dict) -> None:
        if not isinstance(self.kernel, JITFunction) or _hooked():
            if not _COMPILE_ONLY.get():
                self.kernel[grid](*args, **meta)
            return
        device = torch.cuda.current_device()
        key = (device, tuple(meta.items()), specialization(args))
        entry = self._compiled.get(key)
        if _COMPILE_ONLY.get():  # compiled or compiling: nothing to do; never launched
            if entry is None:
                self._compile_on_pool(key, device, grid, args, meta)
            return
        if entry is None:
            _before_first_compile()  # (its configs may share this key: then it compiles there)
            pending = self._pending.pop(key, None)
            if pending is not None:
                pending.result()  # waits; a compile that failed there fails again below, raised
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


# inside compiling_ahead(): the compiles it started (a list), else None
_AHEAD = contextvars.ContextVar("overlap_compiling_ahead", default=None)
_COMPILE_ONLY = contextvars.ContextVar("overlap_compile_only", default=False)
# what a template call runs before its first compile (compiles_other_configs), once
_BEFORE_COMPILE = contextvars.ContextVar("overlap_before_compile", default=None)


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Up to 8 threads, and no more than this process's share of the cores it may run on
    (torchrun's LOCAL_WORLD_SIZE processes share them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return concurrent.futures.ThreadPoolExecutor(max(1, min(8, share)), thread_name_prefix="overlap-compile")


@contextlib.contextmanager
def compiling_ahead(enabled: bool = True, wait: bool = True):
    """While open, templates decorated ``compiles_other_configs`` compile their other configs'
    kernels on a thread pool at their first compile (module docstring); not where ``enabled``
    is false (config.compile_ahead). With ``wait``, leaving waits for the compiles it started
    (the ones no call waited for: configs no variant runs), so that none takes the host's time
    from what follows (a measurement's timing)."""
    started = [] if enabled else None
    token = _AHEAD.set(started)
    try:
        yield
    finally:
        _AHEAD.reset(token)
        if wait and started:
            concurrent.futures.wait(started)


def compile_only(launch_fn, *args, **kwargs) -> None:
    """``launch_fn(*args, **kwargs)`` with every DirectKernel launch it makes compiled on the
    pool instead of launched. What it cannot build (a config that does not fit these operands)
    is left to the call that runs that config, which raises it there."""
    token = _COMPILE_ONLY.set(True)
    try:
        launch_fn(*args, **kwargs)
    except Exception as error:
        log.debug("overlap: compiling %s ahead with config %s: %s", launch_fn.__name__, kwargs.get("config"), error)
    finally:
        _COMPILE_ONLY.reset(token)


def _before_first_compile() -> None:
    hook = _BEFORE_COMPILE.get()
    if hook is not None:
        _BEFORE_COMPILE.set(None)
        hook()


def compiles_other_configs(*families):
    """Decorates a template ``launch_fn(..., config=...)`` (config by name): inside
    ``compiling_ahead()``, a call whose launches compile a kernel first has the same call under
    each other config of the family that holds its own (``families``: lists of configs)
    compiled on the pool."""

    def decorate(launch_fn):
        @functools.wraps(launch_fn)
        def call(*args, **kwargs):
            if _AHEAD.get() is None or _COMPILE_ONLY.get():
                return launch_fn(*args, **kwargs)
            config = kwargs.get("config")
            family = next((f for f in families if config in f), ())

            def others() -> None:
                for other in family:
                    if other != config:
                        compile_only(launch_fn, *args, **{**kwargs, "config": other})

            token = _BEFORE_COMPILE.set(others)
            try:
                return launch_fn(*args, **kwargs)
            finally:
                _BEFORE_COMPILE.reset(token)

        return call

    return decorate
