"""The emulated world's process group: rank 0 of W in one process, its collectives run as NCCL's
would on this GPU.

The backend is torch's own fake process group (groups, subgroups and device meshes of any size,
nothing moved), registered as "emulated_nccl". Every collective, whoever calls it (the classic API,
the functional ops of DTensor and of Inductor's generated code), reaches torch's ``c10d::``
dispatcher ops; their CPU and CUDA kernels are replaced here (process-wide, for as long as the
world lasts) by ones that do what ProcessGroupNCCL does with streams: on the group's own stream,
after the caller's work, the collective writes its values with torch's kernels and then holds
``nccl_sms`` SMs (nccl_kernel.py) until NCCL's time (timeline.Parameters.nccl_us) has passed
since it began; waiting for the returned work makes the caller's stream wait for it. A
synchronous call runs on the caller's stream. On the CPU the values are written alike and
nothing is timed (the CPU tests).
"""

import dataclasses
import warnings

import torch
import torch.distributed as dist

from overlap_pass.lowering import symm

from . import timeline

# "nccl" in its name: overlap takes a group for symmetric memory by its backend's name
BACKEND = "emulated_nccl"

# how a part's values are made (_fill); nccl_kernel.py needs triton, so the CPU path does not import it
GATHER, REDUCE_SCATTER, ALL_REDUCE, NOTHING = 0, 1, 2, 3
STAMP_SLOTS = 1024  # collectives in flight at once, at most
# the collective whose NCCL time a call takes (broadcasts and barriers: none, setup only)
_TIMED_AS = {
    "all_gather": "all_gather", "all_to_all": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
}  # fmt: skip


