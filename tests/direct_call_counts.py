"""Counting the op calls Inductor's generated code makes through overlap_pass/pipeline/direct_calls.py:
those reach registry.cuda_kernel by name at each call, while the dispatcher's calls reach it through
the registration's own reference, so a stand-in there sees the direct calls alone."""

import collections
import contextlib

from overlap_pass.ops import registry


@contextlib.contextmanager
def counted_direct_calls(run=None):
    """Yields a Counter of the direct calls made meanwhile, by op; each runs ``run(name, *args,
    **kwargs)`` (default: the CUDA kernel)."""
    made, kernel = collections.Counter(), registry.cuda_kernel
    run = run or kernel

    def counted(name, *args, **kwargs):
        made[name] += 1
        return run(name, *args, **kwargs)

    registry.cuda_kernel = counted
    try:
        yield made
    finally:
        registry.cuda_kernel = kernel
