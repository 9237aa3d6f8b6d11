"""The test pool of ranks names a rank that does not answer: its Python stacks at that moment
and the end of its overlap_pass log, instead of a bare timeout; a rank's failure is raised soon
even when its peers are left waiting for it in a collective."""

import logging
import time

import pytest

from tests import rank_pool


def _one_rank_sleeps(seconds: float) -> int:
    import torch.distributed as dist

    logging.getLogger("overlap_pass").info("rank %d: about to sleep", dist.get_rank())
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_rank_that_does_not_answer_is_named_with_its_stack_and_log(monkeypatch):
    pool = rank_pool.RankPool(2, "gloo")
    try:
        # the ranks start (torch imported, the group made) under the usual timeout: on a busy
        # two-core machine that alone can take more than the 5 s the sleeping task is given
        assert pool.run(_one_rank_sleeps, 0.0) == [0, 1]
        monkeypatch.setattr(rank_pool, "TASK_TIMEOUT_S", 5.0)
        with pytest.raises(rank_pool.RankFailed) as failed:
            pool.run(_one_rank_sleeps, 60.0)
        with pytest.raises(rank_pool.RankFailed, match="torn down"):  # at once, not after the timeout
            pool.run(_one_rank_sleeps, 0.0)
    finally:
        pool.close(force=True)
    message = str(failed.value)
    assert "ranks [1] gave no answer in 5 s" in message, message
    rank0 = message.split("--- rank 0 (alive): stacks")[1].split("--- rank 1")[0]
    rank1 = message.split("--- rank 1 (alive): stacks")[1]
    assert "_one_rank_sleeps" in rank1 and "_one_rank_sleeps" not in rank0, message  # rank 0 answered
    assert "rank 1: about to sleep" in rank1 and "rank 0: about to sleep" in rank0, message


def _one_rank_fails_the_other_waits() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up here")
    dist.barrier()  # never met: rank 1 has left


def test_a_failure_is_raised_while_a_peer_waits_for_the_failed_rank(monkeypatch):
    monkeypatch.setattr(rank_pool, "TASK_TIMEOUT_S", 120.0)
    monkeypatch.setattr(rank_pool, "PEER_GRACE_S", 3.0)
    pool = rank_pool.RankPool(2, "gloo")
    begin = time.monotonic()
    try:
        with pytest.raises(rank_pool.RankFailed) as failed:
            pool.run(_one_rank_fails_the_other_waits)
    finally:
        pool.close(force=True)
    message = str(failed.value)
    assert time.monotonic() - begin < 60, "waited for the task's timeout"
    assert message.startswith("_one_rank_fails_the_other_waits failed on rank 1"), message
    assert "ValueError: rank 1 gives up here" in message, message
    assert "ranks [0] gave no answer 3 s later" in message, message
    rank0 = message.split("--- rank 0 (alive): stacks")[1].split("--- rank 1")[0]
    assert "in barrier" in rank0 and "_one_rank_fails_the_other_waits" in rank0, message


def _returns_a_lambda():
    return lambda: 1


def test_what_the_queues_cannot_pickle_is_raised_at_once():
    """A task or a result the queues cannot pickle would fail in their feeder threads, unseen,
    and leave run() waiting out its timeout: both raise at once instead."""
    pool = rank_pool.RankPool(2, "gloo")
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match="pickle"):
            pool.run(lambda: 1)  # the task
        with pytest.raises(rank_pool.RankFailed, match="pickle"):
            pool.run(_returns_a_lambda)  # a result
        assert time.monotonic() - start < 30
    finally:
        pool.close()
