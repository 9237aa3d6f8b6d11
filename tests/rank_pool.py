"""A pool of ranks that lives across tests: spawning processes and importing torch once per
world size, not once per test, keeps CI fast on two cores.

RankPool(W, "gloo" | "nccl").run(fn, *args) runs fn(*args) on every rank (fn must be importable)
and returns the per-rank results; an exception on any rank is raised here with that rank's
traceback and the end of its log. Every wait is bounded: a rank that does not answer in time is
named, with every rank's Python stacks at that moment and the end of its log (overlap_pass at
DEBUG), and the pool is torn down. A rank that fails mostly leaves its peers waiting in a collective: they get
PEER_GRACE_S to answer, then the failure is raised with their stacks, and the pool torn down.
NCCL ranks use GPU <rank>, with NVLink multicast off.
"""

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import socket
import tempfile
import threading
import time
import traceback

TASK_TIMEOUT_S = float(os.environ.get("OVERLAP_TEST_TIMEOUT_S", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


LOG_TAIL_LINES = 20
STACKS_BEFORE_S = 3  # a rank dumps its stacks this long before the pool's deadline
PEER_GRACE_S = float(os.environ.get("OVERLAP_TEST_PEER_GRACE_S", "20"))


def _dump_when_asked(asked, stacks) -> None:
    asked.wait()
    faulthandler.dump_traceback(file=stacks, all_threads=True)


def _worker(rank: int, world_size: int, backend: str, port: int, tasks, results, notes: str, asked) -> None:
    os.environ.update(MULTICAST_OFF)
    # what a rank was doing when the pool gives up on it: its stacks, dumped by faulthandler's
    # timer thread shortly before the pool's deadline, or by a thread of its own when the pool
    # asks (no signal: NCCL ranks showed none), and its log
    stacks = open(os.path.join(notes, f"rank{rank}.stacks"), "w")
    threading.Thread(target=_dump_when_asked, args=(asked, stacks), daemon=True).start()
    handler = logging.FileHandler(os.path.join(notes, f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    overlap_log = logging.getLogger("overlap_pass")
    overlap_log.addHandler(handler)
    overlap_log.setLevel(logging.DEBUG)
    import torch
    import torch.distributed as dist

    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        **kwargs,
    )
    from tests.graphs_only import graphs_only

    compiled_fully = True
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, dump_after_s, fully = task
        if fully != compiled_fully:  # no compiled code of one kind served to a task of the other
            torch._dynamo.reset()
            compiled_fully = fully
        stacks.seek(0)
        stacks.truncate()  # only this task's stacks
        faulthandler.dump_traceback_later(dump_after_s, file=stacks)
        try:
            with contextlib.nullcontext() if fully else graphs_only():
                value = fn(*args)
            pickle.dumps(value)  # here, not in the queue's feeder thread, which fails silently
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class RankFailed(AssertionError):
    pass


# Whether the gloo tasks of a world of 2 compile fully (Inductor's kernels and its lowering of
# overlap's ops), or as far as the post-grad passes, running the graph those leave
# (tests/graphs_only.py: the same graphs and decisions; on CI's two cores building the kernels
# was most of a test's time). Worlds of 3 and more always stop there. tests/cpu/conftest.py sets
# it per test (the tests marked `kernels` compile fully); OVERLAP_TEST_KERNELS=w2 compiles every
# W=2 task fully, =all every task at every W; NCCL ranks always compile fully.
FULL_COMPILE_AT_W2 = True


def compiles_fully(world_size: int, backend: str) -> bool:
    mode = os.environ.get("OVERLAP_TEST_KERNELS", "marked")
    if backend != "gloo" or mode == "all":
        return True
    return world_size <= 2 and (mode == "w2" or FULL_COMPILE_AT_W2)


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world_size, self.backend = world_size, backend
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.notes = tempfile.mkdtemp(prefix="overlap-ranks-")
        self.torn_down = False
        self.asked_for_stacks = ctx.Event()
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, port, self.tasks[r], self.results, self.notes, self.asked_for_stacks),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        if self.torn_down:
            raise RankFailed(f"{fn.__name__}: not run, the pool was torn down after an earlier task left ranks stuck")
        dump_after_s = max(TASK_TIMEOUT_S - STACKS_BEFORE_S, 1.0)
        # a task the queue cannot pickle fails in its feeder thread, silently, and no rank gets
        # it: raise here instead of waiting out the timeout
        pickle.dumps((fn, args))
        fully = compiles_fully(self.world_size, self.backend)
        for q in self.tasks:
            q.put((fn, args, dump_after_s, fully))
        answers = {}
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise self._given_up(fn, answers) from None
            answers[rank] = (ok, value)
            if not ok:  # its peers may wait for it in a collective: not for long
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        failed = _failed(answers)
        if failed:
            raise RankFailed(f"{_first_failure(fn, failed)}\n{self._log_tail(min(failed))}")
        return [answers[r][1] for r in range(self.world_size)]

    def _given_up(self, fn, answers: dict) -> RankFailed:
        """The error of a task some ranks did not answer: a rank's failure first, if one
        failed; the pool is torn down (its ranks may be stuck for good)."""
        missing = sorted(set(range(self.world_size)) - set(answers))
        failed = _failed(answers)
        if failed:  # before the deadline, so before the timer's dump: asked for now
            self.asked_for_stacks.set()
            time.sleep(2)  # the dump lands meanwhile
        where = self._where_ranks_are()
        self.close(force=True)
        self.torn_down = True
        if failed:
            return RankFailed(
                f"{_first_failure(fn, failed)}\n"
                f"ranks {missing} gave no answer {PEER_GRACE_S:.0f} s later (waiting for it?)\n{where}"
            )
        return RankFailed(f"{fn.__name__}: ranks {missing} gave no answer in {TASK_TIMEOUT_S:.0f} s\n{where}")

    def _where_ranks_are(self) -> str:
        """Every rank's Python stacks, dumped shortly before the deadline or when asked (a rank
        that answered has none), and the end of its log."""
        parts = []
        for rank, p in enumerate(self.procs):
            state = "alive" if p.is_alive() else f"exited with {p.exitcode}"
            parts.append(f"--- rank {rank} ({state}): stacks")
            parts.append(_read(os.path.join(self.notes, f"rank{rank}.stacks")))
            parts.append(self._log_tail(rank))
        return "\n".join(parts)

    def _log_tail(self, rank: int) -> str:
        lines = _read(os.path.join(self.notes, f"rank{rank}.log")).splitlines()
        header = f"--- rank {rank}: the last {LOG_TAIL_LINES} lines of its overlap_pass log"
        return "\n".join([header, *lines[-LOG_TAIL_LINES:]])

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.notes, ignore_errors=True)


def _failed(answers: dict) -> dict:
    """Rank -> traceback, of the ranks whose answer is a failure."""
    return {r: value for r, (ok, value) in answers.items() if not ok}


def _first_failure(fn, failed: dict) -> str:
    rank = min(failed)
    return f"{fn.__name__} failed on rank {rank}:\n{failed[rank]}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "(empty)"
    except OSError:
        return "(none)"
