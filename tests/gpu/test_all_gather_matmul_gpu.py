"""The CUDA all_gather_matmul variants on NCCL ranks (world 2, and 4 where there are 4 GPUs):
every variant against an fp32 reference on odd shapes, back-to-back calls, the op's per-shape
choice, CUDA-graph replay (whole, and the op's per-call graphs), and a late peer that is named
instead of hanging the GPU.

Run on a GPU machine: python3 -m pytest tests/gpu -q
"""

import pytest
import torch

from tests import fused_ag_cases as cases
from tests.gpu.conftest import GPUS

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_variant_matches_the_reference(pool, dtype):
    checked = pool.run(cases.every_variant_matches, dtype)
    assert checked[0] == len(cases.SHAPES) * len(cases.agm.variants())


def test_back_to_back_calls(pool):
    assert pool.run(cases.back_to_back, 1000) == [1000] * pool.world_size


def test_op_choice_is_the_same_on_every_rank(pool):
    picked = pool.run(cases.through_the_op)
    assert all(p == picked[0] for p in picked), picked


def test_the_choice_cache_is_read_back_and_stale_entries_measured_again(pool, tmp_path):
    sources = pool.run(cases.choice_cache_round_trip, str(tmp_path / "choices.json"))
    assert sources[0] == ["measured", "cache", "same choice", "measured", "rewritten"], sources
    assert all(s == sources[0][:4] for s in sources[1:]), sources


def test_cuda_graph_replay(pool):
    assert pool.run(cases.cuda_graph_replay, 20) == [20] * pool.world_size


def test_calls_replay_per_call_graphs(pool):
    # rank 0 runs eagerly; the others capture a graph per input set, variant and shape, at least
    # (after the earlier tests' graphs were dropped: the workspace's pool still takes captures)
    captured = pool.run(cases.replayed_calls, 12)
    assert captured[0] == 0 and all(c >= 8 for c in captured[1:]), captured


def test_a_late_peer_is_named(pool):
    messages = pool.run(cases.late_peer_is_named)
    others = [r for r in range(pool.world_size) if r != 1]
    assert f"rank 1 gave up waiting at the barrier for ranks {others}" in messages[1], messages[1]
    assert f"for the flags of chunks {others}" in messages[1], messages[1]


def test_row_major_weights(pool):
    assert pool.run(cases.row_major_weights)[0] == len(cases.agm.variants())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_contractions_over_the_gathered_rows(pool, dtype):
    checked = pool.run(cases.contractions_match, dtype)
    expected = sum(len(cases.agm.variants(len(c[2]))) + 1 for c in cases.CONTRACTIONS)
    assert checked == [expected] * pool.world_size
