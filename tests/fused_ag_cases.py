"""Per-rank bodies of the GPU tests of the CUDA all_gather_matmul variants (lowering/): each
runs on every rank of an NCCL RankPool. Every output is checked against an fp32 reference built
from NCCL's all-gather, on fresh random inputs, with the workspace poisoned with NaN before."""

import json
import math

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.lowering import all_gather_matmul as agm
from overlap_pass.lowering import symm
from tests.gpu_common import (
    REL_TOL, assert_all_close, calls_that_replay, error, group_name, message_of_a_late_peer,
    poison_workspace,
)  # fmt: skip

# (shard shape, gather_dim, Ns, bias per N): odd rows, K and N, QKV-like lists, 3-D shards,
# a sequence-parallel [1, seq, dim] shard gathered along the sequence (whole chunks of rows),
# and DTensor's [batch, seq, dim] along seq at batch 4 (each chunk 4 runs of rows)
SHAPES = [
    ((333, 520), 0, (1000,), (True,)),
    ((256, 256), 0, (384, 128, 130), (True, False, True)),
    ((2, 77, 192), 1, (200,), (False,)),
    ((3, 50, 64), 0, (96, 33), (False, True)),
    ((1024, 1024), 0, (1536,), (False,)),
    ((17, 40), 0, (24,), (True,)),
    ((1, 93, 128), 1, (136, 40), (True, False)),
    ((4, 64, 256), 1, (384, 128), (True, False)),
]


def _shard_of(rank, shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)


def _problem(shape, gather_dim, ns, bias, dtype, seed):
    shard = _shard_of(dist.get_rank(), shape, dtype, seed)
    shared = torch.Generator(device="cuda").manual_seed(seed)  # weights equal on every rank
    k = shape[-1]
    mat2s = [torch.randn(n, k, device="cuda", dtype=dtype, generator=shared).t() / k**0.5 for n in ns]
    biases = [torch.randn(n, device="cuda", dtype=dtype, generator=shared) if b else None for n, b in zip(ns, bias)]
    return shard, mat2s, biases


def _reference(shard, mat2s, biases, gather_dim):
    world = dist.get_world_size()
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    gathered = torch.cat(parts, dim=gather_dim)
    flat = gathered.reshape(-1, shard.shape[-1]).float()
    outs = [flat @ m.float() + (b.float() if b is not None else 0) for m, b in zip(mat2s, biases)]
    return gathered, [o.view(list(gathered.shape[:-1]) + [o.shape[-1]]) for o in outs]


def _local_reference(shape, gather_dim, ns, bias, dtype, seed):
    """The reference gathered tensor and outputs without a collective: every rank's shard
    regenerated from its seed, so that calls under test are not re-synchronized by a reference
    all-gather in between."""
    shards = [_shard_of(r, shape, dtype, seed) for r in range(dist.get_world_size())]
    _, mat2s, biases = _problem(shape, gather_dim, ns, bias, dtype, seed)
    gathered = torch.cat(shards, dim=gather_dim)
    flat = gathered.reshape(-1, shape[-1]).float()
    outs = [flat @ m.float() + (b.float() if b is not None else 0) for m, b in zip(mat2s, biases)]
    return gathered, [o.view(list(gathered.shape[:-1]) + [o.shape[-1]]) for o in outs]


def _check(name, result, expected, dtype):
    (gathered, outs), (ref_gathered, refs) = result, expected
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.shape == ref.shape, f"{name}: output {i} shape {out.shape} != {ref.shape}"
        err = error(out, ref).item()
        assert err <= REL_TOL[dtype], f"{name}: output {i} relative error {err:.2e} on rank {dist.get_rank()}"
    if gathered is not None:
        assert torch.equal(gathered, ref_gathered), f"{name}: gathered tensor differs"


def every_variant_matches(dtype, seed=0) -> int:
    """Each variant, each shape, with and without the gathered tensor returned."""
    checked = 0
    world = dist.get_world_size()
    for index, (shape, gather_dim, ns, bias) in enumerate(SHAPES):
        shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, dtype, seed + index)
        expected = _reference(shard, mat2s, biases, gather_dim)
        for name, variant in agm.variants().items():
            poison_workspace()
            result = variant(shard, mat2s, biases, gather_dim, world, group_name(), index % 2 == 0)
            _check(name, result, expected, dtype)
            checked += 1
    symm.check_all_timeouts()
    return checked


