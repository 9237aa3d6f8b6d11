"""Helpers shared by the per-rank GPU test bodies (fused_ag_cases, fused_rs_cases)."""

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.lowering import symm

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
