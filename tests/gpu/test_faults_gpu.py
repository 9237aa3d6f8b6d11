"""Faults on ranks simulated on one GPU (tests/sim_world.py), at the quick tier's shapes (no
kernel beyond the quick tier's compiles here, but for W=3's small protocol kernels): a rank
that never arrives is named by every other rank within the spin bound, eagerly and from a
replayed per-call graph, by every variant; a rank late at the barrier or at any of its
transfers leaves every result right.

After a wait gives up, symm.Workspace refuses further calls: the workspace that raised the
ChunkTimeout (one op kind on one group, on that rank) raises ChunkTimeout ("refuses calls") at
once on every later call, of any shape, eager or replayed, without queuing anything, since the
rank that missed the call stays an epoch behind its peers for good. The rank that missed it
gets the right results if it makes that call late (its peer's data of the call is still in its
workspace); its next call then waits for the refusing peer, gives up, and it refuses too. The
group's other op kind, on workspaces of its own, keeps working on every rank.

Every test has its own watchdog (WATCHDOG_S): a hang dumps the stacks and ends the run.
"""

import dataclasses
import re
import time

import pytest
import torch
from overlap_pass.lowering import dispatch, replay, symm

from tests.gpu import variant_cases as cases

pytestmark = [
    pytest.mark.quick,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.usefixtures("watchdog"),
]

WATCHDOG_S = 120
BOUND_S = 20  # a round whose peer is missing: each wait gives up after SPIN_LIMIT polls (well under 1 s)
SIMULATED = [case for case in cases.quick_variants() if case[2] != cases.BASELINE]
COPY_ENGINE = "copy_engine_cublas"
BF16_KINDS = ("all_gather_matmul", "matmul_reduce_scatter")


@pytest.fixture
def fresh_world():
    """fresh_world(W): a simulated world for this test alone (a fault leaves it refusing calls)."""
    from tests.sim_world import SimWorld

    made = []

    def make(size: int):
        made.append(SimWorld(size))
        return made[-1]

    yield make
    for world in made:
        world.close()


@pytest.fixture(scope="module")
def late_world():
    """late_world(W): the module's simulated world of W ranks (late ranks leave it in step)."""
    from tests.sim_world import SimWorld

    held = {}

    def get(size: int):
        world = held.get(size)
        if world is None or world.out_of_step:
            if world is not None:
                world.close()
            world = held[size] = SimWorld(size)
        return world

    yield get
    for world in held.values():
        world.close()


def _setup(op: str, kind: str, name: str, world):
    device = world.device
    reason = cases.unusable(op, kind, device)
    if reason:
        pytest.skip(reason)
    return cases.make(op, cases.QUICK_SHAPES[op], world.size, device), cases.tables()[op][name]


def _named(problem, rank: int, missing: int) -> str:
    """What rank ``rank`` says when rank ``missing`` never arrived."""
    kind = dispatch._GRAPHED_KINDS[problem.kind][1]  # the workspace's kind
    return (
        f"{kind}: rank {rank} gave up waiting at the barrier for ranks [{missing}] "
        f"and for {symm._WAITED_FOR[kind]} [{missing}]"
    )


def _missing_round(world, problem, name, variant, mode, missing: int) -> str:
    """A checked round of every rank first, then one without rank ``missing``: returns the
    ChunkTimeout's message, having checked that it came within BOUND_S. Replayed, the capture
    falls in the warm-up (a second round): in one process a rank's capture can hold the host
    past a peer's spin bound (a cuBLAS kernel loaded inside it), which a real peer would not see."""
    warm_up = 2 if mode == "replayed" else 1
    assert not any(cases.run_in(world, problem, name, variant, mode, warm_up=warm_up).values())
    replayed = replay.stats["replayed"]
    start = time.perf_counter()
    with pytest.raises(symm.ChunkTimeout) as raised:
        cases.run_in(world, problem, name, variant, mode, absent={missing}, warm_up=False)
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, f"the missing rank was named after {elapsed:.1f} s"
    if mode == "replayed":  # the warm-up captured the present rank's graph; the missing round replayed it
        assert replay.stats["replayed"] - replayed == world.size - 1
    return str(raised.value)


@pytest.mark.parametrize("mode", cases.MODES)
@pytest.mark.parametrize("op, kind, name", SIMULATED, ids=[cases.case_id(c) for c in SIMULATED])
def test_a_missing_rank_is_named(fresh_world, op, kind, name, mode):
    """Rank 1 never makes the call: rank 0 raises ChunkTimeout naming it at the barrier and its
    chunk (or partial), within the bound; replayed, rank 0's call is a replay of a graph
    captured with the world in step (the graph's spin limit bounds its waits)."""
    world = fresh_world(2)
    problem, variant = _setup(op, kind, name, world)
    try:
        message = _missing_round(world, problem, name, variant, mode, missing=1)
        assert _named(problem, 0, 1) in message, message
    finally:
        cases.forget(problem, name, world.group_names)


