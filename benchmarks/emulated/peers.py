"""overlap's workspaces in the emulated world: rank 0's buffers, flags and protocol for real,
its peers' as plain device memory of this GPU that their emulation fills.

Rank 0's pushes land in its peers' buffers here (copy-engine copies or a producer's stores, at
this GPU's own speed); each peer's pushes to rank 0 are rank 0's mirrored (timeline.py): the
same bytes, copied by the copy engine on the emulation's stream from where rank 0 put them, and
flagged by pacing.py's kernels at the time the schedule gives. The emulation's stream forks
from the caller's at the barrier and joins it at the call's end, so a per-call CUDA graph
(replay.py) captures it with the rest and replays it.

What a kind's peers push, mirrored from rank 0's:
- a push rank 0's host queues (an all-gather's chunk, a reduce-scatter's partial through the
  copy engine or cuBLAS): the views of peer q that rank 0 wrote since its last signal to q,
  into rank 0's own rows shifted by s chunks (s the pushing peer), flagged at signal time;
- a push a kernel makes (the fused reduce-scatter producer's stores): each chunk's partial
  from rank 0's slot of its owner once rank 0's kernel flags it there, into slot s of rank 0's.
"""

import contextlib

import torch

from overlap_pass import config
from overlap_pass.lowering import symm
from overlap_pass.ops import schedule

from . import pacing, timeline

NS = 1000  # per µs


