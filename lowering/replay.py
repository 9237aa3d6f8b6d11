"""Per-call CUDA graphs of the symmetric-memory variants: host time.

An eager call of a variant queues a dozen host steps or more (barrier, fork, W - 1 copies and
flags, the GEMM launch with its descriptors, join), up to hundreds of microseconds of Python per
call (docs/ops.md#cuda-graph-replay): at 8B sizes that, not the GPU, sets the pace of a compiled
model. In a model's steady state each op call finds its tensors at the addresses it found them
at in the step before (the caching allocator serves the same pattern of requests the same way),
so the second call of a signature with a given set of addresses is captured into a CUDA graph,
and every later one with those addresses replays it: one launch.

A replay is the eager call's exact work, because a graph is keyed by everything it bakes in:
the call's signature (shapes, strides, dtypes, group: dispatch's fast key; and the variant,
since a first call's choice runs every variant on the same tensors), the address of every
tensor it reads or writes (outputs are allocated before each call, outside the graph), the
workspace's allocation and the spin limit. The protocol's state (epoch, flags) lives on the
device and advances on replay, so one rank may replay while a peer runs the same call eagerly.
Off inside a capture (CUDA graph trees record the op into their own graph then) and while graph
trees warm a model up (their allocations would mix with the capture's).
"""

import collections
import dataclasses
import logging
import threading

import torch

from overlap_pass import config

from overlap_pass import torch_compat
from . import choose
from .symm import new_stream

log = logging.getLogger("overlap_pass")

MAX_GRAPHS = 256  # per signature (a model's layers each call it at addresses of their own)
_SIGHTINGS_KEPT = 4 * MAX_GRAPHS  # address sets seen once, remembered for a second sighting
EAGER_CALLS_NOTED = 64  # eager calls of a signature with no graph yet, after which the log says so


@dataclasses.dataclass
class _Signature:
    graphs: dict = dataclasses.field(default_factory=dict)  # addresses -> graph
    seen: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    failed: bool = False  # a capture failed: calls of this signature run eagerly from then on
    eager_calls: int = 0


_SIGNATURES: dict[tuple, _Signature] = {}
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
_CUBLAS_READY: set[tuple[int, int]] = set()  # (thread, device) whose cuBLAS ran on the capture stream
# calls per path since the process started: "eager", "captured", "replayed" (tests, tools)
stats: collections.Counter = collections.Counter()


def call(signature: tuple, run, args: tuple, outputs, tensors, workspace) -> None:
    """``run(*args, outputs=outputs)``, from a graph where this call's addresses were seen
    before. ``tensors``: every tensor the call reads or writes (None entries skipped);
    ``workspace``: the symm.Workspace it runs on."""
    knobs = config.hot()
    if not knobs.op_graphs or torch.cuda.is_current_stream_capturing():
        run(*args, outputs=outputs)
        return
    state = _SIGNATURES.get(signature)
    if state is None:
        state = _SIGNATURES[signature] = _Signature()
    addresses = graph_key(workspace, tensors, knobs.spin_limit)
    graph = state.graphs.get(addresses)
    if graph is not None:
        stats["replayed"] += 1
        workspace.replay(graph)
        return
    capture = not (state.failed or len(state.graphs) >= MAX_GRAPHS) and state.seen.pop(addresses, False)
    if capture and choose.replays_graphs(workspace.device):
        capture = False  # graph trees warm a model up: their pool takes this thread's allocations
    graph = _capture(run, args, outputs, workspace) if capture else None
    if graph is None:
        state.failed |= capture  # a capture was tried and failed: eager from now on
        state.seen[addresses] = True
        if len(state.seen) > _SIGHTINGS_KEPT:
            state.seen.popitem(last=False)
        stats["eager"] += 1
        state.eager_calls += 1
        if state.eager_calls == EAGER_CALLS_NOTED and not state.graphs:
            log.info(
                "overlap: %d calls of %s found their tensors at new addresses each time: no per-call "
                "CUDA graph to replay, every call queues its host steps", state.eager_calls, signature,
            )  # fmt: skip
        run(*args, outputs=outputs)
        return
    state.graphs[addresses] = graph
    stats["captured"] += 1
    workspace.replay(graph)


