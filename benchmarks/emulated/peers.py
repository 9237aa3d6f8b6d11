"""overlap's workspaces in the emulated world: rank 0's buffers, flags and protocol for real,
its peers' as plain device memory of this GPU.

Every peer is rank 0's mirror (timeline.py): what peer s pushes to rank 0 is what rank 0 pushes
to peer q = (W - s) % W at the same step, landing s chunks along in rank 0's own data. So rank
0's pushes are aimed there: a push rank 0 makes to peer q (a copy, a matmul or a producer
kernel's stores) writes rank 0's own rows where peer s's push would land, and pacing.py's
kernels raise peer s's flag at the time the schedule gives, after rank 0's write is done. Nothing
is copied twice, and no copy of the emulation's own takes the SMs that rank 0's kernels hold
(a same-GPU copy runs on SMs: with rank 0's persistent kernels holding all but one, a copy of
the emulation's crawled). What rank 0's data receives is what it would receive from real peers:
the same bytes, written once.

The one-shot all-reduce keeps its flags in its data, where a shifted write would land on them:
its peers' stores are copies of rank 0's own slot, made by the emulation (mirror_one_shot).
The emulation's stream forks from the caller's at the barrier and joins it at the call's end,
so a per-call CUDA graph (replay.py) captures it with the rest and replays it.
"""

import contextlib
import math

import torch

from overlap_pass import config
from overlap_pass.lowering import symm
from overlap_pass.ops import schedule

from . import pacing, timeline

