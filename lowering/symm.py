"""The symmetric-memory workspace of one op kind on one group and device.

One symmetric allocation per workspace, the same size on every rank:

    [ flags: W int32 | pads: W int32 | late flags: W int32 | ... control, CONTROL_BYTES ][ data ... ]

- data: where peers push their chunks (all-gather) or their partials of this rank's chunk
  (reduce-scatter, which also stages its outgoing partials there); grown only when a call needs
  more, rounded up to a power of two, always on every rank in the same call.
- flags[p]: rank p's progress word for its chunk in this rank's data, written by p.
- pads[p]: rank p's barrier word, written by p's barrier kernel.
- late_flags[p]: rank p's second progress word, for data it pushes after its chunks (an
  all-gather's passengers, lowering/all_gather_matmul.py), so that they do not hold up the flag
  the consumer waits on.
- epoch: this rank's call counter, a one-word device tensor. The barrier kernel advances it at
  the start of each call and every flag and pad is written with it, so values only grow: nothing
  is reset between calls and a CUDA-graph replay advances them exactly as an eager call does.

Protocol of one call, on the caller's stream unless said otherwise:
1. barrier: epoch += 1; wait until every rank reached the same epoch. Every rank's previous call
   has then finished, so nobody still reads the data a peer is about to overwrite (entry and
   exit handshake in one, since each call ends by joining its side stream).
2. side stream (copy engine, no SMs): chunk copies into peers' data, each followed by a 4-byte
   copy of the epoch into the peer's flag, in stream order after the data (or a kernel stores
   into peers' data and release-writes their flags itself).
3. the consumer (a GEMM, or the owner's reduction) waits per chunk on its flags, with acquire
   loads; then the caller's stream joins the side stream.

Every wait is bounded. A wait that gives up writes the call's epoch into a device ``timeouts``
word of the rank or chunk it missed; the host reads those words every CHECK_EVERY calls without
a sync and raises ChunkTimeout at a later call, or at once through ``check_timeouts``. From then
on the workspace refuses every call with a ChunkTimeout (refuse_if_out_of_step): a rank that
missed a call stays an epoch behind its peers for good.
"""

import collections
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import threading

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.templates import all_reduce as all_reduce_kernel
from overlap_pass.templates import signals
from overlap_pass.templates.all_gather_matmul import ChunkTimeout

from overlap_pass import torch_compat

log = logging.getLogger("overlap_pass")

