"""The two custom passes Inductor calls: OverlapPass on each post-grad graph (forward and
backward), RegatherPass on the joint graph before the partitioner.

OverlapPass sits in Inductor's post_grad_custom_pre_pass slot: it runs before Inductor's own
post-grad pattern passes and before ``_micro_pipeline_tp``, so neither can take or reshape the
collective -> matmul patterns first. Each pass's cache key hashes the package's source and the
config, so the FX graph cache stays on and a change of either misses it.
"""

import functools
import glob
import logging
import os

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph

from .. import config
from ..regions import split_cost
from ..regions.regather import mark_gathers_recomputed
from ..shapes import size_ranges
from . import direct_calls, dumps, stages
from .report import OverlapNotApplied

log = logging.getLogger("overlap_pass")

# Inductor settings every rank must share for its graphs to be the same: shape padding (pad_mm)
# benchmarks padded and unpadded matmuls on each rank on its own, so at a token count that is not
# a multiple of 8 one rank's graph can pad K and V while another's does not, the pass then fuses
# Q, K and V on one rank and Q alone on the other, and the ranks' collectives no longer match.
# overlap's ops are collective: off.
SAME_GRAPH_ON_EVERY_RANK = {"shape_padding": False}


class OverlapPass(CustomGraphPass):
    """Rewrites all_gather -> matmul and matmul -> reduce_scatter into overlap's ops.

    ``always=True`` (backend="overlap") runs on every graph; ``always=False`` is the hook that
    ``import overlap_pass`` installs into the default Inductor compile, active only while
    ``overlap_pass.config.enabled`` is set.
    """

    def __init__(self, always: bool = True, ranges: size_ranges.Ranges | None = None) -> None:
        self.always = always
        self.ranges = ranges  # backend="overlap": the token counts this compile runs

    def active(self) -> bool:
        return self.always or config.enabled

    def __call__(self, graph: Graph) -> None:
        if not self.active():
            return
        if not self.always:
            _tell_if_ranks_may_differ()
        try:
            direct_calls.install_lowerings()  # before Inductor lowers the ops the pass inserts
            with size_ranges.active(self.ranges):
                stages.run(graph)
        except OverlapNotApplied:  # config.strict: the user asked for this to fail the compile
            raise
        except Exception as error:  # each stage leaves a whole graph; the compile goes on
            log.warning("overlap_pass failed on %s: %r", dumps.graph_name(), error)

    def uuid(self):
        if not self.active():
            return "overlap_pass:off"
        if dumps.dumping():
            return None  # no FX graph cache, so every compile writes its dump
        if self.ranges is not None and not self.ranges.cacheable():
            return None  # a cached graph would not tell where its regions split (size_ranges.py)
        # the all-reduce split slices each rank's rows into its graph
        ranges = self.ranges.key() if self.ranges is not None else None
        return (source_hash(), settings_key(), current_rank() if config.split_all_reduce else None, ranges)


class RegatherPass(CustomGraphPass):
    """The pass in Inductor's joint_custom_pre_pass slot, on while config.regather_in_backward
    is set (``always=False``: only while config.enabled is set too, the default compile's hook)."""

    def __init__(self, always: bool = True) -> None:
        self.always = always

    def active(self) -> bool:
        return config.regather_in_backward and (self.always or config.enabled)

    def __call__(self, graph: Graph) -> None:
        if not self.active():
            return
        try:
            marked = mark_gathers_recomputed(graph)
        except Exception as error:  # the marks are hints: without them the step is as it was
            log.warning("overlap: gathers not marked to be gathered again in the backward: %r", error)
            return
        if marked:
            log.info("overlap: %d gathers of forward activations marked to be gathered again in the backward", marked)

    def uuid(self):
        return ("overlap_regather", source_hash()) if self.active() else "overlap_regather:off"


@functools.cache
def _tell_if_ranks_may_differ() -> None:
    """Inside the default compile (config.enabled), Inductor's settings are the user's: say
    once where they can give ranks different graphs (SAME_GRAPH_ON_EVERY_RANK)."""
    differing = {k: v for k, v in SAME_GRAPH_ON_EVERY_RANK.items() if getattr(torch._inductor.config, k) != v}
    if differing:
        log.warning(
            "overlap: Inductor's %s can give ranks different graphs (shape padding benchmarks each rank on "
            "its own), and overlap's ops are collective: set %s in torch._inductor.config "
            "(TORCHINDUCTOR_SHAPE_PADDING=0), as backend=\"overlap\" and overlap_pass.launch do",
            ", ".join(differing), ", ".join(f"{k} = {v!r}" for k, v in differing.items()),
        )


def current_rank() -> int | None:
    """This process's rank, None outside a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def settings_key() -> tuple:
    """What of the process's settings decides the pass's graphs: the config, and the split's
    cost of a collective beyond its bytes (which split_cost.sizes_ignored() zeroes)."""
    return config.get_hash(), split_cost.LATENCY_BYTES


@functools.cache
def source_hash() -> bytes:
    """A hash of every source file of the package (the passes' part of the FX graph cache key)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return get_hash_for_files(tuple(sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True))))
