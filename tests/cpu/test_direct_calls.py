"""Inductor's generated code calls the ops' kernels directly (overlap_pass/pipeline/direct_calls.py), on
gloo ranks at W=2 compiled fully. The lowering marks the ops of CUDA graphs only; here it takes
CPU graphs too and the kernel each direct call reaches is a stand-in that counts the call and
runs the op (on CPU tensors: the reference), so the generated code's calls are seen and their
results checked against eager: the plain-TP block, forward and backward (reduce-scatters,
all-gathers with passengers, small all-reduces)."""

import contextlib

import pytest
import torch

from overlap_pass import config

from overlap_pass.pipeline import direct_calls

from overlap_pass.ops import registry
from tests.direct_call_counts import counted_direct_calls

from . import numerics_cases as cases

pytestmark = pytest.mark.kernels


@contextlib.contextmanager
def _counted_direct_calls():
    """The direct calls of CPU graphs, counted by op; each runs the op (its reference)."""
    devices = direct_calls.DEVICE_TYPES
    direct_calls.DEVICE_TYPES = ("cuda", "cpu")
    try:
        with counted_direct_calls(lambda name, *args, **kwargs: registry.overload(name)(*args, **kwargs)) as made:
            yield made
    finally:
        direct_calls.DEVICE_TYPES = devices


def plain_block_calls(direct: bool, profiled: bool) -> dict:
    """On each rank: the plain-TP block against eager, two steps; the direct calls made, by op,
    and the ops the profiler saw. Without dumps (``__wrapped__``), so that a compile like an
    earlier one's (the profiled run's) comes from Inductor's cache."""
    profiler = torch.profiler.profile() if profiled else contextlib.nullcontext()
    torch._dynamo.reset()  # Dynamo's guards do not read overlap's config
    with _counted_direct_calls() as made, config.patch(direct_op_calls=direct), profiler as trace:
        cases.plain_tp_block.__wrapped__(False, 2)
    seen = sorted({e.name for e in trace.events() if e.name.startswith("overlap::")}) if profiled else []
    return {"made": dict(made), "profiled": seen}


def test_the_generated_code_calls_each_op_directly_and_matches_eager(gloo_world):
    """Every op of the forward and backward graphs is called through direct_calls: 2 steps of 2
    reduce-scatters and an all-gather forward, 2 reduce-scatters, an all-gather and 2 small
    all-reduces backward."""
    made = [r["made"] for r in gloo_world(2).run(plain_block_calls, True, False)]
    expected = {"matmul_reduce_scatter": 8, "all_gather_matmul": 4, "all_reduce": 4}
    assert made == [expected, expected]


def test_off_or_profiled_the_calls_go_through_the_op(gloo_world):
    """config.direct_op_calls off: the generated code calls torch.ops.overlap; under a profiler
    the direct calls hand over to the op, which the trace names."""
    off = gloo_world(2).run(plain_block_calls, False, False)
    assert [r["made"] for r in off] == [{}, {}]
    profiled = gloo_world(2).run(plain_block_calls, True, True)
    assert [r["made"] for r in profiled] == [{}, {}]
    ops_seen = ["overlap::all_gather_matmul", "overlap::all_reduce", "overlap::matmul_reduce_scatter"]
    assert [r["profiled"] for r in profiled] == [ops_seen, ops_seen]
