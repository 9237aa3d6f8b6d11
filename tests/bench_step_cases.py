"""benchmarks/bench_step.py's two training steps at toy sizes, on whatever ranks run them: eager, then
backend="overlap", each from the same weights, two steps each (the tool's own recipes)."""

import torch
import torch.distributed as dist

from overlap_pass.regions import split_cost
from benchmarks import bench_prefill, bench_step
from benchmarks.titan_llama3 import FLAVORS, LayerArgs


def _toy_args():
    """The tool's arguments at toy sizes; "toy" is made a --size here (in the rank's process):
    torchtitan's layer arguments and Hugging Face's widths."""
    FLAVORS.setdefault("toy", LayerArgs(dim=64, n_heads=4, n_kv_heads=4, ffn_multiple_of=32))
    bench_prefill.SIZES.setdefault("toy", (64, 4, 4, 128))
    return type("Args", (), {"size": "toy", "layers": 2, "vocab": 96, "seq": 32, "batch": 2})


def losses(model: str, dp: int = 1) -> dict:
    """Eager's and overlap's losses over two steps, and the pass's counters."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    args = _toy_args()
    if model == "hf":
        build, step = bench_step._hf_recipe(args, "cpu")
    else:
        mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp), mesh_dim_names=("dp", "tp"))
        build, step = bench_step._titan_recipe(args, mesh, "cpu")
    counters["overlap_pass"].clear()
    found = {}
    # toy sizes: every split pays when a collective's latency is not counted
    with split_cost.sizes_ignored():
        for compiler in (None, "overlap"):
            model_, optimizer = build(compiler)
            found[compiler or "eager"] = [bench_step._value(step(model_, optimizer)) for _ in range(2)]
    torch._dynamo.reset()
    return {"losses": found, "counters": dict(counters["overlap_pass"])}