CONTROL_BYTES = 4096  # flags, pads and late flags, padded so that data starts 4 KiB-aligned
MIN_DATA_BYTES = 1 << 20
CHECK_EVERY = 16  # calls between two host reads of the timeout words
VIEWS_KEPT = 4096  # views of the allocation kept for reuse (_cached_view)
# kinds whose data region starts with a block of flags of their own (bytes, per world size),
# which an allocation sets to the epoch as it does the control words
_FLAGS_IN_DATA = {"all_reduce": all_reduce_kernel.flag_bytes}


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _lasting(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor holding ``values`` (a flat list) that a workspace keeps for good, made by
    the symmetric-memory allocator rather than the caching allocator: a workspace is often made
    during the first call of a compiled model, which CUDA graph trees run inside their graphs'
    memory pool and then require to leave nothing of its own alive there."""
    tensor = torch_compat.symmetric_empty(len(values), dtype=dtype, device=device)
    tensor.copy_(torch.tensor(values, dtype=dtype))
    return tensor


_SETUP_STREAMS: dict[int, torch.cuda.Stream] = {}
CUDA_ERROR_INVALID_CONTEXT = 201
_GENERATIONS = itertools.count(1)


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream no other code holds. torch.cuda.Stream() hands out a pool's 32 streams per
    device in turn, so two holders can share one: a side stream could be the very stream it is
    meant to run beside (CUDA graph trees run on a pool stream), and a setup stream the one graph
    trees warm a model up on. Falls back to the pool where the driver cannot be reached."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return torch.cuda.Stream(device=device)
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):  # makes the device's primary context current here
        status = libcuda.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1))  # non-blocking
        if status == CUDA_ERROR_INVALID_CONTEXT:  # nothing has run on the device yet
            torch.zeros((), device=device)
            status = libcuda.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1))
    if status != 0:
        log.warning("overlap: cuStreamCreate failed (%d); using a stream of torch's pool", status)
        return torch.cuda.Stream(device=device)
    return torch.cuda.ExternalStream(handle.value, device=device)


_SETUP_THREAD = "overlap-setup"


def _graph_trees_may_route(device: torch.device) -> bool:
    """Whether CUDA graph trees may be routing this thread's allocations to their pool now
    (warming a model up); where their internals moved, assumed so."""
    try:
        return torch_compat.graph_trees_warming_up(device.index)
    except Exception:
        return True


def outside_graph_pool(device: torch.device, setup, *args):
    """``setup(*args)`` (a rendezvous, a first call's measurements) on a thread and a stream of
    its own, after the caller's queued work and before its next. CUDA graph trees warm a
    compiled model up with every allocation of the calling thread routed to their private pool,
    and then require that nothing but the model's outputs stays alive there; a rendezvous keeps
    device arrays of peer addresses, and NCCL's barrier a tensor, so they must come from the
    default pool, which another thread allocates from. Elsewhere it runs in place, on the
    caller's stream: the blocks a measurement frees there serve the model's next allocations
    (a setup stream's blocks never would: they stay reserved for that stream, a GiB or more in a
    training step at 8B sizes)."""
    if (
        getattr(device, "type", None) != "cuda"
        or threading.current_thread().name == _SETUP_THREAD
        or not _graph_trees_may_route(device)
    ):
        return setup(*args)
    caller = torch.cuda.current_stream(device)
    outcome = {}

    def run():
        try:
            torch.cuda.set_device(device)
            stream = _SETUP_STREAMS.get(device.index)
            if stream is None:
                stream = _SETUP_STREAMS[device.index] = new_stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream), torch.no_grad():
                outcome["value"] = setup(*args)
            caller.wait_stream(stream)
        except BaseException as error:  # raised again on the caller's thread
            outcome["error"] = error

    # in a copy of the caller's context: from torch 2.13 on, config modules (overlap's knobs,
    # Inductor's) keep what code sets in context variables, which a new thread sees unset
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name=_SETUP_THREAD)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclasses.dataclass
class _Allocation:
    buffer: torch.Tensor  # uint8, symmetric; kept alive here, addressed through handle
    handle: object  # torch's _SymmetricMemory
    data_bytes: int
    pad_ptrs: torch.Tensor  # int64 device addresses of each rank's pads


class Workspace:
    """Buffers, flags, pads and epoch of one (op kind, group, device)."""

    def __init__(self, kind: str, group_name: str, device: torch.device, group=None):
        """``group``: the process group named ``group_name`` (looked up when not given), or an
        object with its rank() and size() where a subclass supplies the memory
        (tests/sim_world.py)."""
        self.kind, self.group_name, self.device = kind, group_name, device
        self.group = group if group is not None else torch_compat.resolve_process_group(group_name)
        self.rank, self.world_size = self.group.rank(), self.group.size()
        self.side_stream = new_stream(device)
        world = self.world_size
        # epoch; barrier (one word per rank) and consumer (one per chunk) timeouts, see
        # check_timeouts; per-chunk tile counters of the reduce-scatter producer (it leaves
        # them zero). One lasting allocation (_lasting), sliced.
        words = _lasting([0] * (1 + 3 * world), torch.int32, device)
        self.epoch = words[:1]
        self.timeouts = words[1 : 1 + 2 * world].view(2, world)
        self.barrier_timeouts, self.chunk_timeouts = self.timeouts[0], self.timeouts[1]
        self.counters = words[1 + 2 * world :]
        self._timeouts_host = torch.zeros(2, world, dtype=torch.int32).pin_memory()
        self._timeouts_copied: torch.cuda.Event | None = None
        self._alloc: _Allocation | None = None
        # which allocation: a CUDA graph of a call holds one's addresses (replay.py); unique in
        # the process, so that a workspace made again for a group never matches older graphs
        self.generation = next(_GENERATIONS)
        # the first per-call CUDA graph (replay.py): its memory pool serves them all
        self.first_graph: torch.cuda.CUDAGraph | None = None
        # allocations outgrown, kept: a captured CUDA graph may still hold their addresses
        self._retired: list[_Allocation] = []
        self._views: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()  # _cached_view
        self._tables: dict[str, torch.Tensor] = {}  # device tables of peer addresses (_lasting)
        self._calls = 0
        # the first ChunkTimeout this workspace raised: its ranks' epochs may differ from then on
        # (a rank that missed a call stays one behind), so it takes no more calls (refuse_if_out_of_step)
        self.out_of_step: str | None = None
        self.main = torch.cuda.current_stream(device)  # the caller's stream, per call (enter)
        self._forked = False  # whether the call in progress queued work on the side stream
        # reused every call: waiting on an event takes its state when the wait is queued
        self._fork_event, self._join_event = torch.cuda.Event(), torch.cuda.Event()
        # one per chunk, "chunk j's data is ready": a reduce-scatter's partial (recorded on the
        # caller's stream), an all-gather's own chunk copied into the data (on the side stream)
        self.chunk_ready = [torch.cuda.Event() for _ in range(self.world_size)]

    # -- allocation ---------------------------------------------------------------------------

    def reserve(self, data_bytes: int) -> None:
        """Makes the data region at least ``data_bytes`` long. Collective: every rank must ask
        for the same size in the same call (shapes are identical across ranks)."""
        if self._alloc is not None and self._alloc.data_bytes >= data_bytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"overlap: the {self.kind} workspace of group {self.group_name} needs "
                f"{data_bytes} bytes while a CUDA graph is being captured; run the model once "
                "before capturing (torch.compile's reduce-overhead mode does) so it is allocated"
            )
        size = next_power_of_two(max(data_bytes, MIN_DATA_BYTES))
        limit = config.workspace_limit_mib
        if limit and size > limit << 20:  # refused before any collective
            raise NotImplementedError(
                f"the {self.kind} workspace would take {size >> 20} MiB, over "
                f"config.workspace_limit_mib ({limit})"
            )
        if self._alloc is not None:
            self._retired.append(self._alloc)
        self._alloc = None
        self._views.clear()
        self._tables.clear()
        outside_graph_pool(self.device, self._allocate, size)

    def _rendezvous(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """A symmetric allocation of ``nbytes`` on every rank (collective): this rank's buffer,
        and the handle that maps every rank's."""
        buffer = torch_compat.symmetric_empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer, torch_compat.rendezvous(buffer, self.group_name)

    def _host_barrier(self) -> None:
        dist.barrier(group=self.group, device_ids=[self.device.index])

    def _allocate(self, size: int) -> None:
        buffer, handle = self._rendezvous(CONTROL_BYTES + size)
        # every address, this rank's own included, comes from get_buffer, so that all ranks
        # agree on where each word is whatever offset the allocation has inside its pool
        world = self.world_size
        # flags and pads start at the current epoch, not 0: the epoch is never reset (a graph
        # captured before this growth keeps counting from it) and comparisons are wrap-safe
        # only between values less than 2**31 apart
        handle.get_buffer(self.rank, (CONTROL_BYTES,), torch.uint8).zero_()
        handle.get_buffer(self.rank, (3 * world,), torch.int32).copy_(self.epoch.expand(3 * world))
        flag_words = _FLAGS_IN_DATA.get(self.kind, lambda world: 0)(world) // 4
        if flag_words:
            words = handle.get_buffer(self.rank, (flag_words,), torch.int32, storage_offset=CONTROL_BYTES // 4)
            words.copy_(self.epoch.expand(flag_words))
        pad_ptrs = _lasting(
            [handle.get_buffer(p, (world,), torch.int32, storage_offset=world).data_ptr() for p in range(world)],
            torch.int64,
            self.device,
        )
        self._alloc = _Allocation(buffer, handle, size, pad_ptrs)
        self.generation = next(_GENERATIONS)
        # nobody may signal into a peer's control words before that peer has zeroed them
        torch.cuda.synchronize(self.device)
        self._host_barrier()
        log.info(
            "%s workspace of group %s: %d MiB on rank %d",
            self.kind, self.group_name, size >> 20, self.rank,
        )  # fmt: skip

    # -- views ----------------------------------------------------------------------------------

    @property
    def flags(self) -> torch.Tensor:
        """This rank's flags: flags[p] is rank p's progress word."""
        return self.peer_flag(self.rank, 0, self.world_size)

    @property
    def late_flags(self) -> torch.Tensor:
        """This rank's late flags: late_flags[p] is rank p's word for what it pushed last."""
        return self.peer_flag(self.rank, 2 * self.world_size, self.world_size)

    def data(self, shape, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """This rank's data region from byte ``offset`` on (a multiple of the dtype's size),
        viewed as a contiguous ``shape`` tensor of ``dtype``."""
        return self.peer_data(self.rank, shape, dtype, offset)

    def peer_data(self, peer: int, shape, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """Rank ``peer``'s data region as a tensor this rank can copy into (a peer mapping)."""
        return self._view(peer, tuple(shape), dtype, (CONTROL_BYTES + offset) // dtype.itemsize)

    def peer_rows(self, peer: int, shape, dtype: torch.dtype, start: int, stop: int, offset: int = 0) -> torch.Tensor:
        """Rows start:stop of ``peer_data(peer, shape, dtype, offset)`` (cached: built once per
        shape)."""
        key = ("rows", peer, tuple(shape), dtype, start, stop, offset)
        return self._cached_view(key, lambda: self.peer_data(peer, shape, dtype, offset)[start:stop])

    def peer_flag(self, peer: int, slot: int, count: int = 1) -> torch.Tensor:
        """Words ``slot`` to ``slot + count`` of rank ``peer``'s flags (int32)."""
        return self._view(peer, (count,), torch.int32, slot)

    def peer_data_addresses(self) -> torch.Tensor:
        """int64 device tensor: the start of every rank's data region as this rank addresses
        it, for kernels that store straight into peers. One table per allocation, whatever the
        shapes of the calls (a table per shape would take a symmetric allocation, 2 MiB, at
        every token count of a dynamic-shape model)."""
        table = self._tables.get("data_ptrs")
        if table is None:
            ptrs = [self.peer_data(p, (1,), torch.uint8).data_ptr() for p in range(self.world_size)]
            if any(ptr % 16 for ptr in ptrs):  # the producer's stores assume it (vector width)
                raise RuntimeError(f"overlap: peer data regions of group {self.group_name} are not 16-byte aligned")
            table = self._tables["data_ptrs"] = _lasting(ptrs, torch.int64, self.device)
        return table

    def peer_flag_addresses(self) -> torch.Tensor:
        """int64 device tensor: the address of flags[rank] of every rank, where this rank
        signals each of them."""
        table = self._tables.get("flag_ptrs")
        if table is None:
            ptrs = [self.peer_flag(p, self.rank).data_ptr() for p in range(self.world_size)]
            table = self._tables["flag_ptrs"] = _lasting(ptrs, torch.int64, self.device)
        return table

    def _view(self, peer: int, shape: tuple, dtype: torch.dtype, offset: int) -> torch.Tensor:
        make = lambda: self._alloc.handle.get_buffer(peer, shape, dtype, storage_offset=offset)  # noqa: E731
        return self._cached_view((peer, shape, dtype, offset), make)

    def _cached_view(self, key: tuple, make) -> torch.Tensor:
        """A view of the allocation, made once per key (host time); the VIEWS_KEPT most
        recently used are kept (every token count of a dynamic-shape model has views of its
        own). Dropping one frees nothing on the device."""
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = make()
            if len(self._views) > VIEWS_KEPT:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return view

    # -- protocol steps ---------------------------------------------------------------------------

    def enter(self, data_bytes: int, spin_limit: int) -> None:
        """A call's start: reserve ``data_bytes`` (collective), then step 1, the barrier. The
        caller's stream is looked up once here (each lookup costs host time on the critical path)."""
        self.refuse_if_out_of_step()
        self.main = torch.cuda.current_stream(self.device)
        self.reserve(data_bytes)
        self.barrier(spin_limit)

    def fork(self) -> None:
        """Side-stream work queued from now on comes after everything queued so far on the
        caller's stream (and a CUDA-graph capture takes the side stream in from here)."""
        self._fork_event.record(self.main)
        self.side_stream.wait_event(self._fork_event)
        self._forked = True

    @contextlib.contextmanager
    def on_side_stream(self):
        """Work queued inside runs on the side stream (cheaper than torch.cuda.stream)."""
        torch.cuda.set_stream(self.side_stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(self.main)

    def leave(self) -> None:
        """A call's end, also on error paths: the caller's stream joins the side stream if the
        call used it (joining a stream a capture never forked would invalidate the capture), so
        the next call's barrier comes after every copy of this one; then the timeout check."""
        if self._forked:
            self._join_event.record(self.side_stream)
            self.main.wait_event(self._join_event)
            self._forked = False
        self.finish()

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """A whole call replayed from a CUDA graph of it (replay.py), with the host steps that a
        graph cannot hold: the timeout checks of enter and leave."""
        self.refuse_if_out_of_step()
        self._raise_on_earlier_timeouts()
        graph.replay()
        self.finish()

    def barrier(self, spin_limit: int) -> None:
        """Step 1: advance the epoch and wait until every rank has reached it."""
        self._raise_on_earlier_timeouts()
        block = max(next_power_of_two(self.world_size), 2)
        signals.BARRIER[(1,)](
            self._alloc.pad_ptrs, self.epoch, self.barrier_timeouts, self.rank, self.world_size,
            SPIN_LIMIT=spin_limit, BLOCK_W=block, num_warps=1,
        )  # fmt: skip

    def signal_peer(self, peer: int, late: bool = False) -> None:
        """On the side stream, after a chunk's data copy: flags[rank] of ``peer`` (or its
        late_flags[rank]) = epoch. A copy-engine write queued after the data, so the peer sees
        the data once it sees the flag."""
        self.peer_flag(peer, self.rank + (2 * self.world_size if late else 0)).copy_(self.epoch)

    def finish(self) -> None:
        """After the consumer, every CHECK_EVERY calls: queue a copy of the timeout words to the
        host (no sync), so that a later call raises on a wait that gave up."""
        self._calls += 1
        if self._calls % CHECK_EVERY and self._calls > 1:
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self._timeouts_host.copy_(self.timeouts, non_blocking=True)
        self._timeouts_copied = torch.cuda.Event()
        self._timeouts_copied.record()

    def _raise_on_earlier_timeouts(self) -> None:
        event = self._timeouts_copied
        if event is None or torch.cuda.is_current_stream_capturing() or not event.query():
            return
        self._timeouts_copied = None
        self._describe_timeouts(self._timeouts_host)

    def check_timeouts(self) -> None:
        """Synchronizes, then raises ChunkTimeout if any wait of any call so far gave up."""
        torch.cuda.synchronize(self.device)
        self._describe_timeouts(self.timeouts.cpu())

    def _describe_timeouts(self, timeouts: torch.Tensor) -> None:
        try:
            describe_timeouts(timeouts, self.rank, self.kind)
        except ChunkTimeout as error:
            self.out_of_step = self.out_of_step or str(error)
            raise

    def refuse_if_out_of_step(self) -> None:
        """Raises ChunkTimeout once this workspace has raised one: a wait that gave up may mean a
        rank missed the call, and its epoch then stays behind its peers' for good, so that later
        calls would give up again on the ranks ahead and read a peer's data of another call on
        the rank behind. Refused at once, before the barrier: no spin, nothing queued."""
        if self.out_of_step is not None:
            raise ChunkTimeout(
                f"{self.kind}: rank {self.rank} refuses calls on group {self.group_name}: an earlier "
                f"call gave up waiting ({self.out_of_step}) and its ranks may be out of step since; "
                "use a new process group (or a new process) to go on."
            )


# what a rank waits for per peer, in each kind's words
_WAITED_FOR = {
    "all_gather_matmul": "the flags of chunks",
    "matmul_reduce_scatter": "the partials of ranks",
    "all_reduce": "the elements of ranks",
}


def describe_timeouts(timeouts: torch.Tensor, rank: int, kind: str) -> None:
    """Raises ChunkTimeout naming the ranks (barrier) and chunks or partials given up on."""
    late_ranks = timeouts[0].nonzero().flatten().tolist()
    late_chunks = timeouts[1].nonzero().flatten().tolist()
    if late_ranks or late_chunks:
        raise ChunkTimeout(
            f"{kind}: rank {rank} gave up waiting"
            + (f" at the barrier for ranks {late_ranks}" if late_ranks else "")
            + (" and" if late_ranks and late_chunks else "")
            + (f" for {_WAITED_FOR.get(kind, 'chunks')} {late_chunks}" if late_chunks else "")
            + "; results of that call are wrong. A peer is late or gone (or spin_limit is too low)."
        )


_WORKSPACES: dict[tuple[str, str, int], Workspace] = {}


def workspace(kind: str, group_name: str, device: torch.device) -> Workspace:
    """The workspace of ``kind`` ops on a group and device. Different kinds never share one,
    so an all-gather and a reduce-scatter in flight on one group do not alias."""
    key = (kind, group_name, device.index)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = Workspace(kind, group_name, device)
    return _WORKSPACES[key]


def bytes_held() -> dict[str, int]:
    """Device bytes the workspaces of this process hold in symmetric memory: "in use" (each
    workspace's current allocation) and "retired" (allocations a workspace grew out of, kept
    since graphs captured before the growth may still address them)."""
    held = {"in use": 0, "retired": 0}
    for ws in _WORKSPACES.values():
        if ws._alloc is not None:
            held["in use"] += CONTROL_BYTES + ws._alloc.data_bytes
        held["retired"] += sum(CONTROL_BYTES + a.data_bytes for a in ws._retired)
    return held


def check_all_timeouts(taking_calls_only: bool = False) -> None:
    """Raises ChunkTimeout if any wait of any workspace gave up so far (synchronizes); with
    ``taking_calls_only``, of a workspace that does not refuse calls yet (the others' error was
    raised when they began refusing)."""
    for ws in _WORKSPACES.values():
        if not (taking_calls_only and ws.out_of_step is not None):
            ws.check_timeouts()
