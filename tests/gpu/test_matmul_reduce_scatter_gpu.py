"""The CUDA matmul_reduce_scatter variants on NCCL ranks (world 2, and 4 where there are 4 GPUs):
every variant against an fp32 reference on odd shapes, bit-identical reruns, back-to-back calls,
the op's per-shape choice, CUDA-graph replay (whole, and the op's per-call graphs), and a late
peer that is named instead of hanging.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest
import torch

from tests import fused_rs_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_variant_matches_the_reference_and_repeats_exactly(pool, dtype):
    expected = sum(len(cases._variants(i)) for i in range(len(cases.SHAPES)))
    assert pool.run(cases.every_variant_matches, dtype)[0] == expected


def test_every_variant_writes_a_wider_out_dtype(pool):
    expected = sum(len(cases._variants(i)) + 1 for i in (0, 1, 4, 7))
    assert pool.run(cases.every_variant_widens) == [expected] * pool.world_size


def test_back_to_back_calls(pool):
    assert pool.run(cases.back_to_back, 1000) == [1000] * pool.world_size


def test_op_choice_is_the_same_on_every_rank(pool):
    picked = pool.run(cases.through_the_op)
    assert picked[0] and all(p == picked[0] for p in picked), picked


def test_cuda_graph_replay(pool):
    replays = pool.run(cases.cuda_graph_replay, 10)
    assert replays[0] > 0 and all(r == replays[0] for r in replays)


def test_calls_replay_per_call_graphs(pool):
    # rank 0 runs eagerly; the others capture a graph per input set, variant and shape, at least
    # (after the earlier tests' graphs were dropped: the workspace's pool still takes captures)
    captured = pool.run(cases.replayed_calls, 12)
    assert captured[0] == 0 and all(c >= 16 for c in captured[1:]), captured


def test_a_late_peer_is_named(pool):
    messages = pool.run(cases.late_peer_is_named)
    others = [r for r in range(pool.world_size) if r != 1]
    assert f"rank 1 gave up waiting at the barrier for ranks {others}" in messages[1], messages[1]
    assert f"for the partials of ranks {others}" in messages[1], messages[1]


def test_tail_matmuls_run_in_every_variant(pool):
    expected = sum(len(cases._variants(i)) + 3 for i in (0, 4, 8))
    assert pool.run(cases.tail_matmuls_match) == [expected] * pool.world_size


def test_tail_calls_replay_per_call_graphs(pool):
    captured = pool.run(cases.tail_calls_replay, 12)
    assert captured[0] == 0 and all(c >= 3 for c in captured[1:]), captured
