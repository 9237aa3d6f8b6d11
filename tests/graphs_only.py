"""Compiles that stop after Inductor's post-grad passes (overlap's among them) and run the graph
as those passes leave it: the same graphs and decisions as a full compile, without generating
and building Inductor's kernels, which on CI's two cores was most of a compiling test's time.

The fake process group's tests use it (they compute nothing), and the gloo ranks
(tests/rank_pool.py) of worlds of 3 and more and of the W=2 tests not marked `kernels`: their
numerics are then the rewritten graph's, run op by op, while the marked W=2 tests keep the full
compile, Inductor's kernels and its lowering of overlap's ops.
"""

import contextlib

import torch


@contextlib.contextmanager
def graphs_only():
    """While open, every compile_fx (backend="overlap" and "inductor" call it) takes
    post_grad_graph as its inner compile."""
    import torch._inductor.compile_fx as compile_fx_module

    compile_fx = compile_fx_module.compile_fx

    def stopping_after_post_grad(*args, **kwargs):
        kwargs.setdefault("inner_compile", post_grad_graph)
        return compile_fx(*args, **kwargs)

    compile_fx_module.compile_fx = stopping_after_post_grad
    try:
        yield
    finally:
        compile_fx_module.compile_fx = compile_fx


def post_grad_graph(gm, example_inputs, **kwargs):
    """Inductor's inner compile as far as its post-grad passes, the way it reaches them (views
    as reshapes, fake tensors propagated), then the graph itself as the compiled function."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
    gm.recompile()
    return make_boxed_func(gm.forward)