@pytest.mark.parametrize("missing", [0, 1, 2])
@pytest.mark.parametrize("op", BF16_KINDS)
def test_every_other_rank_names_the_missing_one(fresh_world, op, missing):
    """Three ranks, one never arrives: both others name it."""
    world = fresh_world(3)
    problem, variant = _setup(op, COPY_ENGINE, COPY_ENGINE, world)
    message = _missing_round(world, problem, COPY_ENGINE, variant, "eager", missing)
    for rank in range(3):
        if rank != missing:
            assert _named(problem, rank, missing) in message, message
    assert message.count("gave up") == 2, message


def _transfers_through_views(op: str, kind: str) -> bool:
    """Whether the variant queues its transfers to peers from the host (so SimWorld can hold one
    back, tests/sim_world.py); the fused reduce-scatters' kernels store into peers themselves."""
    return op.startswith("all_gather") or not kind.startswith("fused")


def _late_everywhere(world, problem, name, variant, positions) -> None:
    for late in range(world.size):
        for position in positions:
            bad = cases.run_in(world, problem, name, variant, "eager", late=(late, position))
            assert world.delayed, f"rank {late} was not held back at {position}"
            assert not any(bad.values()), f"rank {late} late at {position}: {bad}"


@pytest.mark.parametrize("op, kind, name", SIMULATED, ids=[cases.case_id(c) for c in SIMULATED])
def test_a_late_rank_leaves_the_results_right(late_world, op, kind, name):
    """Two ranks, each in turn late at the barrier and, where the variant transfers from the
    host, right before its transfer to its peer (the peer's consumer then waits on that
    chunk's flag with the chunk's rows still poisoned)."""
    world = late_world(2)
    problem, variant = _setup(op, kind, name, world)
    positions = ["barrier"] + ([0] if _transfers_through_views(op, kind) else [])
    try:
        _late_everywhere(world, problem, name, variant, positions)
    finally:
        cases.forget(problem, name, world.group_names)


HOST_TRANSFERS = [case for case in SIMULATED if not case[1].startswith("fused")]


@pytest.mark.parametrize("op, kind, name", HOST_TRANSFERS, ids=[cases.case_id(c) for c in HOST_TRANSFERS])
def test_a_late_rank_at_every_chunk_position(late_world, op, kind, name):
    """Three ranks, each in turn late at the barrier and before its transfer to its first and
    its second peer: each peer then meets the late chunk at another position of its order.
    Variants without Triton GEMMs (cuBLAS, copy engine), so that three ranks compile only the
    protocol's small kernels anew."""
    world = late_world(3)
    problem, variant = _setup(op, kind, name, world)
    _late_everywhere(world, problem, name, variant, ["barrier", 0, 1])


@pytest.mark.parametrize("op", BF16_KINDS)
def test_after_a_timeout_the_kind_refuses_calls_and_the_other_kind_works(fresh_world, op):
    """The sequence the module docstring tells, copy-engine variant, ranks 0 and 1."""
    world = fresh_world(2)
    problem, variant = _setup(op, COPY_ENGINE, COPY_ENGINE, world)
    rank0 = world.workspace(dispatch._GRAPHED_KINDS[problem.kind][1], 0)
    keep = dict(refill=False, poison_workspaces=False, warm_up=False)  # the missed call's data stays
    # every rank's graph captured (and checked), then rank 1 misses a call
    assert not any(cases.run_in(world, problem, COPY_ENGINE, variant, "replayed").values())
    with pytest.raises(symm.ChunkTimeout, match=re.escape(_named(problem, 0, 1))):
        cases.run_in(world, problem, COPY_ENGINE, variant, "eager", absent={1}, warm_up=False)
    # rank 0 refuses a call of another shape, and a replay of its graph, queuing nothing
    epoch = int(rank0.epoch.item())
    later = cases.make(op, dataclasses.replace(problem.shape, tokens=160), 2, world.device, seed=1)
    for mode, calls in (("eager", later), ("replayed", problem)):
        with pytest.raises(symm.ChunkTimeout, match="rank 0 refuses calls on group"):
            cases.run_in(world, calls, COPY_ENGINE, variant, mode, **keep)
    assert int(rank0.epoch.item()) == epoch
    # rank 1 makes the call it missed, late: right results from rank 0's data of that call
    assert cases.run_in(world, problem, COPY_ENGINE, variant, "eager", absent={0}, **keep) == {1: []}
    # its next call waits for rank 0, which refuses: rank 1 gives up, names rank 0, refuses too
    with pytest.raises(symm.ChunkTimeout, match=re.escape(_named(problem, 1, 0))):
        cases.run_in(world, problem, COPY_ENGINE, variant, "eager", absent={0}, warm_up=False)
    with pytest.raises(symm.ChunkTimeout, match="rank 1 refuses calls on group"):
        cases.run_in(world, problem, COPY_ENGINE, variant, "eager", absent={0}, warm_up=False)
    # the other kind, on workspaces of its own, works on both ranks
    other = BF16_KINDS[1 - BF16_KINDS.index(op)]
    other_problem = cases.make(other, cases.QUICK_SHAPES[other], 2, world.device)
    bad = cases.run_in(world, other_problem, COPY_ENGINE, cases.tables()[other][COPY_ENGINE], "eager")
    assert bad == {0: [], 1: []}
    cases.forget(problem, COPY_ENGINE, world.group_names)
