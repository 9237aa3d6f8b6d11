"""Every CUDA variant of every op, a problem of each op at any size, and one call of a variant
checked against fp32 references computed from every rank's operands: what the quick tier
(test_quick_gpu.py), the fault tests (test_faults_gpu.py) and tests/soak.py run, on ranks
simulated on one GPU (tests/sim_world.py) or on NCCL ranks (on_ranks).

Variants come in families: the fused variants of one kernel differ only in their block config
(fused:tma128x256x64w8s3 and fused:tma128x128x64w4s4 both run the Triton TMA kernel), so the
quick tier runs each family once, with its first config (the one implementation="fused"
forces), and every other variant (copy engine, cuBLAS push, joined operands, NCCL) as it is.

A problem holds every rank's operands (each rank computes its references from all of them),
refilled in place with new values before each call (a replayed graph reads the same addresses),
and each rank's outputs, made once and poisoned (0xFF: NaN in bf16, fp32 and float8 e4m3)
before each call, as are the workspaces: whatever a call does not write shows.
"""

import dataclasses

import torch
from overlap_pass import config
from overlap_pass.lowering import all_gather_matmul as agm
from overlap_pass.lowering import choose, dispatch, gluon_kernels, replay, scaled, symm
from overlap_pass.lowering import matmul_reduce_scatter as mrs
from overlap_pass.templates import gemm

from tests.gpu_common import error

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
BASELINE = choose.BASELINE  # NCCL + cuBLAS: needs NCCL ranks, and dispatch never graphs it
RIDER = 40  # columns of the all-gathers' bf16 passenger and of the contraction's other operand
MODES = ("eager", "replayed")


def tables() -> dict[str, dict]:
    """Op -> its variant table (name -> implementation): each op, and the reduce-scatters of a
    sum of matmuls (":sum"), whose tables differ from one matmul's."""
    return {
        "all_gather_matmul": agm.variants(1),
        "matmul_reduce_scatter": mrs.variants(1),
        "matmul_reduce_scatter:sum": mrs.variants(2),
        "all_gather_scaled_matmul": scaled.variants(scaled.AG_KIND),
        "scaled_matmul_reduce_scatter": scaled.variants(scaled.RS_KIND, 1),
        "scaled_matmul_reduce_scatter:sum": scaled.variants(scaled.RS_KIND, 2),
    }


def every_table() -> list[tuple[str, dict]]:
    """(op, table) for every count of matmuls the ops take (the all-gathers' weights, the
    reduce-scatters' summed matmuls, up to four), under tables()'s op names."""
    found = [("all_gather_matmul", agm.variants(n)) for n in range(5)]
    found += [("matmul_reduce_scatter" + (":sum" if n > 1 else ""), mrs.variants(n)) for n in range(1, 5)]
    found.append(("all_gather_scaled_matmul", scaled.variants(scaled.AG_KIND)))
    found += [
        ("scaled_matmul_reduce_scatter" + (":sum" if n > 1 else ""), scaled.variants(scaled.RS_KIND, n))
        for n in range(1, 5)
    ]
    return found


def family(name: str, variant) -> str:
    """The kernel a variant runs: a fused variant's name with its block config replaced by the
    kernel the config selects (triton_tma, triton_ptr, gluon); any other variant is a family
    of its own."""
    gemm_config = getattr(variant, "keywords", {}).get("gemm_config")
    if gluon_kernels.is_pingpong(gemm_config):
        kernel = "gluon"
    elif isinstance(gemm_config, gemm.GemmConfig):
        kernel = "triton_tma" if gemm_config.tma else "triton_ptr"
    else:
        return name
    return f"{name.rsplit(':', 1)[0]}:{kernel}"


def case_id(case: tuple[str, str, str]) -> str:
    """A test id for an (op, kernel family, variant name) case: op and family."""
    op, kind, _ = case
    return f"{op}-{kind}"


