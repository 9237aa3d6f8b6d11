import pytest

from overlap_pass.ops import schedule


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_orders_are_rank_rotated_permutations(world_size):
    for rank in range(world_size):
        gather = schedule.all_gather_order(rank, world_size)
        scatter = schedule.reduce_scatter_order(rank, world_size)
        assert sorted(gather) == sorted(scatter) == list(range(world_size))
        assert gather[0] == rank, "the local chunk comes first"
        assert scatter[-1] == rank, "the own chunk is produced last"
        assert scatter[0] == (rank + 1) % world_size
    # at each step every rank works on a different chunk (no two pull from one peer)
    for step in range(world_size):
        assert len({schedule.all_gather_order(r, world_size)[step] for r in range(world_size)}) == world_size


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("peers", [schedule.all_gather_peers, schedule.reduce_scatter_peers])
def test_every_send_has_its_receive(world_size, peers):
    for step in range(1, world_size):
        for rank in range(world_size):
            send_to, _ = peers(rank, world_size, step)
            _, their_source = peers(send_to, world_size, step)
            assert their_source == rank


def test_all_gather_peer_sends_the_chunk_it_owns():
    # at step s, rank r receives chunk r + s, which is the sender's own chunk
    for step in range(1, 4):
        for rank in range(4):
            _, recv_from = schedule.all_gather_peers(rank, 4, step)
            assert recv_from == schedule.all_gather_order(rank, 4)[step]
