"""Per-rank bodies of the GPU tests of the CUDA matmul_reduce_scatter variants (lowering/): each
runs on every rank of an NCCL RankPool. Outputs are checked against an fp32 reference (every
rank's inputs regenerated from their seeds, summed locally), on fresh random inputs, with the
workspace poisoned with NaN before."""

import functools

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.lowering import matmul_reduce_scatter as mrs
from overlap_pass.lowering import symm
from tests.gpu_common import (
    REL_TOL, assert_all_close, calls_that_replay, error, group_name, message_of_a_late_peer,
    poison_workspace,
)  # fmt: skip

# (input shape with "W" for the world size in the scattered dim, scatter_dim, K per input, N,
# bias, reduce_op): odd rows per chunk, odd K and N, 3-D inputs scattered along dim 0 and 1,
# a sum of two matmuls (the backward's input gradient), a sequence-parallel [1, S, D], and
# DTensor's [batch, S, D] along seq at batch 4 (each chunk 4 runs of rows), a sum of two too
SHAPES = [
    (("W83",), 0, (520,), 1000, True, "sum"),
    (("W64",), 0, (256,), 130, False, "avg"),
    ((2, "W39"), 1, (192,), 200, False, "sum"),
    (("W3", 10), 0, (64,), 96, True, "sum"),
    (("W50",), 0, (96, 40), 72, True, "sum"),
    (("W256",), 0, (1024,), 1536, False, "sum"),
    (("W17",), 0, (40,), 24, True, "avg"),
    ((1, "W45"), 1, (96,), 64, False, "sum"),  # sequence parallel: the output written in place
    ((4, "W64"), 1, (256,), 384, True, "sum"),  # batch 4: chunks read in place
    ((4, "W33"), 1, (128, 64), 96, False, "sum"),
]


def _dims(lead, world):
    return [world * int(d[1:]) if isinstance(d, str) else d for d in lead]


def _problem(index, dtype, seed, rank=None):
    """Rank ``rank``'s inputs (default: this rank's) and the shared weights and bias."""
    lead, scatter_dim, ks, n, bias, reduce_op = SHAPES[index]
    world = dist.get_world_size()
    rank = dist.get_rank() if rank is None else rank
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    inputs = [torch.randn(*_dims(lead, world), k, device="cuda", dtype=dtype, generator=gen) for k in ks]
    shared = torch.Generator(device="cuda").manual_seed(seed)  # weights equal on every rank
    mat2s = [torch.randn(n, k, device="cuda", dtype=dtype, generator=shared).t() / k**0.5 for k in ks]
    b = torch.randn(n, device="cuda", dtype=dtype, generator=shared) if bias else None
    return inputs, mat2s, b, reduce_op, scatter_dim


