"""The quick GPU tier: every CUDA variant of every op once (one config per fused kernel,
variant_cases.py), eager and replayed from per-call CUDA graphs, at W=2, at one shape per op, so
that each kernel compiles once. Ranks simulated on one GPU (tests/sim_world.py, one world for
the module); NCCL ranks too where there are two GPUs (NCCL's own variant runs there only).

    python3 -m pytest tests/gpu -m quick -q
"""


import pytest
import torch
from overlap_pass.lowering import replay

from tests.gpu import variant_cases as cases
from tests.gpu.conftest import GPUS
from tests.rank_pool import RankPool

QUICK = cases.quick_variants()
WATCHDOG_S = 240  # per simulated test, compilation included: a hang ends the run, named


@pytest.fixture(scope="module")
def sim_world():
    """The module's simulated world of two ranks, made anew where a test left it refusing calls
    (after a ChunkTimeout)."""
    from tests.sim_world import SimWorld

    held = {}

    def get():
        world = held.get("world")
        if world is None or world.out_of_step:
            if world is not None:
                world.close()
            world = held["world"] = SimWorld(2)
        return world

    yield get
    if "world" in held:
        held["world"].close()


@pytest.fixture(scope="module")
def nccl_pair():
    pool = RankPool(2, "nccl")
    yield pool
    pool.close()


def _skip_unless_runs(op: str, kind: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    reason = cases.unusable(op, kind, device)
    if reason:
        pytest.skip(reason)


@pytest.mark.quick
def test_the_quick_tier_has_every_variant():
    """Every family of every variant table (every count of weights and summed matmuls) is
    among the quick cases, and nothing else: a variant added to a table cannot escape the tier."""
    full = {(op, cases.family(name, v)) for op, table in cases.every_table() for name, v in table.items()}
    quick = {(op, kind) for op, kind, _ in QUICK}
    assert quick == full, (sorted(full - quick), sorted(quick - full))
    assert len(quick) == len(QUICK)
    assert all(name in cases.tables()[op] for op, _, name in QUICK)


@pytest.mark.quick
@pytest.mark.usefixtures("watchdog")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", cases.MODES)
@pytest.mark.parametrize("op, kind, name", QUICK, ids=[cases.case_id(c) for c in QUICK])
def test_simulated_ranks(sim_world, op, kind, name, mode):
    """Eager: one checked call per rank (after a warm-up one). Replayed: two rounds of two
    calls per rank through replay.py, new values each: eager, captured, then replayed twice;
    the second round's calls must all be replays."""
    _skip_unless_runs(op, kind)
    if name == cases.BASELINE:
        pytest.skip("NCCL's variant needs NCCL ranks (test_nccl_ranks, two GPUs)")
    world = sim_world()
    problem = cases.make(op, cases.QUICK_SHAPES[op], world.size, world.device)
    variant = cases.tables()[op][name]
    try:
        for round_ in range(1 if mode == "eager" else 2):
            replayed = replay.stats["replayed"]
            bad = cases.run_in(world, problem, name, variant, mode)
            assert not any(bad.values()), f"round {round_}: {bad}"
        if mode == "replayed":
            keys = [cases.signature(problem, name, r, g) for r, g in enumerate(world.group_names)]
            states = [replay._SIGNATURES.get(key) for key in keys]
            seen = [None if s is None else (len(s.graphs), s.failed, s.eager_calls) for s in states]
            replays = replay.stats["replayed"] - replayed
            assert replays == 2 * world.size, f"{replays} replays; (graphs, capture failed, eager calls): {seen}"
    finally:
        cases.forget(problem, name, world.group_names)


@pytest.mark.quick
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs: NCCL ranks")
@pytest.mark.parametrize("mode", cases.MODES)
@pytest.mark.parametrize("op, kind, name", QUICK, ids=[cases.case_id(c) for c in QUICK])
def test_nccl_ranks(nccl_pair, op, kind, name, mode):
    """The same on two NCCL ranks (GPUs 0 and 1), NCCL's variant included (eagerly: dispatch
    never graphs it)."""
    _skip_unless_runs(op, kind)
    if name == cases.BASELINE and mode == "replayed":
        pytest.skip("NCCL's variant runs eagerly: dispatch never graphs it")
    checked = nccl_pair.run(cases.on_ranks, op, name, mode)
    assert checked == [1 if mode == "eager" else 3] * 2