def quick_variants() -> list[tuple[str, str, str]]:
    """(op, family, variant name): the first variant of each family of each op's table."""
    cases = []
    for op, table in tables().items():
        seen = set()
        for name, variant in table.items():
            kind = family(name, variant)
            if kind not in seen:
                seen.add(kind)
                cases.append((op, kind, name))
    return cases


def unusable(op: str, kind: str, device: torch.device) -> str | None:
    """Why a family cannot run on ``device`` (a skip reason), or None."""
    if device.type != "cuda":
        return "needs a GPU"
    if "scaled" in op and torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 needs a GPU with float8 tensor cores"
    if "gluon" in kind:
        kernels = gluon_kernels.load()  # (variants() lists no Gluon variant where it is None)
        if kernels is None or not kernels.consumer.usable(device):
            return "the Gluon kernels run on Hopper"
    return None


@dataclasses.dataclass(frozen=True)
class Shape:
    """One call's sizes: ``batch`` runs of ``tokens`` rows per rank ([batch, tokens, K] shards
    gathered, or [batch, tokens * W, K] inputs scattered, along dim 1), the contraction of each
    matmul (``ks``: one, or a sum's terms), ``n`` output columns."""

    batch: int
    tokens: int
    ks: tuple[int, ...]
    n: int


# one shape per op for the quick tier, the fault tests and the soak's aligned calls, so that
# each kernel compiles once: tokens 96 (a partial 128-row tile), N 384 (a partial 256-column
# one), batch 2 (chunks of two runs of rows), a sum's second K a partial K block; every size a
# multiple of 16, as Triton specializes integer arguments (other shapes with that property
# reuse these kernels)
QUICK_SHAPES = {
    "all_gather_matmul": Shape(2, 96, (256,), 384),
    "matmul_reduce_scatter": Shape(2, 96, (256,), 384),
    "matmul_reduce_scatter:sum": Shape(2, 96, (256, 48), 384),
    "all_gather_scaled_matmul": Shape(2, 96, (256,), 384),
    "scaled_matmul_reduce_scatter": Shape(2, 96, (256,), 384),
    "scaled_matmul_reduce_scatter:sum": Shape(2, 96, (256, 320), 384),
}


def _tensors(result) -> list[torch.Tensor]:
    """A variant's result (tensors in tuples and lists, None where absent) as a flat list."""
    if isinstance(result, torch.Tensor):
        return [result]
    if result is None:
        return []
    return [t for part in result for t in _tensors(part)]


