"""Helpers the tools share: the slowest rank's value, and a relative error."""

import torch
import torch.distributed as dist


def slowest(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks of the default group."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