def buffer_view(buffer: torch.Tensor, shape, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
    """A uint8 buffer's words of ``dtype`` from ``storage_offset`` on, as a ``shape`` tensor (what
    torch's _SymmetricMemory.get_buffer gives)."""
    return buffer.view(dtype)[storage_offset : storage_offset + math.prod(shape)].view(shape)


class _LocalPeers:
    """Stands for torch's _SymmetricMemory: every rank's buffer, on this GPU."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def get_buffer(self, peer: int, shape, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        return buffer_view(self.buffers[peer], shape, dtype, storage_offset)


class EmulatedWorkspace(symm.Workspace):
    """symm.Workspace with emulated peers (module docstring); ``params``: timeline.Parameters."""

    params: timeline.Parameters  # set by the world (emulated/__init__.py) before any is made

    def __init__(self, kind: str, group_name: str, device: torch.device, group=None):
        super().__init__(kind, group_name, device, group)
        self.emulation = symm.new_stream(device)
        # (kept for good, outside CUDA graph trees' pool, as the base class keeps its words)
        self.clock = symm._lasting([0] * pacing.CLOCK_WORDS, torch.int64, device)
        self.peer_epoch = symm._lasting([0], torch.int32, device)
        # a word per peer: a mirrored push whose data rank 0 never flagged (rank 0's call gave up)
        self.peer_timeouts = symm._lasting([0] * self.world_size, torch.int32, device)
        self._fork_emulation, self._join_emulation = torch.cuda.Event(), torch.cuda.Event()
        # a push's start (rank 0's copy queued) and end (its data in rank 0's rows)
        self._push_started, self._push_queued = torch.cuda.Event(), torch.cuda.Event()
        self._started: set[int] = set()  # the peers whose push's start was recorded
        self._written: dict[int, int] = {}  # peer -> bytes rank 0 pushed to it since its last signal
        self._data_bytes = 0

    # -- memory -----------------------------------------------------------------------------

    def _rendezvous(self, nbytes: int):
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        return buffers[self.rank], _LocalPeers(buffers)

    def _host_barrier(self) -> None:
        pass

    def _allocate(self, size: int) -> None:
        super()._allocate(size)
        # the peers' words start where rank 0's do: their control words, the flags of a kind
        # that keeps some in its data, and the epoch they advance
        world = self.world_size
        words = (symm.CONTROL_BYTES + symm._FLAGS_IN_DATA.get(self.kind, lambda w: 0)(world)) // 4
        for peer in range(world):
            if peer != self.rank:
                self._alloc.handle.get_buffer(peer, (words,), torch.int32).copy_(self.epoch.expand(words))
        self.peer_epoch.copy_(self.epoch)

    # -- the protocol, with the peers' side queued beside it ------------------------------------

    @contextlib.contextmanager
    def _on_emulation(self):
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(self.emulation)
        try:
            yield
        finally:
            torch.cuda.set_stream(caller)

    def enter(self, data_bytes: int, spin_limit: int) -> None:
        self._written.clear()
        self._started.clear()
        self._data_bytes = data_bytes
        super().enter(data_bytes, spin_limit)

    def barrier(self, spin_limit: int) -> None:
        self._raise_on_earlier_timeouts()  # (before the peers enter: a refused call moves nobody)
        self._fork_emulation.record(self.main)
        self.emulation.wait_event(self._fork_emulation)
        pad = self._alloc.handle.get_buffer(self.rank, (self.world_size,), torch.int32, storage_offset=self.world_size)
        with self._on_emulation():
            pacing.PEERS_ENTER[(1,)](
                self.clock, self.peer_epoch, pad, self.world_size, pacing.ns(self.params.barrier_us), num_warps=1
            )
        super().barrier(spin_limit)

    def peer_rows(self, peer: int, shape, dtype: torch.dtype, start: int, stop: int, offset: int = 0) -> torch.Tensor:
        """A push to ``peer``: rank 0's own rows where the mirrored peer's push lands (module
        docstring)."""
        if peer == self.rank:
            return super().peer_rows(peer, shape, dtype, start, stop, offset)
        stream = torch.cuda.current_stream(self.device)
        if peer not in self._written and stream == self.side_stream:
            # a copy-engine push: its data was ready when rank 0's copy of it was queued (a
            # matmul writing into a peer's rows, on the caller's stream, is ready at its signal)
            self._push_started.record(stream)
            self._started.add(peer)
        landing = timeline.landing_rows(peer, self.world_size, start, stop)
        rows = super().peer_rows(self.rank, shape, dtype, *landing, offset)
        self._written[peer] = self._written.get(peer, 0) + rows.numel() * rows.element_size()
        return rows

    def _producer_slot(self) -> tuple[int, bool]:
        """The call's reduce-scatter slot in bytes (its data: W slots of one partial, then
        staging), and whether a producer's stores into the peers are aimed at rank 0's slots: not
        for the one-shot all-reduce (flags in its data) nor for slots whose bytes are no multiple
        of 16 (the kernel's stores assume the alignment)."""
        slot = self._data_bytes // (2 * self.world_size)
        return slot, self.kind not in symm._FLAGS_IN_DATA and slot % 16 == 0

    def peer_data_addresses(self) -> torch.Tensor:
        """The producer kernel's peers (templates/matmul_reduce_scatter.py): the data of owner q
        starts, for rank 0's stores, where rank 0's slot of the pushing peer starts less rank 0's
        own slot, so a partial stored into q lands in that slot of rank 0. One table per slot
        size (the call's); the peers' own data where the stores are not aimed (_producer_slot),
        which mirror_producer then copies."""
        slot, aimed = self._producer_slot()
        if not aimed:
            return super().peer_data_addresses()
        table = self._tables.get(("landing", slot))
        if table is None:
            own = self.data((1,), torch.uint8).data_ptr()
            ptrs = [own + timeline.pushing_peer(q, self.world_size) * slot for q in range(self.world_size)]
            table = self._tables[("landing", slot)] = symm._lasting(ptrs, torch.int64, self.device)
        return table

    def signal_peer(self, peer: int, late: bool = False) -> None:
        super().signal_peer(peer, late)
        sender = timeline.pushing_peer(peer, self.world_size)
        flag = self.peer_flag(self.rank, sender + (2 * self.world_size if late else 0))
        started = peer in self._started
        self._started.discard(peer)
        # the push's data in rank 0's rows: rank 0's copies (or matmul) queued so far
        self._push_queued.record(torch.cuda.current_stream(self.device))
        self.emulation.wait_event(self._push_started if started else self._push_queued)
        link_us = self.params.push.us(self._written.pop(peer, 0))
        self._mirror([], flag, 1, 1, link_us, link_us, sender, before_copies=self._push_queued if started else None)

    def _mirror(self, copies, flag, count, stride, a_us, b_us, sender, waits_on=None, before_copies=None) -> None:
        """On the emulation's stream: READY (once rank 0's words ``waits_on`` = (ptr tensor,
        count, stride) are set, if given; not at all for a push landing beside the last one,
        b_us = 0), the copies (after the event ``before_copies``, if given: rank 0's own copy
        of their source), then the landing (pacing.py)."""
        wait_ptr, wait_count, wait_stride = waits_on or (flag, 0, 1)
        with self._on_emulation():
            if waits_on is not None or b_us:
                pacing.READY_KERNEL[(1,)](
                    self.clock, wait_ptr, wait_count, wait_stride, self.epoch, self.peer_timeouts, sender,
                    config.spin_limit, num_warps=1,
                )  # fmt: skip
            if before_copies is not None:
                self.emulation.wait_event(before_copies)
            for source, target in copies:
                target.copy_(source)
            pacing.ARRIVE[(1,)](
                self.clock, flag, count, stride, self.peer_epoch, pacing.ns(a_us), pacing.ns(b_us), num_warps=1
            )  # fmt: skip

    def fork_emulation(self) -> None:
        """The emulation's stream from here on comes after the work queued so far on the
        current stream (and not after what comes next: a kernel that waits for the peers)."""
        self._fork_emulation.record(torch.cuda.current_stream(self.device))
        self.emulation.wait_event(self._fork_emulation)

    def mirror_producer(self) -> None:
        """The fused reduce-scatter producer's stores (templates/matmul_reduce_scatter.py), once
        it has launched: each partial rank 0's kernel flags in its owner, in the mirrored
        sender's slot of rank 0 (peer_data_addresses; or copied there from the owner's data),
        flagged at the landing time."""
        world = self.world_size
        slot, aimed = self._producer_slot()
        store_us = slot / (self.params.stores.gbps * 1e3)
        for owner in schedule.reduce_scatter_order(self.rank, world)[:-1]:
            sender = timeline.pushing_peer(owner, world)
            copies = []
            if not aimed:
                source = self.peer_data(owner, (slot,), torch.uint8, self.rank * slot)
                copies.append((source, self.peer_data(self.rank, (slot,), torch.uint8, sender * slot)))
            flag, waits_on = self.peer_flag(self.rank, sender), (self.peer_flag(owner, self.rank), 1, 1)
            self._mirror(copies, flag, 1, 1, self.params.stores.latency_us, store_us, sender, waits_on)

    def mirror_one_shot(self, programs: int, flag_bytes: int) -> None:
        """The one-shot all-reduce's stores (templates/all_reduce.py), every peer's at once:
        once each of rank 0's ``programs`` programs has stored its elements into rank 0's own
        slot and flagged them, that slot is copied into every peer's slot of rank 0's data,
        and each peer's flags of every program land the stores' latency and the slot's bytes
        after (the peers' links run side by side)."""
        world = self.world_size
        slot = (self._data_bytes - flag_bytes) // world
        flags = self.peer_data(self.rank, (programs * world,), torch.int32)  # [program][rank]
        own = self.peer_data(self.rank, (slot,), torch.uint8, flag_bytes)
        landing_us = self.params.stores.us(slot)
        for sender in range(1, world):
            target = self.peer_data(self.rank, (slot,), torch.uint8, flag_bytes + sender * slot)
            waits_on = (flags[self.rank :], programs, world) if sender == 1 else None
            self._mirror([(own, target)], flags[sender:], programs, world, landing_us, 0.0, sender, waits_on)

    def leave(self) -> None:
        self._join_emulation.record(self.emulation)
        self.main.wait_event(self._join_emulation)
        super().leave()

    def _describe_timeouts(self, timeouts: torch.Tensor) -> None:
        try:
            super()._describe_timeouts(timeouts)
        except symm.ChunkTimeout as error:
            raise symm.ChunkTimeout(f"{error} [{self.emulation_state()}]") from None

    def emulation_state(self) -> str:
        """What the peers' emulation had done when a wait gave up: the epochs, the clock, rank
        0's flags (the peers' words for it) and rank 0's words at each peer."""
        torch.cuda.synchronize(self.device)
        enter, ready, landed = self.clock.tolist()
        words = [self.peer_flag(p, 0, 3 * self.world_size).tolist() for p in range(self.world_size)]
        return (
            f"emulation: epoch {self.epoch.item()}, peers' epoch {self.peer_epoch.item()}, "
            f"READY {(ready - enter) / 1e3:.1f} us and LANDED {(landed - enter) / 1e3:.1f} us after ENTER, "
            f"peers' timeouts {self.peer_timeouts.tolist()}, control words (flags, pads, late flags) of "
            + ", ".join(f"rank {p} {w}" for p, w in enumerate(words))
        )

    def check_timeouts(self) -> None:
        super().check_timeouts()
        late = self.peer_timeouts.nonzero().flatten().tolist()
        if late:
            self.peer_timeouts.zero_()
            error = (
                f"{self.kind}: the emulated peers {late} of group {self.group_name} gave up waiting for "
                "rank 0's data of a push they mirror"
            )
            self.out_of_step = self.out_of_step or error  # (as a wait of rank 0's that gave up)
            raise symm.ChunkTimeout(error)


def _workspace_of(args, kwargs) -> EmulatedWorkspace | None:
    """The emulated workspace whose epoch a kernel launch takes among its arguments; None for a
    launch on another's (the simulated ranks' of tests/sim_world.py, whose peers are real)."""
    epochs = {id(ws.epoch): ws for ws in symm._WORKSPACES.values() if isinstance(ws, EmulatedWorkspace)}
    return next((epochs[id(a)] for a in (*args, *kwargs.values()) if id(a) in epochs), None)


class MirroredProducer:
    """Stands for templates/matmul_reduce_scatter.matmul_reduce_scatter_producer: the
    emulation's stream forks before the launch, and the peers' mirrored stores, which the
    kernel's own sum waits for, are queued once it has launched (a launch that raises leaves
    nothing waiting)."""

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, *args, **kwargs):
        ws = _workspace_of(args, kwargs)
        if ws is None:
            return self.launch(*args, **kwargs)
        ws.fork_emulation()
        out = self.launch(*args, **kwargs)
        ws.mirror_producer()
        return out


class MirroredOneShot:
    """Stands for templates/all_reduce.ONE_SHOT, as MirroredProducer does for the producer."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **meta):
            ws = _workspace_of(args, meta)
            if ws is None:
                return launch(*args, **meta)
            ws.fork_emulation()
            launch(*args, **meta)
            ws.mirror_one_shot(grid[0], meta["FLAG_BYTES"])

        return run
