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

A producer that sums its own chunk in its epilogue waits there for its peers' partials, which
the peers' producers compute on the same GPU: each rank's persistent launch takes 1/W of the
SMs here, so that every rank's runs at once (on real ranks each has a GPU of its own).

Waits are bounded (SPIN_LIMIT), as on real ranks; run() raises ChunkTimeout naming the rank and
chunk a wait gave up on. Faults: run(..., absent={1}) leaves rank 1's call out (its peers' waits
give up), run(..., late=(1, "barrier")) starts rank 1's call late, run(..., late=(1, 0)) holds
rank 1 back right before its transfer to the first peer it pushes to.
"""

import contextlib
import gc
import itertools
import math

import torch
from overlap_pass import config
from overlap_pass.lowering import replay, symm
from overlap_pass.templates import gemm
from overlap_pass.templates import matmul_reduce_scatter as producer

KINDS = ("all_gather_matmul", "matmul_reduce_scatter")
DATA_BYTES = 64 << 20  # reserved up front on every rank: no workspace grows during a run
# polls per wait, in both rounds of a run (a fraction of a second): the limit is a constant of
# the kernels, so a round with another one would compile and load them anew
SPIN_LIMIT = 200_000
LATE_CYCLES = 2_000_000  # a late rank's sleep: about a millisecond of GPU clock, far inside SPIN_LIMIT
_WORLDS = itertools.count()  # group names unique in the process, so replay.py keys never meet


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
        self._peers_pushed: list[int] = []  # the peers this rank's call has transferred to, in order
        super().__init__(kind, world.group_names[rank], world.device, group=_Group(rank, world.size))

    def _rendezvous(self, nbytes: int):
        buffers = self.world.buffers(self.kind, nbytes)
        return buffers[self.rank], _Handle(buffers)

    def _host_barrier(self) -> None:  # the ranks reserve one after another, before any call
        pass

    def enter(self, data_bytes: int, spin_limit: int) -> None:
        self._peers_pushed = []
        super().enter(data_bytes, spin_limit)

    def peer_rows(self, peer: int, shape, dtype: torch.dtype, start: int, stop: int, offset: int = 0):
        """symm.Workspace's; every transfer into a peer (an all-gather's chunk copy, a
        reduce-scatter's partial copied or computed into its owner's slot) asks for the peer's
        rows right before it is queued, so a rank that is to be late at its n-th peer of the
        call (SimWorld.run's ``late``) sleeps here first, on the stream the transfer goes on."""
        if peer != self.rank and peer not in self._peers_pushed:
            if self.world.late == (self.rank, len(self._peers_pushed)):
                torch.cuda._sleep(LATE_CYCLES)
                self.world.delayed = True
            self._peers_pushed.append(peer)
        return super().peer_rows(peer, shape, dtype, start, stop, offset)


def forget_timeouts(workspaces) -> None:
    """Zeroes the timeout words of ``workspaces`` (device and host copies): waits that gave up
    in a round whose results are thrown away (a warm-up) are not reported later."""
    for ws in workspaces:
        ws.timeouts.zero_()
        ws._timeouts_host.zero_()
        ws._timeouts_copied = None
    torch.cuda.synchronize()


class SimWorld:
    def __init__(self, size: int, device: torch.device | None = None, data_bytes: int = DATA_BYTES):
        self.size = size
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        number = next(_WORLDS)
        self.group_names = [f"sim{size}.{number}.{rank}" for rank in range(size)]
        self.streams = [symm.new_stream(self.device) for _ in range(size)]
        self.late = None  # (rank, position) during a round with a late rank (run's ``late``)
        self.delayed = False  # whether the last round's late rank did sleep where asked
        self._buffers: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._workspaces = []
        for kind in KINDS:
            for rank in range(size):
                ws = _Workspace(kind, self, rank)
                symm._WORKSPACES[(kind, self.group_names[rank], self.device.index)] = ws
                self._workspaces.append(ws)
        for ws in self._workspaces:  # every rank zeroes its flags before any rank signals
            ws.reserve(data_bytes)
        # cuBLAS's first kernels on the capture stream load lazily, which may wait for the device
        # to be idle: done here, not in a rank's first capture while a peer's barrier spins
        replay.capture_stream(self.device)
        torch.cuda.synchronize(self.device)

    def buffers(self, kind: str, nbytes: int) -> list[torch.Tensor]:
        """Every rank's buffer of ``kind`` and size (made at the first rank's ask)."""
        key = (kind, nbytes)
        if key not in self._buffers:
            self._buffers[key] = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        return self._buffers[key]

    def workspace(self, kind: str, rank: int) -> symm.Workspace:
        return self._workspaces[KINDS.index(kind) * self.size + rank]

    @property
    def out_of_step(self) -> bool:
        """Whether a workspace of this world raised ChunkTimeout (it refuses calls from then on)."""
        return any(ws.out_of_step is not None for ws in self._workspaces)

    def run(self, call, warm_up: bool | int = True, prepare=None, absent=(), late=None) -> list:
        """``call(rank, group_name)`` for every rank, each queued on its rank's stream after
        the work queued so far; returns their results once the GPU is done, having checked that
        no wait gave up.

        First, unless told not to, a warm-up round (``warm_up`` rounds where it is a number) of
        every rank whose results and given-up waits are thrown away: the first launch of a kernel in a process loads it (CUDA's lazy
        loading), which may wait for the device to be idle, and one process has every rank's
        spinning kernels, while the rank whose work would end the spin is queued only after
        this one. ``prepare()`` runs between the two rounds (poisoning the workspaces, say).

        Faults, in the checked round only: ``absent`` ranks are not called (their results are
        None; their peers' waits give up). ``late`` = (rank, "barrier"): that rank's stream
        sleeps LATE_CYCLES before its call; (rank, n): before its transfer to the n-th peer it
        transfers to in the call (_Workspace.peer_rows; variants whose kernels store into peers
        themselves have none). ``self.delayed`` then tells whether the sleep was queued."""
        with config.patch(spin_limit=SPIN_LIMIT), self._sms_shared():
            return self._run(call, warm_up, prepare, set(absent), late)

    @contextlib.contextmanager
    def _sms_shared(self):
        """The producer's persistent launches take 1/W of the SMs each (module docstring)."""
        whole = producer.sm_count
        producer.sm_count = lambda device: max(1, gemm.sm_count(device) // self.size)
        try:
            yield
        finally:
            producer.sm_count = whole

    def _run(self, call, warm_up: bool, prepare, absent: set, late) -> list:
        for _ in range(int(warm_up)):
            self._queue(call, set(), None)
            torch.cuda.synchronize(self.device)
            forget_timeouts(self._workspaces)
        if prepare is not None:
            prepare()
        results = self._queue(call, absent, late)
        self.check()
        return results

    def _queue(self, call, absent: set, late) -> list:
        caller = torch.cuda.current_stream(self.device)
        results = []
        self.late, self.delayed = late, False
        try:
            for rank, stream in enumerate(self.streams):
                if rank in absent:
                    results.append(None)
                    continue
                stream.wait_stream(caller)
                with torch.cuda.stream(stream):
                    if late == (rank, "barrier"):
                        torch.cuda._sleep(LATE_CYCLES)
                        self.delayed = True
                    results.append(call(rank, self.group_names[rank]))
        finally:  # also when a call raises: nothing the caller queues next overtakes the ranks
            self.late = None
            for stream in self.streams:
                caller.wait_stream(stream)
        return results

    def check(self) -> None:
        """Synchronizes; raises one ChunkTimeout with every rank's message if a wait gave up
        since the workspaces' last check (a workspace that raised before refuses calls, so it
        is not asked again)."""
        torch.cuda.synchronize(self.device)
        messages = []
        for ws in self._workspaces:
            if ws.out_of_step is None:
                try:
                    ws.check_timeouts()
                except symm.ChunkTimeout as error:
                    messages.append(str(error))
        if messages:
            raise symm.ChunkTimeout("\n".join(messages))

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
