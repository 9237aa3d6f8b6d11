"""PyTorch's async TP (torch.ops.symm_mem.fused_*) in the emulated world: its own Python
pipelines run for real on rank 0, against a symmetric-memory handle whose peers are emulated.

Those pipelines (torch/distributed/_symmetric_memory/__init__.py, torch 2.11 to 2.15) take
their handle from the module's ``get_symm_mem_workspace`` at every call and use only its rank,
world_size, get_buffer and barrier; a peer's memory is read only by the pulls, ``copy_`` from a
peer's buffer. So the handle here:
- gives rank 0's own buffer for every peer's: every peer is rank 0's mirror (timeline.py), and a
  peer's buffer holds at each step what rank 0's holds then (an all-gather's shard; at a
  reduce-scatter's step s, rank 0's partial of chunk s, which is the partial of rank 0's chunk
  that peer -s pulled from its own buffer);
- paces every pull at the link's time for its bytes (timeline.Parameters.push), on the stream
  the pipeline made current for it;
- holds the stream ``barrier_us`` at a call's first barrier, where the mirrored peers arrive,
  and ``signal_us`` at the later ones, which they reach in step.
The native path (one CUTLASS kernel, behind an environment setting) and the multicast one are
left off: the first would need the handle's rendezvous, the second NVLink multicast.
"""

import torch
import torch.distributed.distributed_c10d as c10d

from overlap_pass.lowering import symm

from . import pacing, timeline
from .peers import buffer_view

STAMP_SLOTS = 256  # pulls in flight at once, at most (a CUDA graph of many calls reuses them)


class _PeerBuffer(torch.Tensor):
    """A view of a peer's buffer, as get_buffer gives it: a copy out of it is a pull."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") == "copy_" and isinstance(args[1], _PeerBuffer):
                source = args[1]
                return source._handle.pull(args[0], source.as_subclass(torch.Tensor))
            return func(*args, **(kwargs or {}))


class EmulatedHandle:
    """Stands for torch's _SymmetricMemory of a group (module docstring)."""

    def __init__(self, params: timeline.Parameters, world: int, nbytes: int, device: torch.device):
        self.params, self.rank, self.world_size, self.nbytes = params, 0, world, nbytes
        self.buffer = torch.empty(-(-nbytes // 256) * 256, dtype=torch.uint8, device=device)
        self.stamps = symm._lasting([0] * STAMP_SLOTS, torch.int64, device)  # (outside graph trees' pool)
        self._pulls = 0
        self.first_barrier = True  # of the call in progress (AsyncTP.workspace starts a call)

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        view = buffer_view(self.buffer, sizes, dtype, storage_offset)
        if rank == self.rank:
            return view
        peer = view.as_subclass(_PeerBuffer)
        peer._handle = self
        return peer

    def pull(self, target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``target.copy_(source)``, a peer's bytes over the link: done when the link's time for
        them has passed since the copy began."""
        slot = self._pulls % STAMP_SLOTS
        self._pulls += 1
        link_us = self.params.push.us(source.numel() * source.element_size())
        pacing.STAMP[(1,)](self.stamps, slot, num_warps=1)
        target.copy_(source)
        pacing.WAIT_SINCE[(1,)](self.stamps, slot, pacing.ns(link_us), num_warps=1)
        return target

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        """The peers reach a call's first barrier ``barrier_us`` after rank 0, as at overlap's;
        the later ones, which they reach in step, cost a signal's way there and back."""
        us = self.params.barrier_us if self.first_barrier else self.params.signal_us
        self.first_barrier = False
        pacing.DELAY[(1,)](pacing.ns(us), num_warps=1)


class AsyncTP:
    """Installs the emulated handles into torch's symmetric-memory module (``install``)."""

    def __init__(self, params: timeline.Parameters):
        self.params = params
        self.handles: dict[str, EmulatedHandle] = {}

    def workspace(self, group_name: str, min_size: int, *args, **kwargs) -> EmulatedHandle:
        handle = self.handles.get(group_name)
        if handle is None or handle.nbytes < min_size:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the emulated async TP workspace of {group_name} must grow while a graph is captured")
            device = torch.device("cuda", torch.cuda.current_device())
            world = c10d._resolve_process_group(group_name).size()  # (a mesh's TP group, not the world)
            handle = self.handles[group_name] = EmulatedHandle(self.params, world, min_size, device)
        handle.first_barrier = True  # every op takes its handle here, once a call
        return handle

    def install(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.get_symm_mem_workspace = self.workspace
        for path in ("_should_use_multimem_all_gather_matmul", "_should_use_fused_all_gather_matmul_native"):
            if hasattr(symm_mem, path):
                setattr(symm_mem, path, lambda *args, **kwargs: False)
