"""The TP/SP transformer block compiled with backend="overlap" on NCCL ranks, bf16: forward and
backward (output, input grad, every weight grad) against eager, within what plain Inductor's
own bf16 rounding allows; every collective of both graphs rewritten; op calls replayed from
per-call CUDA graphs in default mode; also under CUDA graph trees (mode="reduce-overhead"), and
an fp32 block under autocast (its backward reduce-scatters bf16 partials into fp32).

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest

from tests import compiled_cases as cases
from tests import plain_tp_cases
from tests.gpu.conftest import GPUS
from tests.plain_tp_cases import AGM, MRS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


@pytest.mark.parametrize(
    "bias, mode, autocast",
    [(False, None, False), (True, None, False), (False, "reduce-overhead", False), (False, None, True)],
    ids=["no-bias", "bias", "cudagraphs", "autocast"],
)
def test_block_forward_and_backward_match_eager(pool, bias, mode, autocast):
    results = pool.run(cases.tp_block, bias, mode, 48, autocast)
    for rank, result in enumerate(results):
        errors = result["errors"]
        # bf16: the compiled block rounds differently from eager; overlap may not be much worse
        # than Inductor's own difference
        assert errors["overlap"] <= max(3e-2, 2 * errors["inductor"]), (rank, errors)
    # forward and backward graphs: each all-gather and reduce-scatter rewritten
    assert results[0]["decisions"] == [(AGM, True, None)] * 4 + [(MRS, True, None)] * 4
    if mode is None:  # the op calls' tensors repeat their addresses from step to step
        assert all(r["op_replays"] > 0 for r in results), [r["op_replays"] for r in results]
    # Inductor's generated code calls the ops past torch's dispatcher (direct_calls.py)
    assert all(r["direct_calls"] > 0 for r in results), [r["direct_calls"] for r in results]


@pytest.mark.parametrize("bias", [False, True])
def test_plain_tp_block_forward_and_backward_match_eager(pool, bias):
    """Without sequence parallel: the 2 forward and 5 backward all-reduces split; O and down,
    the summed input grads of Q + K + V and gate + up fuse with their reduce-scatters, the FFN's
    gather (two saved activations riding in it) and the gather before O's grads with their
    matmuls; the block output and the input grad are gathered plainly (NCCL): as on gloo
    (plain_tp_cases.block_decisions)."""
    results = pool.run(cases.tp_block, bias, None, 48, False, True)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert errors["overlap"] <= max(3e-2, 2 * errors["inductor"]), (rank, errors)
    assert results[0]["decisions"] == plain_tp_cases.block_decisions()
    assert all(r["direct_calls"] > 0 for r in results), [r["direct_calls"] for r in results]