def output_maker(outputs, device: torch.device):
    """A function that makes new empty tensors laid out as ``outputs`` (a tensor, None, or
    tuples and lists of them, all on ``device``) through Inductor's allocator, past torch's
    dispatcher; it returns None where the current device is another."""
    if device.type != "cuda":
        return lambda: None
    make = _maker(outputs, torch_compat.empty_strided_cuda())
    current_device, index = torch_compat.current_device_index(), device.index

    def make_on_device():
        return make() if current_device() == index else None

    return make_on_device


def _maker(template, empty_strided):
    """A function that makes ``template``'s structure anew, each tensor empty, as laid out."""
    if template is None:
        return lambda: None
    if isinstance(template, torch.Tensor):
        size, stride, dtype = tuple(template.shape), template.stride(), template.dtype
        return lambda: empty_strided(size, stride, dtype)
    parts, kind = [_maker(part, empty_strided) for part in template], type(template)
    return lambda: kind([make() for make in parts])


def graph_key(workspace, tensors, spin_limit: int) -> tuple:
    """What a call's graph is kept under within its signature: the workspace's allocation, the
    spin limit (config.spin_limit, baked into the graph) and the address of every tensor the
    call reads or writes (None entries skipped)."""
    return (workspace.generation, spin_limit, *(t.data_ptr() for t in tensors if t is not None))


def graphs_held() -> tuple[int, int]:
    """(per-call CUDA graphs kept, call signatures they belong to)."""
    return sum(len(s.graphs) for s in _SIGNATURES.values()), sum(bool(s.graphs) for s in _SIGNATURES.values())


def forget(signatures) -> None:
    """Drops the graphs of these signatures (the variants a first-call choice timed and did
    not pick: their calls will not come again)."""
    for signature in signatures:
        _SIGNATURES.pop(signature, None)


def forget_calls_of(fast_key: tuple) -> None:
    """Drops the graphs of every variant's calls of ``fast_key`` (a call signature dispatch no
    longer keeps)."""
    forget([signature for signature in _SIGNATURES if signature[0] == fast_key])


def _capture(run, args: tuple, outputs, workspace):
    """One call of ``run`` captured into a CUDA graph (nothing runs), or None where it cannot be.
    The graphs of one workspace share a memory pool for what a call allocates inside (a
    contiguous copy, a cuBLAS variant's temporaries): its calls never run concurrently (the
    protocol serializes them), so one pool serves them all instead of one pool per graph: the
    first graph's, which the workspace keeps, since a pool whose graphs are all gone cannot take
    another capture (forget() may drop them all)."""
    device = workspace.device
    stream = capture_stream(device)
    first = workspace.first_graph
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            # thread-local: other threads (NCCL's watchdog) may use CUDA meanwhile
            graph.capture_begin(pool=None if first is None else first.pool(), capture_error_mode="thread_local")
            try:
                run(*args, outputs=outputs)
            finally:
                graph.capture_end()
    except Exception as error:  # an eager call then runs it (and raises what it raises)
        log.warning("overlap: a call cannot be captured in a CUDA graph, running it eagerly from now on: %s", error)
        return None
    if first is None:
        workspace.first_graph = graph
    return graph


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream calls of ``device`` are captured on, with cuBLAS set up on it for this thread."""
    stream = _CAPTURE_STREAMS.get(device.index)
    if stream is None:
        stream = _CAPTURE_STREAMS[device.index] = new_stream(device)
    if (threading.get_ident(), device.index) not in _CUBLAS_READY:
        _set_up_cublas(stream, device)
    return stream


def _set_up_cublas(stream: torch.cuda.Stream, device: torch.device) -> None:
    """cuBLAS (and cuBLASLt: bf16 with a bias, float8 where the device has it) run once on the
    capture stream by this thread (cuBLAS handles are per thread), so that their workspaces for
    the stream come from the caching allocator here, not from inside the first capture's pool."""
    with torch.cuda.stream(stream):
        a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
        torch.mm(a.float(), a.float())
        torch.addmm(a[0], a, a)
        if torch.cuda.get_device_capability(device) >= (8, 9):
            one = torch.ones((), device=device)
            f8 = a.to(torch.float8_e4m3fn)
            torch_compat.scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16)
    stream.synchronize()
    _CUBLAS_READY.add((threading.get_ident(), device.index))
