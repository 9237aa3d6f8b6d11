"""Per-rank bodies of the GPU tests of compiled models: the TP/SP transformer block compiled
with backend="overlap" on NCCL ranks, in bf16, forward and backward against eager."""

import copy
import glob
import json
import os
import tempfile

import torch
import torch.distributed as dist
from overlap_pass.lowering import replay
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap_pass import config
from overlap_pass.regions import split_cost
from tests.direct_call_counts import counted_direct_calls
from benchmarks.measure import relative_error
from benchmarks.tp_models import TransformerBlock, parallelize_block, parallelize_block_plain


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _errors(model, make_input, grad_seed, mode=None, autocast=False) -> list[float]:
    """Relative errors against eager of the output, the input grad and every weight grad (the
    forward under autocast to bf16 if asked)."""
    torch.manual_seed(grad_seed)
    x = make_input()
    runs = []
    for m in model:
        inp = x.clone().requires_grad_()
        if mode:  # CUDA graph trees: a new step; what the last one returned is copied below
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = m(inp)
        gen = torch.Generator(out.device).manual_seed(grad_seed)  # the same gradient for both
        out.backward(torch.randn(out.shape, device=out.device, dtype=out.dtype, generator=gen))
        params = getattr(m, "_orig_mod", m).parameters()
        runs.append([t.clone() for t in [out, inp.grad] + [_local(p.grad) for p in params]])
        for p in getattr(m, "_orig_mod", m).parameters():
            p.grad = None
    return [relative_error(got, want) for got, want in zip(runs[1], runs[0])]


def tp_block(
    bias: bool, mode: str | None = None, seq_per_rank: int = 48, autocast: bool = False, plain: bool = False
) -> dict:  # fmt: skip
    """Eager, plain Inductor and backend="overlap" copies of one block on the same inputs,
    compiled with ``mode``, in bf16 (or in fp32 run under autocast to bf16); returns the worst
    errors of both compiled copies and overlap's decisions. With a mode, the block runs on a
    group of its own and with an empty choice cache, so that overlap's workspaces are made and
    its choices measured during the compiled model's first call (CUDA graph trees run it inside
    their memory pool). ``plain``: the block without sequence parallel (the whole sequence on
    every rank, the same values), its all-reduces split at any size (split_cost.py's
    latency term off)."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    if mode:
        mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cuda")
    else:
        mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)  # the same full weights on every rank
    block = TransformerBlock(dim=256, heads=4 * world, hidden=192 * world, bias=bias, kv_heads=2 * world)
    dtype = torch.float32 if autocast else torch.bfloat16
    eager = (parallelize_block_plain if plain else parallelize_block)(block.to(device=device, dtype=dtype), mesh)
    folder = tempfile.mkdtemp(prefix="overlap-gpu-test-")
    torch._dynamo.reset()
    # with a mode, an empty choice cache: the first call measures inside the graph pool too
    cache = os.path.join(folder, "choices.json") if mode else config.choice_cache
    # with a mode, graph trees record where every allocation left in their pool came from
    history = inductor_config.patch({"triton.cudagraph_trees_history_recording": bool(mode)})
    split_always = split_cost.sizes_ignored(plain)
    direct = counted_direct_calls()
    with config.patch(debug_dir=folder, choice_cache=cache), history, split_always, direct as direct_calls:
        overlap = torch.compile(copy.deepcopy(eager), backend="overlap", mode=mode)
        inductor = torch.compile(copy.deepcopy(eager), mode=mode)
        gen = torch.Generator(device).manual_seed(1 + (0 if plain else dist.get_rank()))
        seq = seq_per_rank * (world if plain else 1)
        make = lambda: torch.randn(2, seq, 256, device=device, dtype=dtype, generator=gen)  # noqa: E731
        worst = {"overlap": 0.0, "inductor": 0.0}
        try:
            # later steps reuse the compiled graphs (and record, replay them); in default mode
            # op calls whose tensors repeat their addresses replay per-call graphs from the third
            for step in range(4):
                if step == 2:
                    replayed = replay.stats["replayed"]
                for name, model in (("overlap", overlap), ("inductor", inductor)):
                    worst[name] = max(worst[name], *_errors((eager, model), make, step, mode, autocast))
        finally:
            # graphs that captured NCCL collectives must not outlive the communicators, or the
            # pool's destroy_process_group waits forever (pytorch/pytorch#115388)
            torch._dynamo.reset()
    replayed = replay.stats["replayed"] - replayed  # op calls of the last two steps replayed
    decisions = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        decisions += [(c["kind"], c["rewritten"], c["reason"]) for c in record["candidates"]]
    return {
        "errors": worst, "decisions": sorted(decisions, key=str), "op_replays": replayed,
        "direct_calls": sum(direct_calls.values()),
    }  # fmt: skip
