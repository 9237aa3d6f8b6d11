"""The all-gather consumer GEMM in float8 (A and B float8, scales in the epilogue) on one GPU with
simulated peers, against the dequantized product in fp32. Skipped without a GPU."""

import pytest
import torch

from overlap_pass.templates import all_gather_matmul as agm
from overlap_pass.templates import gemm

from tests.consumer_cases import EPOCH, fp8_problem, run_fp8_consumer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("config", gemm.FLOAT8_CONFIGS, ids=str)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "world, rank, shard_shape, gather_dim, ns, bias",
    [
        (2, 1, (1000, 512), 0, (1024,), False),
        (4, 2, (2, 333, 256), 1, (384, 128, 144), True),  # Q, K, V of unequal N, [batch, seq, dim]
    ],
)
def test_fp8_consumer_matches_dequantized(config, rowwise, world, rank, shard_shape, gather_dim, ns, bias):
    outs, timeouts, refs = run_fp8_consumer(
        world, rank, shard_shape, gather_dim, ns, rowwise, bias, world + rowwise, config, "cuda", spin_limit=1 << 20
    )
    torch.cuda.synchronize()
    assert not timeouts.any()
    for out, ref in zip(outs, refs):
        assert not torch.isnan(out).any(), "some output rows were never written"
        err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, err


def test_fp8_consumer_agrees_with_scaled_mm():
    """Tensorwise, against torch._scaled_mm itself (cuBLAS) on the same operands."""
    gathered, a_scale, mat2s, b_scales, biases, _, inner = fp8_problem(2, (512, 256), (256,), 0, False, False, 3, device="cuda")
    flags = torch.full((2,), EPOCH, dtype=torch.int32, device="cuda")
    out = torch.full((gathered.shape[0], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    agm.all_gather_matmul_consumer(
        gathered, mat2s, biases, [out], flags, torch.tensor([EPOCH], dtype=torch.int32, device="cuda"),
        rank=0, world_size=2, inner=inner, config=gemm.FLOAT8_CONFIGS[0], spin_limit=1 << 20,
        scales=agm.Scales(a_scale, None, tuple(b_scales)),
    )
    ref = torch._scaled_mm(gathered, mat2s[0], a_scale, b_scales[0], out_dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