def back_to_back(calls: int, seed=0) -> int:
    """``calls`` calls in a row, shapes and variants changing from call to call, with no sync
    and no collective in between (references are computed locally); errors checked at the end."""
    world = dist.get_world_size()
    names = list(agm.variants())
    errors, labels = [], []
    for call in range(calls):
        shape, gather_dim, ns, bias = SHAPES[call % len(SHAPES)]
        shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed + call)
        _, refs = _local_reference(shape, gather_dim, ns, bias, torch.bfloat16, seed + call)
        name = names[(call // len(SHAPES)) % len(names)]
        _, outs = agm.variants()[name](shard, mat2s, biases, gather_dim, world, group_name())
        errors += [error(o, r) for o, r in zip(outs, refs)]
        labels += [(call, name)] * len(outs)
    assert_all_close(errors, labels)
    return calls


def _rider(rank, shape, seed):
    """A passenger of the shard's rows: a norm's fp32 rsqrt, as plain TP's forward saves it."""
    return _shard_of(rank, (*shape[:-1], 1), torch.float32, seed + 500)


def replayed_calls(calls: int, seed=0) -> int:
    """The op through calls_that_replay, on Q/K/V-like weights with biases and on sequence-
    parallel [1, S, D] and [4, S, D] shards, returning the gathered tensor too and carrying a
    passenger (both checked exactly as outputs). Returns the graphs this rank captured."""
    world, rank, captured = dist.get_world_size(), dist.get_rank(), 0
    for shape, gather_dim, ns, bias in (SHAPES[1], SHAPES[6], SHAPES[7]):

        def problem(s, shape=shape, gather_dim=gather_dim, ns=ns, bias=bias):
            shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed + s)
            return [shard, *mat2s, *biases, _rider(rank, shape, seed + s)]

        def run(tensors, gather_dim=gather_dim, count=len(ns)):
            shard, mat2s, biases, rider = tensors[0], tensors[1 : 1 + count], tensors[1 + count : -1], tensors[-1]
            gathered, outs = torch.ops.overlap.all_gather_matmul(
                shard, mat2s, biases, gather_dim, world, group_name(), True, None, None, [rider]
            )
            return [gathered, *outs]

        def reference(s, shape=shape, gather_dim=gather_dim, ns=ns, bias=bias):
            gathered, outs = _local_reference(shape, gather_dim, ns, bias, torch.bfloat16, seed + s)
            riders = torch.cat([_rider(r, shape, seed + s) for r in range(world)], dim=gather_dim)
            return [gathered.float(), *outs, riders]

        captured += calls_that_replay(calls, ("fused", "copy_engine_cublas"), problem, run, reference)
    return captured


def through_the_op(seed=0) -> list[str]:
    """torch.ops.overlap.all_gather_matmul on CUDA: auto picks a variant per shape, the same on
    every rank; forcing each implementation works too."""
    world = dist.get_world_size()
    picked = []
    for index, (shape, gather_dim, ns, bias) in enumerate(SHAPES[:3]):
        shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed + index)
        expected = _reference(shard, mat2s, biases, gather_dim)
        for implementation in ("auto", "fused", "copy_engine_cublas", "nccl_cublas", "reference"):
            with config.patch(implementation=implementation):
                result = torch.ops.overlap.all_gather_matmul(
                    shard, mat2s, biases, gather_dim, world, group_name(), True
                )
            _check(implementation, result, expected, torch.bfloat16)
        from overlap_pass.lowering import choose

        picked.append(sorted(c["choice"] for c in choose.CHOICES.values()))
    return picked[-1]


def cuda_graph_replay(replays: int, seed=0) -> int:
    """Capture the fused variant once, replay it on new inputs: flags and barrier still advance
    (the epoch is on the device), outputs match every time."""
    world = dist.get_world_size()
    shape, gather_dim, ns, bias = SHAPES[1]
    shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed)
    fused = agm.variants()[next(n for n in agm.variants() if n.startswith("fused"))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(shard, mat2s, biases, gather_dim, world, group_name())  # warm up: workspace, compile
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, outs = fused(shard, mat2s, biases, gather_dim, world, group_name())
    ws = symm.workspace(agm.KIND, group_name(), shard.device)
    start_epoch = int(ws.epoch.item())
    for replay in range(replays):
        fresh, _, _ = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed + 1 + replay)
        shard.copy_(fresh)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        _, refs = _reference(shard, mat2s, biases, gather_dim)
        for out, ref in zip(outs, refs):
            err = error(out, ref).item()
            assert err <= REL_TOL[torch.bfloat16], f"replay {replay}: relative error {err:.2e}"
    torch.cuda.synchronize()
    assert int(ws.epoch.item()) == start_epoch + replays, "the epoch did not advance on replay"
    symm.check_all_timeouts()
    return replays


def late_peer_is_named(seed=0) -> str:
    """Rank 1 calls alone with a short spin limit: its waits give up, and the error names the
    rank it waited for at the barrier and the chunk whose flag never came."""
    world = dist.get_world_size()
    shard, mat2s, biases = _problem((64, 64), 0, (64,), (False,), torch.bfloat16, seed)
    fused = next(v for n, v in agm.variants().items() if n.startswith("fused"))
    return message_of_a_late_peer(
        agm.KIND, world * shard.numel() * shard.element_size(),
        lambda group_name: fused(shard, mat2s, biases, 0, world, group_name),
    )  # fmt: skip


def row_major_weights(seed=0) -> int:
    """mat2 stored [K, N] (a plain matrix, not a transposed linear weight): the TMA kernel's
    other B layout, and the cuBLAS variants."""
    world = dist.get_world_size()
    shard, mat2s, biases = _problem((200, 128), 0, (136, 64), (True, False), torch.bfloat16, seed)
    mat2s = [m.contiguous() for m in mat2s]  # [K, N], unit stride along N
    expected = _reference(shard, mat2s, biases, 0)
    for name, variant in agm.variants().items():
        poison_workspace()
        _check(name, variant(shard, mat2s, biases, 0, world, group_name()), expected, torch.bfloat16)
    symm.check_all_timeouts()
    return len(agm.variants())


