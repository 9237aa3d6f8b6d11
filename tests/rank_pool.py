"""A pool of ranks that lives across tests: spawning processes and importing torch once per
world size, not once per test, keeps CI fast on two cores.

RankPool(W, "gloo" | "nccl").run(fn, *args) runs fn(*args) on every rank (fn must be importable)
and returns the per-rank results; an exception on any rank is raised here with that rank's
traceback. Every wait is bounded: a rank that does not answer in time is named, and the pool is
torn down. NCCL ranks use GPU <rank>, with NVLink multicast off.
"""

import multiprocessing
import os
import queue
import socket
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


def _worker(rank: int, world_size: int, backend: str, port: int, tasks, results) -> None:
    os.environ.update(MULTICAST_OFF)
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
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankFailed(AssertionError):
    pass


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, port, self.tasks[r], self.results),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        for q in self.tasks:
            q.put((fn, args))
        answers = {}
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(answers))
                self.close(force=True)
                raise RankFailed(
                    f"{fn.__name__}: ranks {missing} gave no answer in {TASK_TIMEOUT_S:.0f} s"
                ) from None
            answers[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in answers.items() if not ok}
        if failed:
            rank = min(failed)
            raise RankFailed(f"{fn.__name__} failed on rank {rank}:\n{failed[rank]}")
        return [answers[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
