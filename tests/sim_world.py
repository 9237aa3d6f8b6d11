"""W ranks of overlap's symmetric-memory protocol inside one process, on one GPU.

torch's symmetric memory refuses two processes on one device, so a one-GPU machine cannot run
the CUDA variants at W > 1 for real. Here each simulated rank has its own workspaces (plain
device buffers that every rank addresses directly, standing for the peer mappings), its own
caller's stream and side stream, and its own group name; its calls are queued from this thread
in rank order, each on its rank's stream, so that the ranks' kernels, copies and flags meet on
the GPU as they would across GPUs (slowly: this checks results and the protocol, not speed).

    world = SimWorld(2)
    outs = world.run(lambda rank, group_name: variant(..., group_name))
    world.close()

Waits are bounded (SPIN_LIMIT), as on real ranks; run() raises ChunkTimeout naming the rank and
chunk a wait gave up on.
"""

import gc
import math

import torch
from overlap_pass import config
from overlap_pass.lowering import symm

KINDS = ("all_gather_matmul", "matmul_reduce_scatter")
DATA_BYTES = 64 << 20  # reserved up front on every rank: no workspace grows during a run
# polls per wait, in both rounds of a run (a fraction of a second): the limit is a constant of
# the kernels, so a round with another one would compile and load them anew
SPIN_LIMIT = 200_000


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Handle:
    """Stands for torch's _SymmetricMemory: every rank's buffer, addressed directly."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def get_buffer(self, peer: int, shape, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        words = self.buffers[peer].view(dtype)
        return words[storage_offset : storage_offset + math.prod(shape)].view(shape)


class _Workspace(symm.Workspace):
    def __init__(self, kind: str, world: "SimWorld", rank: int):
        self.world = world
        super().__init__(kind, world.group_names[rank], world.device, group=_Group(rank, world.size))

    def _rendezvous(self, nbytes: int):
        buffers = self.world.buffers(self.kind, nbytes)
        return buffers[self.rank], _Handle(buffers)

    def _host_barrier(self) -> None:  # the ranks reserve one after another, before any call
        pass


class SimWorld:
    def __init__(self, size: int, device: torch.device | None = None):
        self.size = size
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.group_names = [f"sim{size}.{id(self)}.{rank}" for rank in range(size)]
        self.streams = [symm.new_stream(self.device) for _ in range(size)]
        self._buffers: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._workspaces = []
        for kind in KINDS:
            for rank in range(size):
                ws = _Workspace(kind, self, rank)
                symm._WORKSPACES[(kind, self.group_names[rank], self.device.index)] = ws
                self._workspaces.append(ws)
        for ws in self._workspaces:  # every rank zeroes its flags before any rank signals
            ws.reserve(DATA_BYTES)
        torch.cuda.synchronize(self.device)

    def buffers(self, kind: str, nbytes: int) -> list[torch.Tensor]:
        """Every rank's buffer of ``kind`` and size (made at the first rank's ask)."""
        key = (kind, nbytes)
        if key not in self._buffers:
            self._buffers[key] = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        return self._buffers[key]

    def run(self, call, warm_up: bool = True, prepare=None) -> list:
        """``call(rank, group_name)`` for every rank, each queued on its rank's stream after
        the work queued so far; returns their results once the GPU is done, having checked that
        no wait gave up.

        First, unless told not to, a warm-up round whose results and given-up waits are thrown
        away: the first launch of a kernel in a process loads it (CUDA's lazy loading), which may
        wait for the device to be idle, and one process has every rank's spinning kernels,
        while the rank whose work would end the spin is queued only after this one.
        ``prepare()`` runs between the two rounds (poisoning the workspaces, say)."""
        with config.patch(spin_limit=SPIN_LIMIT):
            return self._run(call, warm_up, prepare)

    def _run(self, call, warm_up: bool, prepare) -> list:
        if warm_up:
            self._queue(call)
            torch.cuda.synchronize(self.device)
            for ws in self._workspaces:
                ws.timeouts.zero_()
                ws._timeouts_host.zero_()
                ws._timeouts_copied = None
            torch.cuda.synchronize(self.device)
        if prepare is not None:
            prepare()
        results = self._queue(call)
        torch.cuda.synchronize(self.device)
        for ws in self._workspaces:
            ws.check_timeouts()
        return results

    def _queue(self, call) -> list:
        caller = torch.cuda.current_stream(self.device)
        results = []
        for rank, stream in enumerate(self.streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                results.append(call(rank, self.group_names[rank]))
        for stream in self.streams:
            caller.wait_stream(stream)
        return results

    def poison(self) -> None:
        """Fills every data region with 0xFF (NaN in bf16 and float8 e4m3), flags untouched."""
        for buffers in self._buffers.values():
            for buffer in buffers:
                buffer[symm.CONTROL_BYTES :].fill_(0xFF)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        for kind in KINDS:
            for name in self.group_names:
                symm._WORKSPACES.pop((kind, name, self.device.index), None)
        for ws in self._workspaces:
            ws.first_graph = None  # the graph pool of replay.py's captures on this workspace
        self._workspaces.clear()
        self._buffers.clear()
        gc.collect()  # the workspaces and their graphs go now, not amid a later world's calls
        torch.cuda.synchronize(self.device)
