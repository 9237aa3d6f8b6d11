"""templates/launch.py: the direct launcher must tell apart exactly the calls Triton compiles
separate kernels for (a shared key would run a kernel specialized for other arguments), and
must pass constexprs in the order the compiled launcher takes them."""

import itertools

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

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
    tuples = [(bf16, 16), (bf16[1:], 16), (bf16, 3), (descriptors[0], descriptors[3]), (descriptors[0], descriptors[1])]
    return ints + tensors + descriptors + tuples + [True, False, 0.5, 2.0, None]


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