def _reference(index, dtype, seed):
    """This rank's chunk of reduce(every rank's sum_i inputs[i] @ mat2s[i] + bias), in fp32,
    without a collective (so calls under test are not re-synchronized in between)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = None
    for r in range(world):
        inputs, mat2s, b, reduce_op, scatter_dim = _problem(index, dtype, seed, rank=r)
        full = sum(a.float() @ m.float() for a, m in zip(inputs, mat2s))
        full = full + (b.float() if b is not None else 0)
        total = full if total is None else total + full
    if reduce_op == "avg":
        total = total / world
    size = total.shape[scatter_dim] // world
    return total.narrow(scatter_dim, rank * size, size)


def _variants(index):
    return mrs.variants(len(SHAPES[index][2]))


def _call(variant, index, dtype, seed):
    inputs, mat2s, b, reduce_op, scatter_dim = _problem(index, dtype, seed)
    return variant(inputs, mat2s, b, reduce_op, scatter_dim, dist.get_world_size(), group_name())


def _check(name, out, ref, dtype):
    assert out.shape == ref.shape, f"{name}: output shape {out.shape} != {ref.shape}"
    err = error(out, ref).item()
    assert err <= REL_TOL[dtype], f"{name}: relative error {err:.2e} on rank {dist.get_rank()}"


def every_variant_matches(dtype, seed=0) -> int:
    """Each variant on each shape; each non-NCCL variant run twice gives identical bits."""
    checked = 0
    for index in range(len(SHAPES)):
        ref = _reference(index, dtype, seed + index)
        for name, variant in _variants(index).items():
            poison_workspace()
            out = _call(variant, index, dtype, seed + index)
            _check(name, out, ref, dtype)
            if name != "nccl_cublas":  # NCCL's own reduction order is not ours to promise
                poison_workspace()
                again = _call(variant, index, dtype, seed + index)
                assert torch.equal(out, again), f"{name}: two runs on the same inputs differ"
            checked += 1
    symm.check_all_timeouts()
    return checked


def every_variant_widens(seed=0) -> int:
    """out_dtype=float32 from bf16 inputs (autocast's input gradients): each variant, direct and
    through the op, writes fp32 that rounds to exactly its bf16 result (the same partials, the
    same fp32 sum; NCCL's sum aside) and matches the fp32 reference to bf16's tolerance."""
    world, checked = dist.get_world_size(), 0
    for index in (0, 1, 4, 7):
        ref = _reference(index, torch.bfloat16, seed + index)
        inputs, mat2s, b, reduce_op, scatter_dim = _problem(index, torch.bfloat16, seed + index)
        args = (inputs, mat2s, b, reduce_op, scatter_dim, world, group_name())
        calls = dict(_variants(index), op=torch.ops.overlap.matmul_reduce_scatter)
        for name, variant in calls.items():
            poison_workspace()
            wide = variant(*args, torch.float32)
            assert wide.dtype == torch.float32, f"{name}: out_dtype float32 gave {wide.dtype}"
            _check(f"{name} out_dtype=float32", wide, ref, torch.bfloat16)
            if name not in ("nccl_cublas", "op"):
                narrow = variant(*args)
                unrounded = torch.equal(wide.to(torch.bfloat16), narrow)
                assert unrounded, f"{name}: the fp32 output is not the bf16 one before its rounding"
            checked += 1
    symm.check_all_timeouts()
    return checked


def back_to_back(calls: int, seed=0) -> int:
    """``calls`` calls in a row, shapes and variants changing from call to call, with no sync
    or collective in between; errors checked at the end."""
    errors, labels = [], []
    for call in range(calls):
        index = call % len(SHAPES)
        names = list(_variants(index))
        name = names[(call // len(SHAPES)) % len(names)]
        out = _call(_variants(index)[name], index, torch.bfloat16, seed + call)
        errors.append(error(out, _reference(index, torch.bfloat16, seed + call)))
        labels.append((call, name))
    assert_all_close(errors, labels)
    return calls


def replayed_calls(calls: int, seed=0) -> int:
    """The op through calls_that_replay: scattered along dim 0, along dim 1 of a [1, S, D] and
    of a [4, S, D], a sum of two matmuls among them. Returns the graphs this rank captured."""
    world, captured = dist.get_world_size(), 0
    for index in (0, 4, 7, 8, 9):
        lead, scatter_dim, ks, n, bias, reduce_op = SHAPES[index]
        # "fused" for a sum: the fused producer over the joined matmul
        implementations = ("fused", "copy_engine_cublas", "cublas_push")
        implementations += ("copy_engine_cublas:joined",) if len(ks) > 1 else ()

        def problem(s, index=index):
            inputs, mat2s, b, _, _ = _problem(index, torch.bfloat16, seed + s)
            return [*inputs, *mat2s, b]

        def run(tensors, count=len(ks), reduce_op=reduce_op, scatter_dim=scatter_dim):
            inputs, mat2s, b = tensors[:count], tensors[count : 2 * count], tensors[-1]
            return [torch.ops.overlap.matmul_reduce_scatter(inputs, mat2s, b, reduce_op, scatter_dim, world, group_name())]

        captured += calls_that_replay(
            calls, implementations, problem, run, lambda s, index=index: [_reference(index, torch.bfloat16, seed + s)]
        )
    return captured


def through_the_op(seed=0) -> list[str]:
    """torch.ops.overlap.matmul_reduce_scatter on CUDA: auto picks a variant per shape, the same
    on every rank; forcing each implementation works too."""
    for index in (0, 2, 4):
        ref = _reference(index, torch.bfloat16, seed + index)
        for implementation in ("auto", "fused", "copy_engine_cublas", "cublas_push", "nccl_cublas", "reference"):
            with config.patch(implementation=implementation):
                out = _call(torch.ops.overlap.matmul_reduce_scatter, index, torch.bfloat16, seed + index)
            _check(implementation, out, ref, torch.bfloat16)
    from overlap_pass.lowering import choose

    return sorted(c["choice"] for k, c in choose.CHOICES.items() if k.startswith(mrs.KIND))


def cuda_graph_replay(replays: int, seed=0) -> int:
    """Capture each overlapped variant once, replay on new inputs: flags and barrier advance
    (the epoch is on the device), outputs match every time."""
    index = 0
    names = [n for n in _variants(index) if n != "nccl_cublas"]
    for name in names:
        variant = _variants(index)[name]
        inputs, mat2s, b, reduce_op, scatter_dim = _problem(index, torch.bfloat16, seed)
        args = (inputs, mat2s, b, reduce_op, scatter_dim, dist.get_world_size(), group_name())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            variant(*args)  # warm up: workspace, compile
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = variant(*args)
        ws = symm.workspace(mrs.KIND, group_name(), out.device)
        start_epoch = int(ws.epoch.item())
        for replay in range(replays):
            fresh = _problem(index, torch.bfloat16, seed + 1 + replay)
            for old, new in zip([*inputs, *mat2s, b], [*fresh[0], *fresh[1], fresh[2]]):
                if old is not None:
                    old.copy_(new)  # in place: the graph reads these addresses
            out.fill_(float("nan"))
            graph.replay()
            _check(f"{name} replay {replay}", out, _reference(index, torch.bfloat16, seed + 1 + replay), torch.bfloat16)
        torch.cuda.synchronize()
        assert int(ws.epoch.item()) == start_epoch + replays, f"{name}: the epoch did not advance on replay"
    symm.check_all_timeouts()
    return replays * len(names)


def late_peer_is_named(seed=0) -> str:
    """Rank 1 calls alone with a short spin limit: the error names the ranks it waited for at
    the barrier and whose partials never came."""
    world = dist.get_world_size()
    inputs, mat2s, b, reduce_op, scatter_dim = _problem(1, torch.bfloat16, seed)
    rows, n = inputs[0].shape[0] // world, mat2s[0].shape[1]
    return message_of_a_late_peer(
        mrs.KIND, 2 * world * rows * n * inputs[0].element_size(),
        lambda group_name: mrs.copy_engine_cublas(inputs, mat2s, b, reduce_op, scatter_dim, world, group_name),
    )  # fmt: skip


def _tail_problem(inputs, seed):
    """A tail matmul per input of the op, of a weight gradient's form (the input's rows
    transposed, contracted with [rows, N] over the tokens, N odd and even), and their torch.mm
    results (the bits the tail must give: the same cuBLAS call)."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + dist.get_rank())
    rows = [a.reshape(-1, a.shape[-1]) for a in inputs]
    tail_with = [torch.randn(r.shape[0], 72 + 5 * j, device="cuda", dtype=r.dtype, generator=gen) for j, r in enumerate(rows)]
    return list(range(len(inputs))), tail_with, [torch.mm(r.t(), w) for r, w in zip(rows, tail_with)]


def tail_matmuls_match(seed=0) -> int:
    """The ``.tail`` overload: each variant on outputs poisoned with NaN (the baseline makes its
    own), then through the op (auto and forced), on a plain, a summed and a batch-4 shape: the
    reduce-scatter matches the reference, each tail matmul gives torch.mm's bits."""
    world, checked = dist.get_world_size(), 0
    for index in (0, 4, 8):
        ref = _reference(index, torch.bfloat16, seed + index)
        inputs, mat2s, b, reduce_op, scatter_dim = _problem(index, torch.bfloat16, seed + index)
        tail_of, tail_with, want = _tail_problem(inputs, seed + index)
        args = (inputs, mat2s, b, reduce_op, scatter_dim, world, group_name(), None, tail_of, tail_with)
        calls = dict(mrs.tail_variants(len(inputs)))
        for implementation in ("auto", "copy_engine_cublas", "nccl_cublas"):
            calls[f"op ({implementation})"] = functools.partial(_tail_op, implementation)
        for name, variant in calls.items():
            poison_workspace()
            if name.startswith("op") or name == "nccl_cublas":
                out, tail = variant(*args)
            else:
                outputs = mrs.allocate_tail(*args)
                for t in (outputs[0], *outputs[1]):
                    t.fill_(float("nan"))
                out, tail = variant(*args, outputs=outputs)
            _check(f"{name} with a tail", out, ref, torch.bfloat16)
            for j, (got, expected) in enumerate(zip(tail, want)):
                assert torch.equal(got, expected), f"{name}: tail matmul {j} differs from torch.mm on rank {dist.get_rank()}"
            checked += 1
    symm.check_all_timeouts()
    return checked


def _tail_op(implementation, *args):
    with config.patch(implementation=implementation):
        return torch.ops.overlap.matmul_reduce_scatter.tail(*args)


def tail_calls_replay(calls: int, seed=0) -> int:
    """The ``.tail`` overload through calls_that_replay (per-call graphs, new values each call,
    rank 0 eager): the reduce-scatter and both tail matmuls checked every call."""
    world = dist.get_world_size()
    index = 4  # a sum of two matmuls, as a backward's input gradient
    count = len(SHAPES[index][2])
    _, _, _, reduce_op, scatter_dim = _problem(index, torch.bfloat16, 0)

    def problem(s):
        inputs, mat2s, b, _, _ = _problem(index, torch.bfloat16, seed + s)
        return [*inputs, *mat2s, b, *_tail_problem(inputs, seed + s)[1]]

    def run(tensors):
        inputs, mat2s, b, tail_with = tensors[:count], tensors[count : 2 * count], tensors[2 * count], tensors[2 * count + 1 :]
        out, tail = torch.ops.overlap.matmul_reduce_scatter.tail(
            inputs, mat2s, b, reduce_op, scatter_dim, world, group_name(), None, list(range(count)), tail_with
        )
        return [out, *tail]

    def reference(s):
        inputs, _, _, _, _ = _problem(index, torch.bfloat16, seed + s)
        return [_reference(index, torch.bfloat16, seed + s), *_tail_problem(inputs, seed + s)[2]]

    return calls_that_replay(calls, ("fused", "copy_engine_cublas", "cublas_push"), problem, run, reference)