class Problem:
    """One op's operands on every rank of a world of ``world`` ranks, on ``device``; the
    variant's arguments and outputs per rank; the references per rank (``expected``: (label,
    fp32 or exact tensor, whether it must match bit for bit), in the order of the result's
    tensors)."""

    kind: str  # the op's kind in dispatch._GRAPHED_KINDS
    tolerance: float  # relative error (tests.gpu_common.error) allowed per output

    def __init__(self, op: str, shape: Shape, world: int, device: torch.device, seed: int = 0, avg: bool = False):
        self.op, self.shape, self.world, self.device = op, shape, world, device
        self.reduce_op = "avg" if avg else "sum"
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.operands: list[torch.Tensor] = []
        self._outputs: dict[int, object] = {}
        self.make()
        self.refill()

    def make(self) -> None:
        raise NotImplementedError

    def args(self, rank: int, group_name: str) -> tuple:
        raise NotImplementedError

    def expected(self, rank: int) -> list[tuple[str, torch.Tensor, bool]]:
        raise NotImplementedError

    def _new(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.operands.append(tensor)
        return tensor

    def refill(self) -> None:
        """New values in every operand, in place: data N(0, 1) (rounded to bf16 or float8),
        fp32 ones (scales, a norm's rsqrt) in [0.25, 1.25)."""
        for t in self.operands:
            if t.dtype == torch.float32:
                t.copy_(torch.rand(t.shape, generator=self.gen, device=self.device) + 0.25)
            else:
                t.copy_(torch.randn(t.shape, generator=self.gen, device=self.device))

    def outputs(self, rank: int, group_name: str):
        """Rank ``rank``'s outputs, made at its first call as the op makes them for a call."""
        if rank not in self._outputs:
            allocate = dispatch._GRAPHED_KINDS[self.kind][0]
            self._outputs[rank] = allocate(*self.args(rank, group_name))
        return self._outputs[rank]

    def poison(self) -> None:
        for outputs in self._outputs.values():
            for t in _tensors(outputs):
                t.view(torch.uint8).fill_(0xFF)

    def mismatches(self, rank: int, result) -> list[str]:
        """What in rank ``rank``'s result differs from its references (empty: nothing)."""
        got, want = _tensors(result), self.expected(rank)
        if len(got) != len(want):
            return [f"{len(got)} result tensors, expected {len(want)}"]
        bad = []
        for tensor, (label, ref, exact) in zip(got, want):
            if tensor.shape != ref.shape:
                bad.append(f"{label}: shape {list(tensor.shape)}, expected {list(ref.shape)}")
            elif exact:
                if tensor.dtype != ref.dtype or not torch.equal(tensor.view(torch.uint8), ref.view(torch.uint8)):
                    bad.append(f"{label}: not bit for bit")
            else:
                err = float(error(tensor, ref))
                if not err <= self.tolerance:
                    bad.append(f"{label}: relative error {err:.3g} > {self.tolerance}")
        return bad

    def _chunk(self, total: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a reduce-scatter's [batch, tokens * W, N] sum."""
        tokens = self.shape.tokens
        total = total / self.world if self.reduce_op == "avg" else total
        return total[:, rank * tokens : (rank + 1) * tokens]


class _AllGather(Problem):
    """all_gather_matmul with a bias, the gathered shard returned, a contraction of the gathered
    rows (a weight gradient's) and two passengers (a norm's fp32 rsqrt, a bf16 residual)."""

    kind, tolerance = agm.KIND, 2e-2

    def make(self) -> None:
        (b, t, (k,), n), world = dataclasses.astuple(self.shape), self.world
        self.shards = [self._new(b, t, k, dtype=BF16) for _ in range(world)]
        self.weight = self._new(n, k, dtype=BF16)  # a linear's [N, K], used transposed
        self.bias = self._new(n, dtype=BF16)
        self.others = [self._new(b * t * world, RIDER, dtype=BF16) for _ in range(world)]
        self.riders = [
            [self._new(b, t, 1, dtype=torch.float32), self._new(b, t, RIDER, dtype=BF16)] for _ in range(world)
        ]  # fmt: skip

    def args(self, rank: int, group_name: str) -> tuple:
        return (
            self.shards[rank], [self.weight.t()], [self.bias], 1, self.world, group_name, True,
            [self.others[rank]], [True], self.riders[rank],
        )  # fmt: skip

    def expected(self, rank: int) -> list:
        gathered = torch.cat(self.shards, dim=1)
        rows = gathered.reshape(-1, gathered.shape[-1]).float()
        riders = [torch.cat([r[i] for r in self.riders], dim=1) for i in range(2)]
        return [
            ("gathered", gathered, True),
            ("output", gathered.float() @ self.weight.float().t() + self.bias.float(), False),
            ("contraction", rows.t() @ self.others[rank].float(), False),
            *((f"passenger {i}", rider, True) for i, rider in enumerate(riders)),
        ]


class _ReduceScatter(Problem):
    """matmul_reduce_scatter of one matmul or a sum (one input per ``shape.ks``), with a bias."""

    kind, tolerance = mrs.KIND, 2e-2

    def make(self) -> None:
        (b, t, ks, n), world = dataclasses.astuple(self.shape), self.world
        self.inputs = [[self._new(b, t * world, k, dtype=BF16) for k in ks] for _ in range(world)]
        self.weights = [self._new(n, k, dtype=BF16) for k in ks]
        self.bias = self._new(n, dtype=BF16)

    def args(self, rank: int, group_name: str) -> tuple:
        mat2s = [w.t() for w in self.weights]
        return (self.inputs[rank], mat2s, self.bias, self.reduce_op, 1, self.world, group_name, None)

    def expected(self, rank: int) -> list:
        total = 0
        for inputs in self.inputs:  # every rank's partial, its bias included
            total = total + self.bias.float()
            for a, w in zip(inputs, self.weights):
                total = total + a.float() @ w.float().t()
        return [("output", self._chunk(total, rank), False)]


class _ScaledAllGather(Problem):
    """all_gather_scaled_matmul, rowwise scales, fast accumulation, a bias, the gathered float8
    shard returned and a bf16 passenger."""

    kind, tolerance = scaled.AG_KIND, 1e-2

    def make(self) -> None:
        (b, t, (k,), n), world = dataclasses.astuple(self.shape), self.world
        self.shards = [self._new(b, t, k, dtype=FP8) for _ in range(world)]
        self.scales = [self._new(b, t, 1, dtype=torch.float32) for _ in range(world)]
        self.weight = self._new(n, k, dtype=FP8)
        self.weight_scale = self._new(1, n, dtype=torch.float32)
        self.bias = self._new(n, dtype=BF16)
        self.riders = [[self._new(b, t, RIDER, dtype=BF16)] for _ in range(world)]

    def args(self, rank: int, group_name: str) -> tuple:
        return (
            self.shards[rank], self.scales[rank], [self.weight.t()], [self.weight_scale], [self.bias], 1,
            self.world, group_name, BF16, True, True, self.riders[rank],
        )  # fmt: skip

    def expected(self, rank: int) -> list:
        gathered = torch.cat(self.shards, dim=1)
        a = gathered.float() * torch.cat(self.scales, dim=1)
        out = a @ (self.weight.float().t() * self.weight_scale) + self.bias.float()
        rider = torch.cat([r[0] for r in self.riders], dim=1)
        return [("gathered", gathered, True), ("output", out, False), ("passenger", rider, True)]


class _ScaledReduceScatter(Problem):
    """scaled_matmul_reduce_scatter of one matmul or a sum, rowwise scales, fast accumulation,
    a bias, bf16 out."""

    kind, tolerance = scaled.RS_KIND, 1e-2

    def make(self) -> None:
        (b, t, ks, n), world = dataclasses.astuple(self.shape), self.world
        self.inputs = [[self._new(b, t * world, k, dtype=FP8) for k in ks] for _ in range(world)]
        self.scales = [[self._new(b, t * world, 1, dtype=torch.float32) for _ in ks] for _ in range(world)]
        self.weights = [self._new(n, k, dtype=FP8) for k in ks]
        self.weight_scales = [self._new(1, n, dtype=torch.float32) for _ in ks]
        self.bias = self._new(n, dtype=BF16)

    def args(self, rank: int, group_name: str) -> tuple:
        return (
            self.inputs[rank], self.scales[rank], [w.t() for w in self.weights], self.weight_scales, self.bias,
            self.reduce_op, 1, self.world, group_name, BF16, None, True,
        )  # fmt: skip

    def expected(self, rank: int) -> list:
        total = 0
        for inputs, scales in zip(self.inputs, self.scales):
            total = total + self.bias.float()
            for a, s, w, ws in zip(inputs, scales, self.weights, self.weight_scales):
                total = total + (a.float() * s) @ (w.float().t() * ws)
        return [("output", self._chunk(total, rank), False)]


_PROBLEMS = {
    "all_gather_matmul": _AllGather,
    "matmul_reduce_scatter": _ReduceScatter,
    "matmul_reduce_scatter:sum": _ReduceScatter,
    "all_gather_scaled_matmul": _ScaledAllGather,
    "scaled_matmul_reduce_scatter": _ScaledReduceScatter,
    "scaled_matmul_reduce_scatter:sum": _ScaledReduceScatter,
}


def make(op: str, shape: Shape, world: int, device: torch.device, seed: int = 0, avg: bool = False) -> Problem:
    """A problem of ``op`` (a tables() key); ``avg``: a reduce-scatter averages."""
    return _PROBLEMS[op](op, shape, world, device, seed, avg)


def signature(problem: Problem, name: str, rank: int, group_name: str) -> tuple:
    """replay.py's key of a rank's calls of variant ``name`` on ``problem``."""
    return ("variant_cases", problem.op, name, rank, group_name, id(problem))


def forget(problem: Problem, name: str, group_names) -> None:
    """Drops replay.py's graphs of ``problem``'s calls (its tensors are about to go)."""
    replay.forget(signature(problem, name, rank, g) for rank, g in enumerate(group_names))


def call(problem: Problem, name: str, variant, rank: int, group_name: str, mode: str):
    """One call of ``variant`` on rank ``rank``'s operands. NCCL's variant as the op runs it
    (outputs of its own, never graphed); the others into the problem's outputs, eagerly, or
    through replay.py (mode "replayed", dispatch's path: the first call of an address set runs
    eagerly, the second is captured and replayed, later ones replay)."""
    args = problem.args(rank, group_name)
    if name == BASELINE:
        return variant(*args)
    outputs = problem.outputs(rank, group_name)
    if mode == "eager":
        return variant(*args, outputs=outputs)
    _, workspace_kind, tensors_of = dispatch._GRAPHED_KINDS[problem.kind]
    tensors, group, device = tensors_of(args, outputs)
    workspace = symm.workspace(workspace_kind, group, device)
    with config.patch(op_graphs=True):
        replay.call(signature(problem, name, rank, group_name), variant, args, outputs, tensors, workspace)
    return outputs


def run_in(
    world, problem: Problem, name: str, variant, mode: str, refill=True, poison_workspaces=True, **faults
) -> dict:
    """One checked round of ``variant`` on the ranks of the simulated ``world`` (SimWorld.run,
    its warm-up round first unless ``warm_up=False``; ``faults``: its ``absent`` and ``late``),
    the operands refilled, the outputs and, with ``poison_workspaces``, the workspaces poisoned
    before it. Returns rank -> its mismatches, for the ranks called (SimWorld.run raises
    ChunkTimeout first if a wait gave up)."""

    def prepare():
        if refill:
            problem.refill()
        problem.poison()
        if poison_workspaces:
            world.poison()

    results = world.run(lambda r, g: call(problem, name, variant, r, g, mode), prepare=prepare, **faults)
    return {rank: problem.mismatches(rank, result) for rank, result in enumerate(results) if result is not None}


def on_ranks(op: str, name: str, mode: str) -> int:
    """Per rank of an NCCL world (tests/rank_pool.py): variant ``name`` of ``op`` at its quick
    shape, a warm-up call first (its given-up waits forgotten: a rank may still be compiling a
    kernel while its peer waits), then one checked call eagerly, or three through replay.py
    (captured, then replayed twice), new values and poisoned outputs and workspaces each time.
    Returns the calls checked."""
    import torch.distributed as dist

    from tests.gpu_common import poison_workspace
    from tests.sim_world import forget_timeouts

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    group_name = dist.group.WORLD.group_name
    problem = make(op, QUICK_SHAPES[op], world, device)
    variant = tables()[op][name]
    checked = 0
    for index in range(2 if mode == "eager" else 4):
        problem.refill()  # the same values on every rank: one seed, every rank's operands
        problem.poison()
        poison_workspace()  # (a barrier too)
        result = call(problem, name, variant, rank, group_name, mode)
        torch.cuda.synchronize()
        dist.barrier()
        if index == 0:
            forget_timeouts(symm._WORKSPACES.values())
            dist.barrier()
            continue
        symm.check_all_timeouts()
        bad = problem.mismatches(rank, result)
        assert not bad, f"{op} {name} {mode}, rank {rank}, call {index}: {bad}"
        checked += 1
        del result
    replay.forget([signature(problem, name, rank, group_name)])
    return checked
