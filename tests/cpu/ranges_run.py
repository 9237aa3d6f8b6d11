"""One run of a job that compiles a plain-TP graph on symbolic token counts whose all-reduce
split pays only from 100 tokens on (traced at 80), on a fake process group, with Inductor's
caches wherever TORCHINDUCTOR_CACHE_DIR points: test_size_ranges.py runs it twice, as a job's
first and second run. Prints a JSON line: the FX graph cache's counts, what the backend
returned (one graph per range of token counts: ByTokenCount) and the ranges' thresholds.

    TORCHINDUCTOR_CACHE_DIR=/tmp/c python3 -m tests.cpu.ranges_run
"""

import json

import torch
from torch._dynamo.utils import counters

from overlap_pass import config
from overlap_pass.regions import split_cost
from overlap_pass.shapes import size_ranges
from tests.cpu.fake_world import fake_world
from tests.plain_tp_cases import row_then_column


def main() -> None:
    returned = []
    compile_per_range = size_ranges.compile_per_range

    def watched(*args, **kwargs):
        compiled = compile_per_range(*args, **kwargs)
        returned.append(compiled)
        return compiled

    size_ranges.compile_per_range = watched
    torch.manual_seed(0)
    x, residual = torch.randn(80, 48), torch.randn(80, 32)
    weights = torch.randn(48, 32), torch.randn(32, 40), torch.randn(32)
    for t in (x, residual):
        torch._dynamo.mark_dynamic(t, 0)
    # a fused collective counts from 100 tokens' bytes a rank on (32 fp32 columns, 2 ranks)
    fused_from = config.patch(split_min_bytes=100 * 32 * 4 // 2)
    with fake_world(2, kernels=True) as group, split_cost.sizes_ignored(), fused_from:
        torch.compile(row_then_column, backend="overlap")(x, residual, *weights, group)
    (compiled,) = returned
    print(json.dumps({
        "fx": {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")},
        "returned": type(compiled).__name__, "thresholds": getattr(compiled, "_thresholds", None),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
