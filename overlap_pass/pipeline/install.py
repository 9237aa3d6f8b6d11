"""Putting the passes into Inductor's custom-pass slots, beside whatever the slots hold, and
taking them out again (the plain graph that shapes/new_counts.py compiles).

``install()`` (run by ``import overlap_pass``) gives the default torch.compile hooks that stay
inert until ``overlap_pass.config.enabled`` is set; backend="overlap" patches the slots of its
own compiles instead (backend.py).
"""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .passes import OverlapPass, RegatherPass

# Inductor's slot -> the pass overlap puts there
SLOTS = {"post_grad_custom_pre_pass": OverlapPass, "joint_custom_pre_pass": RegatherPass}


class ChainedGraphPass(CustomGraphPass):
    """Several custom passes in one Inductor slot, for torch versions whose slots take one."""

    def __init__(self, passes: list) -> None:
        self.passes = list(passes)

    def __call__(self, graph: Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(i is None for i in ids) else tuple(ids)


def _held(slot) -> list:
    if slot is None:
        return []
    if isinstance(slot, ChainedGraphPass):
        return list(slot.passes)
    if isinstance(slot, (list, tuple)):
        return list(slot)
    return [slot]


def _slot_value(passes: list):
    return None if not passes else passes[0] if len(passes) == 1 else ChainedGraphPass(passes)


def with_overlap_pass(slot, overlap_pass):
    """The value for an Inductor custom-pass slot: what it held, minus any pass of
    ``overlap_pass``'s class (OverlapPass, RegatherPass), then ``overlap_pass``."""
    return _slot_value([p for p in _held(slot) if not isinstance(p, type(overlap_pass))] + [overlap_pass])


def without_overlap_passes(slot):
    """The value for an Inductor custom-pass slot: what it held, minus overlap's passes."""
    return _slot_value([p for p in _held(slot) if not isinstance(p, tuple(SLOTS.values()))])


def install() -> None:
    """Hooks OverlapPass and RegatherPass into the default torch.compile, gated by
    config.enabled. Idempotent."""
    inductor = torch._inductor.config
    for name, graph_pass in SLOTS.items():
        slot = getattr(inductor, name)
        if not any(isinstance(p, graph_pass) for p in _held(slot)):
            setattr(inductor, name, with_overlap_pass(slot, graph_pass(always=False)))
