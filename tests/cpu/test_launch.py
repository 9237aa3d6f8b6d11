"""templates/launch.py: the direct launcher must tell apart exactly the calls Triton compiles
separate kernels for (a shared key would run a kernel specialized for other arguments), and
must pass constexprs in the order the compiled launcher takes them."""

import collections
import contextlib
import itertools
import threading
import time
import types

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_pass.templates import launch
from overlap_pass.templates.launch import DirectKernel, specialization


def _tritons(arg):
    return native_specialize_impl(CUDABackend, arg, False, True, True)


def _arguments():
    bf16 = torch.empty(64, 64, dtype=torch.bfloat16)
    fp16 = torch.empty(64, 64, dtype=torch.float16)
    ints = [1, 2, 3, 16, 48, -16, -3, 2**31 - 16, 2**31, 2**33 + 1, 2**63, 2**63 + 16]
    tensors = [bf16, bf16[1:], bf16.view(-1)[1:], bf16.view(-1)[8:], fp16, torch.empty(3, dtype=torch.float32)]
    descriptors = [
        TensorDescriptor.from_tensor(bf16, [16, 16]),
        TensorDescriptor.from_tensor(bf16[16:], [16, 16]),
        TensorDescriptor.from_tensor(bf16, [32, 16]),
        TensorDescriptor.from_tensor(fp16, [16, 16]),
    ]
    # Gluon's descriptors carry a shared-memory layout, which Triton compiles apart
    gluon_descriptors = [
        GluonDescriptor.from_tensor(bf16, [16, 32], gl.NVMMASharedLayout(swizzle, 16, 2)) for swizzle in (32, 64)
    ]
    tuples = [(bf16, 16), (bf16[1:], 16), (bf16, 3), (descriptors[0], descriptors[3]), (descriptors[0], descriptors[1])]
    return ints + tensors + descriptors + gluon_descriptors + tuples + [True, False, 0.5, 2.0, None]


def test_keys_separate_what_triton_compiles_apart():
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        same_for_triton = _tritons(a) == _tritons(b)
        same_here = specialization([a]) == specialization([b])
        assert same_here == same_for_triton, (a, b, _tritons(a), _tritons(b))


