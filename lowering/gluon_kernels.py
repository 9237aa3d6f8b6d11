"""The Gluon float8 kernels (templates/all_gather_matmul_pingpong.py and
matmul_reduce_scatter_pingpong.py), imported on first use instead of with the lowering: a triton
without Gluon, or whose Gluon no longer has a name the kernels import or build at import,
leaves their variants out of every choice (the reason logged once) instead of failing every
overlap op on CUDA, the bf16 ones included. A kernel that imports but does not compile is left
out by choose.py at its first call."""

import functools
import logging
import types

from .choose import failure

log = logging.getLogger("overlap_pass")


@functools.cache
def load() -> types.SimpleNamespace | None:
    """The kernels' modules as ``consumer`` and ``producer``, or None where they do not import."""
    try:
        from overlap_pass.templates import all_gather_matmul_pingpong as consumer
        from overlap_pass.templates import matmul_reduce_scatter_pingpong as producer
    except Exception as e:  # ImportError, or an AttributeError of a moved Gluon API
        import triton

        log.warning(
            "overlap: variants fused:gluon_pingpong* are out: the Gluon kernels do not import with triton %s: %s",
            triton.__version__, failure(e),
        )  # fmt: skip
        return None
    return types.SimpleNamespace(consumer=consumer, producer=producer)


def configs() -> list:
    """The pingpong configs the float8 variants run, none where the kernels do not import."""
    kernels = load()
    return [] if kernels is None else list(kernels.consumer.CONFIGS)


def is_pingpong(gemm_config) -> bool:
    """Whether ``gemm_config`` is a Gluon kernel's (else a Triton kernel's: templates/gemm.py)."""
    kernels = load()
    return kernels is not None and isinstance(gemm_config, kernels.consumer.PingpongConfig)