class Collectives:
    """The replaced kernels, for ``params`` (a timeline.Parameters of the world's size; a
    subgroup's collectives take its own size through the same links)."""

    def __init__(self, params: timeline.Parameters):
        self.params = params
        self.streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self.calls: dict[str, int] = {}
        self._library = None
        self._stamps: dict[torch.device, torch.Tensor] = {}  # each collective's start (the GPU's timer)
        self._slot = 0

    # -- installing -----------------------------------------------------------------------------

    def install(self) -> None:
        self._library = torch.library.Library("c10d", "IMPL")
        with warnings.catch_warnings():  # ("Overriding a previously registered kernel": the point)
            warnings.simplefilter("ignore", UserWarning)
            self._register()

    def _register(self) -> None:
        for name in (
            "allreduce_", "allreduce_coalesced_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_",
            "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_base_", "broadcast_", "barrier",
        ):  # fmt: skip
            for key in ("CPU", "CUDA"):
                self._library.impl(name, getattr(self, name), key)

    def uninstall(self) -> None:
        """torch's kernels back (the library's registrations go with it)."""
        self._library = None

    # -- one collective -----------------------------------------------------------------------

    def _run(self, kind: str, pg, parts, values, inputs, rest, op: str = "SUM"):
        """``parts``: (mode, src, dst, nbytes) per tensor; returns the work (boxed)."""
        from torch._C._distributed_c10d import _create_work_from_future

        self.calls[kind] = self.calls.get(kind, 0) + 1
        async_op = next((a for a in rest if isinstance(a, bool)), True)  # (schemas differ by version)
        group = dist.ProcessGroup.unbox(pg)
        device = next((t.device for t in values), torch.device("cpu"))
        with torch._C._AutoDispatchBelowADInplaceOrView():  # the values are the op's, not autograd's
            if device.type != "cuda":
                for mode, src, dst, _ in parts:
                    _fill(mode, src, dst, group.size(), op)
                future = torch.futures.Future()
                future.set_result(values)
                return _create_work_from_future(future).boxed()
            caller = torch.cuda.current_stream(device)
            stream = caller
            if async_op:
                key = (group.group_name, device.index)
                stream = self.streams.get(key) or self.streams.setdefault(key, symm.new_stream(device))  # (none of torch's pool)
                stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                self._launch(kind, parts, group.size(), op)
                if stream is not caller:
                    for t in inputs:  # the caller may free an input before it waits
                        t.record_stream(stream)
                future = torch.futures.Future(devices=[device])  # records its event on this stream
                future.set_result(values)
        return _create_work_from_future(future).boxed()

    def _launch(self, kind: str, parts, world: int, op: str) -> None:
        """The collective's values (torch's kernels, brief) then the hold of NCCL's SMs until
        NCCL's time has passed since it began."""
        from . import nccl_kernel, pacing

        device = parts[0][1].device
        if device not in self._stamps:
            self._stamps[device] = symm._lasting([0] * STAMP_SLOTS, torch.int64, device)
        stamps, slot = self._stamps[device], self._slot % STAMP_SLOTS
        self._slot += 1
        pacing.STAMP[(1,)](stamps, slot, num_warps=1)
        for mode, src, dst, _ in parts:
            _fill(mode, src, dst, world, op)
        params = self.params if world == self.params.world else dataclasses.replace(self.params, world=world)
        timed = _TIMED_AS.get(kind)
        us = params.nccl_us(timed, sum(nbytes for *_, nbytes in parts)) if timed else 0.0
        nccl_kernel.hold(timed or kind, stamps, slot, us, params.nccl_sms)

    # -- the c10d ops -----------------------------------------------------------------------------

    def allreduce_(self, tensors, pg, reduce_op, sparse_indices, *rest):
        op = _op_name(reduce_op)
        parts = [(ALL_REDUCE, t, t, _bytes(t)) for t in tensors]
        return tensors, self._run("all_reduce", pg, parts, tensors, tensors, rest, op)

    def allreduce_coalesced_(self, tensors, pg, reduce_op, *rest):
        op = _op_name(reduce_op)
        parts = [(ALL_REDUCE, t, t, _bytes(t)) for t in tensors]
        return self._run("all_reduce", pg, parts, tensors, tensors, rest, op)

    def _allgather_base_(self, output, inp, pg, *rest):
        return output, self._run("all_gather", pg, [(GATHER, inp, output, _bytes(output))], [output], [inp], rest)

    def allgather_into_tensor_coalesced_(self, outputs, inputs, pg, *rest):
        parts = [(GATHER, i, o, _bytes(o)) for o, i in zip(outputs, inputs)]
        return self._run("all_gather", pg, parts, outputs, inputs, rest)

    def allgather_(self, output_lists, inputs, pg, *rest):
        outs = output_lists[0]
        parts = [(ALL_REDUCE, inputs[0], o, _bytes(o)) for o in outs]  # each rank's: the input (avg: as is)
        return output_lists, self._run("all_gather", pg, parts, outs, inputs, rest, "AVG")

    def _reduce_scatter_base_(self, output, inp, pg, reduce_op, *rest):
        parts = [(REDUCE_SCATTER, inp, output, _bytes(inp))]
        return output, self._run("reduce_scatter", pg, parts, [output], [inp], rest, _op_name(reduce_op))

    def reduce_scatter_tensor_coalesced_(self, outputs, inputs, pg, reduce_op, *rest):
        parts = [(REDUCE_SCATTER, i, o, _bytes(i)) for o, i in zip(outputs, inputs)]
        return self._run("reduce_scatter", pg, parts, outputs, inputs, rest, _op_name(reduce_op))

    def alltoall_base_(self, output, inp, pg, output_splits, input_splits, *rest):
        same = output.numel() == inp.numel()
        parts = [(ALL_REDUCE if same else NOTHING, inp, output, _bytes(inp))]  # (avg: the input as is)
        return self._run("all_to_all", pg, parts, [output], [inp], rest, "AVG")

    def broadcast_(self, tensors, pg, root_rank, root_tensor, *rest):
        parts = [(NOTHING, t, t, _bytes(t)) for t in tensors]
        return tensors, self._run("broadcast", pg, parts, tensors, tensors, rest)

    def barrier(self, tensor, pg, device_ids, *rest):
        return self._run("barrier", pg, [(NOTHING, tensor, tensor, 0)], [tensor], [], rest)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_name(reduce_op) -> str:
    """The reduce op's name (SUM, AVG, ...): the dispatcher hands a ScriptObject, whose op()
    is ReduceOp.RedOpType's value."""
    value = reduce_op.op() if isinstance(reduce_op, torch.ScriptObject) else reduce_op
    return dist.ReduceOp.RedOpType(int(value)).name


def _fill(mode: int, src: torch.Tensor, dst: torch.Tensor, world: int, op: str) -> None:
    """What a collective leaves in ``dst`` (timeline.py: the mirror's values)."""
    if mode == GATHER:
        dst.view(world, -1).copy_(src.reshape(1, -1))
    elif mode == REDUCE_SCATTER:
        # (no temporary the input's size: NCCL takes none, and the emulation's memory is rank 0's)
        chunks = src.reshape(world, -1)
        if op == "MAX":
            dst.view(-1).copy_(chunks.amax(0))
        elif op == "MIN":
            dst.view(-1).copy_(chunks.amin(0))
        else:
            reduced = chunks.sum(0, dtype=torch.float32)
            dst.view(-1).copy_(reduced.div_(world) if op == "AVG" else reduced)
    elif mode == ALL_REDUCE:
        if op != "SUM" or src.dtype == torch.bool:
            dst.copy_(src)
        elif dst.data_ptr() == src.data_ptr():
            dst.mul_(world)
        else:
            torch.mul(src, world, out=dst)


def register_backend() -> None:
    """The "emulated_nccl" backend: torch's fake process group, for every rank count (once a process)."""
    if BACKEND in dist.Backend.backend_list:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, backend_options):  # (as torch's own "fake" backend makes its groups)
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, backend_options)

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