def _kernel(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


def _constexpr_first(BLOCK: tl.constexpr, x_ptr):
    pass


def test_constexprs_follow_the_runtime_arguments_in_parameter_order():
    direct = DirectKernel(JITFunction(_kernel))
    assert direct._constexprs(2, {"EVEN": False, "BLOCK": 64, "num_warps": 4}) == (64, False)
    assert direct._constexprs(2, {"BLOCK": 32}) == (32, True)  # a default fills in


def test_a_constexpr_before_a_runtime_argument_is_refused():
    with pytest.raises(TypeError, match="runtime arguments first"):
        DirectKernel(JITFunction(_constexpr_first))._constexprs(1, {"BLOCK": 16})


def test_no_launch_hook_is_set_by_default():
    # a hook in place sends every launch through the JIT: the direct path would never run
    from overlap_pass.templates.launch import _hooked

    assert not _hooked()


class _Compiles:
    """Stands for the JIT's run (CUDA calls stubbed): each call takes COMPILE_S, as a compile
    would, and returns a compiled kernel whose launches (DirectKernel's path once compiled) are
    recorded; what ran, on which thread, when, is recorded."""

    COMPILE_S = 0.5

    def __init__(self, monkeypatch, fails=()):
        self.events, self.launched, self.fails = [], [], fails
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        monkeypatch.setattr(launch.torch_compat, "current_raw_stream", lambda device: 0)

    def __call__(self, *args, grid, warmup, **meta):
        start = time.monotonic()
        if meta["BLOCK"] in self.fails:
            raise RuntimeError(f"BLOCK={meta['BLOCK']} does not compile")
        time.sleep(self.COMPILE_S * (2 if warmup else 1))  # the pool's outlast the call's own
        self.events.append((meta["BLOCK"], warmup, threading.current_thread().name, start, time.monotonic()))
        block = meta["BLOCK"]
        return types.SimpleNamespace(
            run=lambda *launch_args: self.launched.append(block), function=None, packed_metadata=None
        )


def _template(compiles, family):
    jit = JITFunction(_kernel)
    jit.run = compiles  # what kernel[grid](...) and kernel.warmup(...) call
    jit.device_caches = collections.defaultdict(lambda: None)  # (the JIT's own asks for a driver)
    direct = DirectKernel(jit)

    @launch.compiles_other_configs(family)
    def template(x, *, config):
        if config == 999:
            raise ValueError("no such blocks for these operands")
        direct[(1,)](x, 16, BLOCK=config)

    return template


def test_outside_a_measurement_a_call_compiles_its_own_kernel_alone(monkeypatch):
    compiles = _Compiles(monkeypatch)
    _template(compiles, [16, 32, 64])(torch.empty(4), config=16)
    with launch.compiling_ahead(enabled=False):  # config.compile_ahead off
        _template(compiles, [16, 32, 64])(torch.empty(4), config=32)
    assert [(block, warmup) for block, warmup, *_ in compiles.events] == [(16, False), (32, False)]


def test_a_first_compile_has_the_other_configs_compiled_on_threads_at_once(monkeypatch):
    compiles = _Compiles(monkeypatch)
    template = _template(compiles, [16, 32, 64, 999])
    x = torch.empty(4)
    with launch.compiling_ahead():
        template(x, config=16)  # 32 and 64 compile on the pool beside 16 (999 does not build)
        ran = {block: (warmup, thread) for block, warmup, thread, *_ in compiles.events}
        assert ran[16] == (False, threading.current_thread().name)
        template(x, config=32)  # waits for its compile on the pool, then launches
        template(x, config=64)
    pool = [e for e in compiles.events if e[1]]
    assert sorted(e[0] for e in pool) == [32, 64] and all(e[2].startswith("overlap-compile") for e in pool)
    own = next(e for e in compiles.events if e[0] == 16)
    # all three compiled at once: each pool compile started before the call's own one ended
    assert all(e[3] < own[4] for e in pool), compiles.events
    for block in (32, 64):  # each launched after its compile on the pool was done
        done = next(e[4] for e in pool if e[0] == block)
        launched = next(e[3] for e in compiles.events if e[0] == block and not e[1])
        assert launched >= done


def test_compiling_only_launches_nothing(monkeypatch):
    compiles = _Compiles(monkeypatch)
    template, x = _template(compiles, [16, 32]), torch.empty(4)
    template(x, config=16)  # compiled and launched
    template(x, config=16)  # launched by DirectKernel itself
    assert compiles.launched == [16]
    launch.compile_only(template, x, config=16)  # compiled already: nothing at all
    launch.compile_only(template, x, config=64)  # compiled on the pool, not launched
    launch._pool().shutdown(wait=True)  # (the pool is made again at its next use)
    launch._pool.cache_clear()
    assert compiles.launched == [16]
    assert [(block, warmup) for block, warmup, *_ in compiles.events] == [(16, False), (64, True)]


def test_a_compile_that_failed_on_the_pool_is_raised_by_the_call_of_its_config(monkeypatch):
    compiles = _Compiles(monkeypatch, fails=(32,))
    template = _template(compiles, [16, 32])
    with launch.compiling_ahead():
        template(torch.empty(4), config=16)
        with pytest.raises(RuntimeError, match="BLOCK=32 does not compile"):
            template(torch.empty(4), config=32)


def test_leaving_waits_for_the_compiles_no_call_waited_for(monkeypatch):
    """A measurement's timing must not share the host with compiles of configs no variant ran;
    a trial's first call leaves them to finish behind the model's steps."""
    compiles = _Compiles(monkeypatch)
    x = torch.empty(4)
    with launch.compiling_ahead():
        _template(compiles, [16, 32])(x, config=16)
    assert sorted(block for block, *_ in compiles.events) == [16, 32]
    with launch.compiling_ahead(wait=False):
        _template(compiles, [16, 32])(x, config=16)
    assert sorted(block for block, *_ in compiles.events) == [16, 16, 32]  # the second 32 compiling
    launch._pool().shutdown(wait=True)
    launch._pool.cache_clear()
    assert sorted(block for block, *_ in compiles.events) == [16, 16, 32, 32]