class _LocalPeers:
    """Stands for torch's _SymmetricMemory: every rank's buffer, on this GPU."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def get_buffer(self, peer: int, shape, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        words = self.buffers[peer].view(dtype)
        count = 1
        for size in shape:
            count *= size
        return words[storage_offset : storage_offset + count].view(shape)


class EmulatedWorkspace(symm.Workspace):
    """symm.Workspace with emulated peers (module docstring); ``params``: timeline.Parameters."""

    params: timeline.Parameters  # set by the world (emulated/__init__.py) before any is made

    def __init__(self, kind: str, group_name: str, device: torch.device, group=None):
        super().__init__(kind, group_name, device, group)
        self.emulation = symm.new_stream(device)
        self.clock = torch.zeros(pacing.CLOCK_WORDS, dtype=torch.int64, device=device)
        self.peer_epoch = torch.zeros(1, dtype=torch.int32, device=device)
        # a word per peer: a mirrored push whose data rank 0 never flagged (rank 0's call gave up)
        self.peer_timeouts = torch.zeros(self.world_size, dtype=torch.int32, device=device)
        self._fork_emulation, self._join_emulation = torch.cuda.Event(), torch.cuda.Event()
        self._push_queued = torch.cuda.Event()
        self._written: dict[int, list[tuple]] = {}  # peer -> views rank 0 wrote since its last signal
        self._data_bytes = 0
        self._kernel_pushes_mirrored = False

    # -- memory -----------------------------------------------------------------------------

    def _rendezvous(self, nbytes: int):
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        return buffers[self.rank], _LocalPeers(buffers)

    def _host_barrier(self) -> None:
        pass

    def _allocate(self, size: int) -> None:
        super()._allocate(size)
        self.peer_epoch.copy_(self.epoch)  # the peers' words start where rank 0's do

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
        self._data_bytes = data_bytes
        self._kernel_pushes_mirrored = False
        super().enter(data_bytes, spin_limit)

    def barrier(self, spin_limit: int) -> None:
        self._fork_emulation.record(self.main)
        self.emulation.wait_event(self._fork_emulation)
        pad = self._alloc.handle.get_buffer(self.rank, (self.world_size,), torch.int32, storage_offset=self.world_size)
        with self._on_emulation():
            pacing.PEERS_ENTER[(1,)](
                self.clock, self.peer_epoch, pad, self.world_size, int(self.params.barrier_us * NS), num_warps=1
            )
        super().barrier(spin_limit)

    def peer_rows(self, peer: int, shape, dtype: torch.dtype, start: int, stop: int, offset: int = 0) -> torch.Tensor:
        if peer != self.rank:
            self._written.setdefault(peer, []).append((tuple(shape), dtype, start, stop, offset))
        return super().peer_rows(peer, shape, dtype, start, stop, offset)

    def signal_peer(self, peer: int, late: bool = False) -> None:
        super().signal_peer(peer, late)
        sender = timeline.pushing_peer(peer, self.world_size)
        copies = []
        for shape, dtype, start, stop, offset in self._written.pop(peer, []):
            shift = sender * (stop - start)
            source = super().peer_rows(peer, shape, dtype, start, stop, offset)
            copies.append((source, super().peer_rows(self.rank, shape, dtype, start + shift, stop + shift, offset)))
        flag = self.peer_flag(self.rank, sender + (2 * self.world_size if late else 0))
        self._push_queued.record()  # on the stream that queued rank 0's push
        self.emulation.wait_event(self._push_queued)
        link_us = self.params.push.us(sum(s.numel() * s.element_size() for s, _ in copies))
        self._mirror(copies, flag, 1, 1, link_us, link_us, sender)

    def _mirror(self, copies, flag, count, stride, a_us, b_us, sender, waits_on=None) -> None:
        """On the emulation's stream: READY (once rank 0's words ``waits_on`` = (ptr tensor,
        count, stride) are set, if given; not at all for a push landing beside the last one,
        b_us = 0), the copies, then the landing (pacing.py)."""
        wait_ptr, wait_count, wait_stride = waits_on or (flag, 0, 1)
        with self._on_emulation():
            if waits_on is not None or b_us:
                pacing.READY_KERNEL[(1,)](
                    self.clock, wait_ptr, wait_count, wait_stride, self.epoch, self.peer_timeouts, sender,
                    SPIN_LIMIT=config.spin_limit, num_warps=1,
                )  # fmt: skip
            for source, target in copies:
                target.copy_(source)
            pacing.ARRIVE[(1,)](
                self.clock, flag, count, stride, self.peer_epoch, int(a_us * NS), int(b_us * NS), num_warps=1
            )  # fmt: skip

    def peer_flag_addresses(self) -> torch.Tensor:
        """A producer kernel is about to store into the peers: mirror its pushes (once a call)."""
        if not self._kernel_pushes_mirrored:
            self._kernel_pushes_mirrored = True
            self._mirror_kernel_pushes()
        return super().peer_flag_addresses()

    def _mirror_kernel_pushes(self) -> None:
        if self.kind != "matmul_reduce_scatter":
            raise NotImplementedError(f"the emulated world does not mirror {self.kind}'s kernel stores yet")
        world = self.world_size
        slot = self._data_bytes // (2 * world)  # recv: W slots of one partial, then staging
        self._fork_emulation.record(self.main)
        self.emulation.wait_event(self._fork_emulation)
        store_us = slot / (self.params.stores.gbps * 1e3)
        for owner in schedule.reduce_scatter_order(self.rank, world)[:-1]:
            sender = timeline.pushing_peer(owner, world)
            source = self.peer_data(owner, (slot,), torch.uint8, self.rank * slot)
            target = self.peer_data(self.rank, (slot,), torch.uint8, sender * slot)
            flag = self.peer_flag(self.rank, sender)
            waits_on = (self.peer_flag(owner, self.rank), 1, 1)
            self._mirror([(source, target)], flag, 1, 1, self.params.stores.latency_us, store_us, sender, waits_on)

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
        self._fork_emulation.record(torch.cuda.current_stream(self.device))
        self.emulation.wait_event(self._fork_emulation)
        landing_us = self.params.stores.us(slot)
        for sender in range(1, world):
            target = self.peer_data(self.rank, (slot,), torch.uint8, flag_bytes + sender * slot)
            waits_on = (flags[self.rank :], programs, world) if sender == 1 else None
            self._mirror([(own, target)], flags[sender:], programs, world, landing_us, 0.0, sender, waits_on)

    def leave(self) -> None:
        self._join_emulation.record(self.emulation)
        self.main.wait_event(self._join_emulation)
        super().leave()

    def check_timeouts(self) -> None:
        super().check_timeouts()
        late = self.peer_timeouts.nonzero().flatten().tolist()
        if late:
            raise symm.ChunkTimeout(
                f"{self.kind}: the emulated peers {late} of group {self.group_name} gave up waiting for "
                "rank 0's data of a push they mirror"
            )


class MirroredOneShot:
    """Stands for templates/all_reduce.ONE_SHOT: a launch of the one-shot all-reduce first
    queues its peers' mirrored stores (EmulatedWorkspace.mirror_one_shot), which its kernel
    waits for, then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(src, out, data_ptrs, epoch, *args, **meta):
            ws = next(w for w in symm._WORKSPACES.values() if w.epoch is epoch)
            ws.mirror_one_shot(grid[0], meta["FLAG_BYTES"])
            launch(src, out, data_ptrs, epoch, *args, **meta)

        return run
