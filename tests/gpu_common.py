"""Helpers shared by the per-rank GPU test bodies (fused_ag_cases, fused_rs_cases)."""

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.lowering import replay, symm

REL_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def group_name() -> str:
    return dist.group.WORLD.group_name


def poison_workspace():
    for ws in symm._WORKSPACES.values():
        if ws._alloc is not None:
            ws.data((ws._alloc.data_bytes,), torch.uint8).fill_(0xFF)  # NaN in bf16, fp16 and fp32
    torch.cuda.synchronize()
    dist.barrier()


def error(out, ref) -> torch.Tensor:
    """Relative error (device scalar); inf where the output holds a NaN or inf."""
    out = out.float()
    err = (out - ref).norm() / ref.norm().clamp_min(1e-12)
    return torch.where(torch.isfinite(out).all(), err, torch.full_like(err, float("inf")))


def message_of_a_late_peer(kind: str, data_bytes: int, call) -> str:
    """On a group of its own (its workspace thrown away after), rank 1 runs ``call(group_name)``
    alone with a short spin limit; returns the ChunkTimeout message rank 1 then gets ("" on
    the other ranks)."""
    group = dist.new_group(list(range(dist.get_world_size())))
    device = torch.device("cuda", torch.cuda.current_device())
    ws = symm.workspace(kind, group.group_name, device)
    ws.reserve(data_bytes)  # collective: every rank
    message = ""
    if dist.get_rank() == 1:
        with config.patch(spin_limit=20_000):
            call(group.group_name)
        try:
            ws.check_timeouts()
        except symm.ChunkTimeout as e:
            message = str(e)
    torch.cuda.synchronize()
    dist.barrier()
    del symm._WORKSPACES[(kind, group.group_name, device.index)]
    return message


def assert_all_close(errors: list, labels: list) -> None:
    """Checks a run of calls' output errors (device scalars, one sync) after its timeouts."""
    errors = torch.stack(errors).cpu()
    symm.check_all_timeouts()
    bad = [(labels[i], float(errors[i])) for i in range(len(labels)) if not errors[i] <= REL_TOL[torch.bfloat16]]
    assert not bad, f"rank {dist.get_rank()}: {len(bad)} bad calls, first {bad[:3]}"


def calls_that_replay(calls: int, implementations, problem, run, reference) -> int:
    """The op forced to each of ``implementations``, called ``calls`` times on two sets of input
    tensors in turn, each refilled in place with a new problem per call, so that calls replay
    per-call CUDA graphs (lowering/replay.py) and every replay computes on new values. Rank 0
    runs its calls eagerly (op_graphs off): replays and eager calls meet in one protocol.
    ``problem(seed)``: the op's input tensors as a list (None where absent); ``run(tensors)``:
    the op's outputs, ``reference(seed)``: the expected ones (bf16). Returns the graphs this
    rank captured."""
    sets = [problem(0), problem(0)]
    captured, errors, labels = 0, [], []
    for implementation in implementations:
        replay._SIGNATURES.clear()
        with config.patch(implementation=implementation, op_graphs=dist.get_rank() != 0):
            for call in range(calls):
                tensors = sets[call % 2]
                for old, new in zip(tensors, problem(call + 1)):
                    if old is not None:
                        old.copy_(new)  # in place: the addresses repeat, the values do not
                outs = run(tensors)
                errors += [error(o, r) for o, r in zip(outs, reference(call + 1))]
                labels += [(implementation, call)] * len(outs)
                del outs  # as a model's step drops its outputs, so their addresses repeat too
        captured += sum(len(s.graphs) for s in replay._SIGNATURES.values())
    assert_all_close(errors, labels)
    return captured