# (shard shape, gather_dim, Ns of the row matmuls, Ks and gathered_left of the contractions):
# a row-parallel weight grad beside its input grad, a column-parallel one alone (the gather
# recomputed under checkpointing), odd sizes, a gather along dim 1 of a batch of 2 and of 4 (each
# rank's chunk strided in the rows), and a sequence-parallel [1, S, D] shard
CONTRACTIONS = [
    ((256, 384), 0, (200,), ((136, True),)),
    ((333, 136), 0, (), ((520, False),)),
    ((2, 77, 192), 1, (64,), ((96, True), (40, False))),
    ((96, 64), 0, (), ((1000, True),)),
    ((1, 93, 128), 1, (72,), ((56, False), (24, True))),  # sequence parallel: whole chunks
    ((4, 64, 256), 1, (128,), ((192, True), (64, False))),
]


def _contraction_problem(shape, gather_dim, ns, contractions, dtype, seed):
    shard, mat2s, _ = _problem(shape, gather_dim, ns, (False,) * len(ns), dtype, seed)
    rows = math.prod(shape[:-1]) * dist.get_world_size()
    shared = torch.Generator(device="cuda").manual_seed(seed + 7)  # the same on every rank
    others = [torch.randn(rows, k, device="cuda", dtype=dtype, generator=shared) for k, _ in contractions]
    return shard, mat2s, others, [left for _, left in contractions]


def _contraction_reference(shard, mat2s, others, lefts, gather_dim):
    gathered, outs = _reference(shard, mat2s, [None] * len(mat2s), gather_dim)
    flat = gathered.reshape(-1, shard.shape[-1]).float()
    outs += [flat.t() @ o.float() if left else o.float().t() @ flat for o, left in zip(others, lefts)]
    return gathered, outs


def contractions_match(dtype, seed=0) -> int:
    """Every variant for the call (none fused without row matmuls), and the op through its
    choice, against an fp32 reference; the workspace poisoned before each call."""
    world, checked = dist.get_world_size(), 0
    for index, (shape, gather_dim, ns, contractions) in enumerate(CONTRACTIONS):
        shard, mat2s, others, lefts = _contraction_problem(shape, gather_dim, ns, contractions, dtype, seed + index)
        expected = _contraction_reference(shard, mat2s, others, lefts, gather_dim)
        runs = dict(agm.variants(len(mat2s)))
        runs["op"] = lambda *args: torch.ops.overlap.all_gather_matmul(*args)
        for name, run in runs.items():
            poison_workspace()
            result = run(shard, mat2s, [None] * len(mat2s), gather_dim, world, group_name(), index % 2 == 1, others, lefts)
            _check(name, result, expected, dtype)
            checked += 1
    symm.check_all_timeouts()
    return checked


def choice_cache_round_trip(path: str, seed=0) -> list[str]:
    """What a later run does with the choice cache at ``path``: a first call measures and stores
    the choice; a run that starts again (this process's choices forgotten) takes it from the file;
    an entry whose times miss one of this overlap's variants (as an older overlap wrote it) is
    measured again and replaced. Returns the sources, with the choice taken from the cache."""
    from overlap_pass.lowering import choose, dispatch

    world = dist.get_world_size()
    shape, gather_dim, ns, bias = SHAPES[0]
    shard, mat2s, biases = _problem(shape, gather_dim, ns, bias, torch.bfloat16, seed)
    expected = _reference(shard, mat2s, biases, gather_dim)
    remembered = (choose.CHOICES, choose._DECIDED, dispatch._RESOLVED)  # this process's choices
    saved = [dict(table) for table in remembered]

    def first_call() -> dict:
        for table in remembered:
            table.clear()
        result = torch.ops.overlap.all_gather_matmul(shard, mat2s, biases, gather_dim, world, group_name(), True)
        _check("auto", result, expected, torch.bfloat16)
        (entry,) = choose.CHOICES.values()
        return entry

    sources = []
    try:
        with config.patch(choice_cache=path):
            measured = first_call()
            sources.append(measured["source"])
            cached = first_call()
            sources += [cached["source"], "same choice" if cached["choice"] == measured["choice"] else "other"]
            if dist.get_rank() == 0:
                table = choose.load_cache()
                (key,) = table
                dropped = sorted(table[key]["times_us"])[0]
                del table[key]["times_us"][dropped]
                with open(path, "w") as f:
                    json.dump(table, f)
            dist.barrier()
            sources.append(first_call()["source"])
            if dist.get_rank() == 0:
                (entry,) = choose.load_cache().values()
                sources.append("rewritten" if set(entry["times_us"]) == set(measured["times_us"]) else "stale")
    finally:
        for table, before in zip(remembered, saved):
            table.clear()
            table.update(before)
    return sources
