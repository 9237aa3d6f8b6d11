"""The emulated world's schedule (benchmarks/emulated/timeline.py): which peer's push lands at
rank 0 when, for W = 2, 4, 8, against the protocol's own orders (overlap_pass.ops.schedule)."""

import pytest

from benchmarks.emulated import timeline
from overlap_pass.lowering.row_layout import RowLayout
from overlap_pass.ops import schedule

LINK = timeline.Link(latency_us=5.0, gbps=400.0)


def params(world: int, **changes) -> timeline.Parameters:
    base = dict(
        world=world, push=LINK, stores=timeline.Link(2.0, 300.0), barrier_us=8.0,
        all_gather=timeline.Link(20.0, 300.0), reduce_scatter=timeline.Link(20.0, 300.0),
        all_reduce=timeline.Link(15.0, 280.0), nccl_sms=16, source="test",
    )  # fmt: skip
    base.update(changes)
    return timeline.Parameters(**base)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_gather_chunks_land_in_the_consumers_order_one_link_time_apart(world):
    chunk = 16 << 20
    landed = timeline.arrivals(timeline.all_gather_pushes(world, chunk), params(world))
    # rank 0's consumer takes its own chunk, then rank + 1, rank + 2, ...: they land in that order
    assert [peer for peer, _ in landed] == schedule.all_gather_order(0, world)[1:]
    step = LINK.us(chunk)
    assert [t for _, t in landed] == pytest.approx([step * s for s in range(1, world)])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_peer_pushes_to_rank_0_exactly_once_per_all_gather(world):
    pushes = timeline.all_gather_pushes(world, 1 << 20)
    assert sorted(p.to_peer for p in pushes) == list(range(1, world))
    assert sorted(peer for peer, _ in timeline.arrivals(pushes, params(world))) == list(range(1, world))


def test_the_pushing_peer_is_rank_0s_target_at_the_same_step():
    # at step s rank 0 pushes to -s and peer s pushes to s - s = 0
    for world in (2, 4, 8):
        for step in range(1, world):
            to_peer = schedule.all_gather_peers(0, world, step)[0]
            assert timeline.pushing_peer(to_peer, world) == step


@pytest.mark.parametrize("world", [2, 4, 8])
def test_reduce_scatter_partials_land_last_from_rank_plus_one(world):
    """Every peer computes rank + 1's chunk first and its own last, so the partial of rank 0's
    chunk comes from W - 1 first and from 1 last (the design's "rank + 1's last")."""
    pushes = timeline.reduce_scatter_pushes(world, 8 << 20, matmul_us=400.0, stores=False)
    landed = timeline.arrivals(pushes, params(world))
    assert [peer for peer, _ in landed] == list(range(world - 1, 0, -1))
    times = [t for _, t in landed]
    assert times == sorted(times)


def test_a_compute_bound_reduce_scatter_lands_a_link_time_after_each_matmul_share():
    world, partial = 4, 4 << 20
    p = params(world)
    landed = timeline.arrivals(timeline.reduce_scatter_pushes(world, partial, matmul_us=4000.0, stores=False), p)
    link = p.push.us(partial)
    assert [t for _, t in landed] == pytest.approx([1000.0 * n + link for n in range(1, world)])


def test_a_link_bound_reduce_scatter_lands_one_link_time_after_another():
    world, partial = 4, 64 << 20
    p = params(world)
    landed = timeline.arrivals(timeline.reduce_scatter_pushes(world, partial, matmul_us=40.0, stores=False), p)
    link = p.push.us(partial)
    first = 10.0 + link  # the first share of the matmul, then the link
    assert [t for _, t in landed] == pytest.approx([first + link * n for n in range(world - 1)])


def test_a_producers_stores_stream_while_it_computes():
    """Stores leave with the tiles: when compute is the bound, a partial lands its latency after
    its last tile; when the link is, one partial's bytes after another's."""
    world = 4
    p = params(world)
    slow = timeline.arrivals(timeline.reduce_scatter_pushes(world, 1 << 20, 4000.0, stores=True), p)
    assert [t for _, t in slow] == pytest.approx([1000.0 * n + p.stores.latency_us for n in range(1, world)])
    bytes_ = 64 << 20
    fast = timeline.arrivals(timeline.reduce_scatter_pushes(world, bytes_, 40.0, stores=True), p)
    per_partial = bytes_ / (p.stores.gbps * 1e3)
    assert [t for _, t in fast] == pytest.approx([per_partial * n for n in range(1, world)])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_time_follows_the_bus_bandwidth_model(world):
    p = params(world)
    nbytes = 64 << 20
    moved = nbytes * (world - 1) / world
    assert p.nccl_us("all_gather", nbytes) == pytest.approx(20.0 + moved / 300e3)
    assert p.nccl_us("reduce_scatter", nbytes) == pytest.approx(20.0 + moved / 300e3)
    assert p.nccl_us("all_reduce", nbytes) == pytest.approx(15.0 + 2 * moved / 280e3)
    assert params(1).nccl_us("all_gather", nbytes) == 0.0


def test_every_parameter_is_described():
    text = params(8).describe()
    for name in ("W=8", "push", "stores", "barrier_us", "all_gather", "reduce_scatter", "all_reduce", "nccl_sms", "test"):
        assert name in text


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("outer", [1, 3])
def test_rank_0s_pushes_land_once_on_every_row_of_its_peers_and_never_on_its_own(world, outer):
    """Rank 0's pushes, aimed where the mirrored peers' land (peers.py), cover every row of its
    data that a peer's chunk fills, each once, in the pushing peer's chunk of the same block."""
    inner = 5
    layout = RowLayout(outer, world, inner)
    landed = []
    for step in range(1, world):
        to_peer = schedule.all_gather_peers(0, world, step)[0]
        for block in range(outer):
            start, stop = timeline.landing_rows(to_peer, world, *layout.block_span(0, block))
            assert (start, stop) == layout.block_span(timeline.pushing_peer(to_peer, world), block)
            landed += range(start, stop)
    own = {row for block in range(outer) for row in range(*layout.block_span(0, block))}
    assert sorted(landed) == sorted(set(range(outer * world * inner)) - own)
