"""Every knob of overlap, Inductor style.

Set a knob in code (``overlap_pass.config.enabled = True``), for a block
(``with overlap_pass.config.patch(enabled=True): ...``), or from the environment
(``OVERLAP_PASS_<NAME>``, read when overlap_pass is imported).
"""

import collections
import contextlib
import os
import sys
import threading
import types

from torch.utils._config_module import Config, install_config_module


def _int_from_env(name: str, default: int) -> int:
    """An integer knob's default, from the environment where ``name`` is set: Config's own
    environment variables read "0" and "1" as booleans and anything else as a string."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"overlap_pass.config: {name}={value!r} is not an integer") from None


# Apply the pass inside the default ``torch.compile(model)`` (backend="inductor") too.
# backend="overlap" applies it whatever this says. Needs ``import overlap_pass`` first.
enabled: bool = Config(default=False, env_name_default="OVERLAP_PASS_ENABLED")

# Rewrite all_gather -> matmul pairs into overlap::all_gather_matmul.
all_gather_matmul: bool = Config(default=True, env_name_default="OVERLAP_PASS_ALL_GATHER_MATMUL")

# Rewrite matmul -> reduce_scatter pairs into overlap::matmul_reduce_scatter.
matmul_reduce_scatter: bool = Config(
    default=True, env_name_default="OVERLAP_PASS_MATMUL_REDUCE_SCATTER"
)

# Split each all-reduce that row-wise ops (residual add, norm, casts) lead from a matmul to the
# next matmuls into a reduce-scatter and an all-gather around those ops, run on the rank's 1/W of
# the tokens, so that both fuse with their matmuls (tensor parallelism without sequence
# parallelism; regions/split_regions.py). Off: all-reduces stay as they are.
split_all_reduce: bool = Config(default=True, env_name_default="OVERLAP_PASS_SPLIT_ALL_REDUCE")

# Float8: where an all-gathered tensor is quantized (row-wise ops, amaxes) before a
# _scaled_mm, run the quantization on each rank's shard and gather the float8 data and its
# rowwise scales instead, fused with the scaled matmuls; a tensorwise amax becomes the shards'
# amaxes, all-reduced (regions/split_regions.py). Off: such all-gathers stay as they are.
quantize_before_gather: bool = Config(default=True, env_name_default="OVERLAP_PASS_QUANTIZE_BEFORE_GATHER")

# Float8: read torchao's rowwise matmul without fast accumulation (a _scaled_mm with scales of 1,
# the row and column scales multiplied in afterwards) as one rowwise _scaled_mm, so that its
# all-gather and reduce-scatter fuse too (float8.py); written back where no op takes it. Off:
# torchao's rowwise backward matmuls keep their collectives.
fold_rowwise_float8: bool = Config(default=True, env_name_default="OVERLAP_PASS_FOLD_ROWWISE_FLOAT8")

# A plain all-gather of the same rows as a fused all-gather op (torchao rowwise's second,
# column-wise quantized copy of a gathered tensor; plain TP's saved activations) rides along in
# that op's call, after its chunks, behind its matmul, instead of running as a collective of its
# own (passengers.py).
gather_passengers: bool = Config(default=True, env_name_default="OVERLAP_PASS_GATHER_PASSENGERS")

# The weight gradients of a reduce-scatter op's linears (contractions of its inputs, the output
# gradients, over the tokens) run inside the op, after its partials and before its sum, while
# the last partials travel (regions/tail_matmuls.py). Off by default: the GEMMs beside the
# transfers slow by about what it hides (docs/rewrites.md#tail-matmuls).
tail_matmuls: bool = Config(default=False, env_name_default="OVERLAP_PASS_TAIL_MATMULS")

# Small all-reduces that the graph's inputs alone determine (float8's amaxes of weights and of
# the block's input) run as one collective per reduce op and dtype, at the first one's place
# (regions/early_all_reduces.py): one collective's host cost instead of each one's.
merge_small_all_reduces: bool = Config(default=True, env_name_default="OVERLAP_PASS_MERGE_SMALL_ALL_REDUCES")

# All-reduces of at most this many bytes run as overlap::all_reduce: a one-shot all-reduce
# through symmetric memory that a per-call CUDA graph replays, or NCCL where the first call's
# measurement finds it faster (regions/small_all_reduces.py). A small all-reduce is all latency
# and host steps. A symbolic size is judged at its traced value; a call over the limit at run
# time goes to NCCL. 0: every all-reduce stays NCCL's.
small_all_reduce_bytes: int = Config(default=_int_from_env("OVERLAP_PASS_SMALL_ALL_REDUCE_BYTES", 256 << 10))

# A plain-TP split (regions/) counts a collective as fused only where it moves at least this
# many bytes a rank; a smaller one counts as plain: the op call a split adds costs the host
# tens of microseconds (docs/benchmarks.md, host time of an op call), and where the host sets
# the pace a smaller collective buys nothing. A graph on symbolic token counts is compiled
# (backend="overlap") once per range of counts its regions split in (shapes/size_ranges.py);
# elsewhere judged at its traced value. 0: every fusable one counts.
split_min_bytes: int = Config(default=_int_from_env("OVERLAP_PASS_SPLIT_MIN_BYTES", 16 << 20))

# Raise (OverlapNotApplied) instead of warning where a compiled graph holds tensor-parallel
# collectives next to matmuls and the pass rewrites none of them: for CI and benchmarks, which
# must not pass on a model that quietly runs without overlap.
strict: bool = Config(default=False, env_name_default="OVERLAP_PASS_STRICT")

# Which implementation the rewritten ops run. "auto": on CUDA with an NCCL group, the fastest of
# the variants measured at a shape's first call (lowering/choose.py); elsewhere the reference
# decomposition. "reference" forces the torch.distributed decomposition; "fused",
# "copy_engine_cublas", "cublas_push" (matmul_reduce_scatter only) and "nccl_cublas" force one
# CUDA variant where the op has it (else the op measures as with "auto"); "one_shot" is
# overlap::all_reduce's (regions/small_all_reduces.py).
implementation: str = Config(default="auto", env_name_default="OVERLAP_PASS_IMPLEMENTATION")

# Replay the symmetric-memory variants' calls from per-call CUDA graphs where a call's tensors sit
# at addresses seen before (lowering/replay.py): one launch instead of the protocol's dozen host
# steps. Off: every call queues its steps eagerly.
op_graphs: bool = Config(default=True, env_name_default="OVERLAP_PASS_OP_GRAPHS")

# Inductor's generated code calls the ops' CUDA kernels directly instead of through torch's
# dispatcher (pipeline/direct_calls.py): less host time an op call (docs/benchmarks.md, host
# time of an op call). Under a profiler the calls go through the op still. Off: every call goes
# through torch.ops.overlap.
direct_op_calls: bool = Config(default=True, env_name_default="OVERLAP_PASS_DIRECT_OP_CALLS")

# Call signatures (shapes, strides, dtypes) whose resolved variant and per-call CUDA graphs are
# kept, least recently used dropped first: a model whose token counts change from call to call
# (dynamic shapes) keeps the graphs of its most recent shapes, not of every shape it met. A
# dropped shape that comes back resolves again (its bucket's choice, tried once; no measurement).
shapes_kept: int = Config(default=_int_from_env("OVERLAP_PASS_SHAPES_KEPT", 64))

# Most device memory, in MiB, that one symmetric-memory workspace (one per op kind, group and
# device: the gathered rows of an all-gather, the partials of a reduce-scatter) may take; a call
# that needs more runs NCCL + cuBLAS instead (the same on every rank: shapes are), logged once.
# 0: no cap. lowering/symm.bytes_held() tells what the workspaces hold.
workspace_limit_mib: int = Config(default=_int_from_env("OVERLAP_PASS_WORKSPACE_LIMIT_MIB", 0))

# Save each gathered activation's shard for the backward and gather it again there (under the
# weight gradients' GEMMs), as Megatron-LM's sequence parallelism does, instead of saving the
# gathered tensor: (W - 1) / W of that activation memory less (regions/regather.py). Off by
# default: it trades step time for that memory (docs/rewrites.md#gathered-again-in-the-backward).
regather_in_backward: bool = Config(default=False, env_name_default="OVERLAP_PASS_REGATHER_IN_BACKWARD")

# A call signature (its shapes: a token count) runs NCCL + cuBLAS at its first
# fused_from_call - 1 calls and its chosen variant from then on. A symmetric-memory variant's
# first two calls at a signature (eager, then capturing its per-call CUDA graph) cost the host
# far more than NCCL + cuBLAS's, and its replays save a little a step: a count that recurs
# fewer times never pays that back, and shapes that change from call to call run what plain
# Inductor runs. A training step's fixed shapes are fused from their 8th step. The choice's
# measurement waits for it too. 1: fused from the first call. Forced implementations
# (config.implementation) run from the first call. Graphs on symbolic counts under
# backend="overlap" wait on plain Inductor's graph instead (below).
fused_from_call: int = Config(default=_int_from_env("OVERLAP_PASS_FUSED_FROM_CALL", 8))

# backend="overlap" compiles a graph on symbolic token counts once more without the pass, and a
# token count's first fused_from_call - 1 calls run that graph: plain Inductor's own, faster
# there than overlap's graph with its ops on NCCL + cuBLAS (shapes/new_counts.py); so does a
# count whose op calls keep missing their per-call CUDA graphs. Once
# such a graph exists, the ops of the process run their chosen variants from a signature's first
# call (the graph has done the waiting). CUDA only. Off: no second compile; the ops wait as above.
plain_graph_at_new_counts: bool = Config(default=True, env_name_default="OVERLAP_PASS_PLAIN_GRAPH_AT_NEW_COUNTS")

# A token bucket far from every measured one (shapes that change) runs the nearest measured
# bucket's choice at its first token counts, and is measured at its measure_bucket_after-th
# distinct count: a count seen once never stalls its step on a measurement (seconds), a bucket
# that recurs gets its own choice. 1: measured at its first count.
measure_bucket_after: int = Config(default=_int_from_env("OVERLAP_PASS_MEASURE_BUCKET_AFTER", 3))

# A choice's measurement rides on the op's own calls, a step of it per call (a variant's first
# call beside NCCL + cuBLAS's, or one sample of one variant on the call's inputs, whose result
# is the call's), instead of timing every variant at the call that needs the choice: no step
# stalls for long, but many steps are slower and the picks are noisier (docs/ops.md). Off:
# measured at once. Choices made while CUDA graph trees warm a model up are measured at once.
measure_over_calls: bool = Config(default=False, env_name_default="OVERLAP_PASS_MEASURE_OVER_CALLS")

# During a choice's measurement, the first fused call that compiles a kernel has the same call's
# kernels under the other GEMM configs compiled on a thread pool beside its own (up to 8 threads,
# the process's share of its cores), so that the other configs' first calls find them compiled
# (templates/launch.py; what it saves: docs/ops.md#the-per-shape-choice). Off: each config
# compiles at its own first call.
compile_ahead: bool = Config(default=True, env_name_default="OVERLAP_PASS_COMPILE_AHEAD")

# Polls before a wait on a peer gives up (barrier, chunk flags). It then records which rank or
# chunk it missed and the op raises ChunkTimeout (at the latest 16 calls later). Each poll is a
# system-scope atomic read, about a microsecond: the default gives up after some ten minutes,
# like NCCL's own timeout, since ranks legitimately drift apart by more than seconds (one rank
# compiling while another hits its cache). Tests and tools set it far lower.
spin_limit: int = Config(default=_int_from_env("OVERLAP_PASS_SPIN_LIMIT", 1 << 30))

# JSON file of the per-shape choices (rank 0 writes it, later runs read it).
choice_cache: str = Config(
    default="~/.cache/overlap_pass/choices.json", env_name_default="OVERLAP_PASS_CHOICE_CACHE"
)

# Folder for debug dumps: per compiled graph, the graph before and after the pass and
# decisions.json. Dumping turns the FX graph cache off for those graphs, so that every compile
# writes its dump. TORCH_COMPILE_DEBUG=1 also dumps, into Inductor's debug folder.
debug_dir: str | None = Config(default=None, env_name_default="OVERLAP_PASS_DEBUG_DIR")

IMPLEMENTATIONS = ("auto", "reference", "fused", "copy_engine_cublas", "cublas_push", "nccl_cublas", "one_shot")

install_config_module(sys.modules[__name__])


class _ChangesCounted(type(sys.modules[__name__])):
    """This module as install_config_module made it, counting its changes (set, deleted, patched
    in or out) for hot()."""

    changes = 0

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        _ChangesCounted.changes += 1

    def __delattr__(self, name):
        super().__delattr__(name)
        _ChangesCounted.changes += 1

    def patch(self, *args, **kwargs):
        return _CountedPatch(super().patch(*args, **kwargs))


class _CountedPatch(contextlib.ContextDecorator):
    """A config.patch whose entry and exit count as changes."""

    def __init__(self, patch) -> None:
        self.patch = patch

    def __enter__(self):
        entered = self.patch.__enter__()
        _ChangesCounted.changes += 1
        return entered

    def __exit__(self, *exc):
        try:
            return self.patch.__exit__(*exc)
        finally:
            _ChangesCounted.changes += 1


# (ConfigModule's __setattr__ takes config names only)
types.ModuleType.__setattr__(sys.modules[__name__], "__class__", _ChangesCounted)
_MODULE = sys.modules[__name__]

# The knobs every op call reads: a read through the config module costs the host microseconds
# (its lookup of overrides, environment and default), a snapshot's a tuple's attribute.
HotKnobs = collections.namedtuple("HotKnobs", "implementation op_graphs spin_limit")
_SNAPSHOTS = threading.local()  # per thread: a patch's overrides are its context's


def hot() -> HotKnobs:
    """implementation, op_graphs and spin_limit as they are now (a snapshot kept until the
    config next changes)."""
    held = getattr(_SNAPSHOTS, "held", None)
    if held is None or held[0] != _ChangesCounted.changes:
        knobs = HotKnobs(_MODULE.implementation, _MODULE.op_graphs, _MODULE.spin_limit)
        held = _SNAPSHOTS.held = (_ChangesCounted.changes, knobs)
    return held[1]
