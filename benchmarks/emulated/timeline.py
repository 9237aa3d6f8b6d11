"""What the emulated peers do and when: the parameters of an emulated world and the arrival
schedule its peers follow, in plain Python (no torch, no GPU). peers.py and nccl.py do the same
on the device; the CPU tests check this one.

Rank 0 runs for real. Every peer is rank 0's mirror: it holds the same inputs and runs the same
program on the same clock, starting ``barrier_us`` after rank 0 reaches a call's barrier. So
peer s's pushes are rank 0's pushes, rotated: rank 0's n-th push of a call goes to peer q, and
at the same step peer s = (W - q) % W pushes to rank 0 (an all-gather's rank-rotated order, a
reduce-scatter's chunk of rank + 1 first). A peer's push lands at rank 0 at

    A_n = max(ready_n + a, A_(n-1) + b)        A_0 = the barrier's release

where ``ready_n`` is when rank 0's own n-th push had its data (its matmul done, or its flag
raised by a kernel), and (a, b) the push's costs: a copy-engine push of B bytes takes the link
(a = b = latency + B / rate, one push after another, as one side stream runs them); a producer
kernel's stores stream out while it computes, so only their latency follows its last store
(a = store latency) while the link still bounds the bytes (b = B / store rate).

Values a collective leaves in the emulated world follow from the mirror: an all-gather's output
is the own shard W times, a reduce-scatter's the sum of the input's W chunks (peer s's partial
of rank 0's chunk is rank 0's partial of chunk -s), an all-reduce's W times the input (sum), or
the input itself (avg, max, min). overlap's ops, NCCL's and async TP's agree on them, so the
tools still check one against another.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Link:
    """latency_us + bytes / rate: a transfer's time."""

    latency_us: float
    gbps: float  # GB/s: 1e3 bytes per µs

    def us(self, nbytes: float) -> float:
        return self.latency_us + nbytes / (self.gbps * 1e3)


@dataclasses.dataclass(frozen=True)
class Parameters:
    """An emulated world of ``world`` ranks. NCCL's collectives follow the bus-bandwidth model
    of nccl-tests: an all-gather of an output of B bytes (or a reduce-scatter of an input of B
    bytes) takes latency + B (W - 1) / W / busbw, an all-reduce twice the bytes."""

    world: int
    push: Link  # one copy-engine push of a chunk to one peer
    stores: Link  # a producer kernel's stores to one peer: latency after its last, their rate
    barrier_us: float  # how long after rank 0 its peers reach a call's barrier
    all_gather: Link  # NCCL's, as a bus bandwidth
    reduce_scatter: Link
    all_reduce: Link
    nccl_sms: int  # the SMs an NCCL collective's kernel holds while it runs
    source: str  # where the numbers come from
    # a barrier that every peer has reached already: one signal's way there and back (async
    # TP's barriers after a call's first, which its peers reach as rank 0 does)
    signal_us: float = 3.0

    def nccl_us(self, collective: str, nbytes: int) -> float:
        """NCCL's time for ``collective`` over ``nbytes`` (an all-gather's output, the others'
        input)."""
        link = getattr(self, collective)  # all_gather, reduce_scatter or all_reduce
        moved = nbytes * (self.world - 1) / self.world * (2 if collective == "all_reduce" else 1)
        return link.us(moved) if self.world > 1 else 0.0

    def describe(self) -> str:
        """One line per parameter, printed with every emulated result."""
        lines = [f"emulated world: W={self.world}, rank 0 real, peers emulated ({self.source})"]
        for field in dataclasses.fields(self):
            if field.name not in ("world", "source"):
                lines.append(f"  {field.name}: {getattr(self, field.name)}")
        return "\n".join(lines)


def pushing_peer(to_peer: int, world: int) -> int:
    """The peer whose push reaches rank 0 at the step where rank 0 pushes to ``to_peer``."""
    return (world - to_peer) % world


def landing_rows(to_peer: int, world: int, start: int, stop: int) -> tuple[int, int]:
    """Where rank 0's rows start:stop of a push to ``to_peer`` land as the mirrored push: the
    pushing peer's rows of rank 0's data, that many runs of rows along (rank 0's run comes first
    in each block of its data: an all-gather's chunk of a block, a reduce-scatter's slot)."""
    shift = pushing_peer(to_peer, world) * (stop - start)
    return start + shift, stop + shift


@dataclasses.dataclass(frozen=True)
class Push:
    """One of rank 0's pushes, in its order: to whom, how many bytes, when its data was ready
    (µs from the barrier's release), and whether a producer's stores carry it."""

    to_peer: int
    nbytes: int
    ready_us: float = 0.0
    stores: bool = False


def costs(push: Push, params: Parameters) -> tuple[float, float]:
    """(a, b) of the landing time's recurrence (module docstring)."""
    if push.stores:
        return params.stores.latency_us, push.nbytes / (params.stores.gbps * 1e3)
    t = params.push.us(push.nbytes)
    return t, t


def arrivals(pushes: list[Push], params: Parameters) -> list[tuple[int, float]]:
    """(peer, µs after the barrier's release) of every mirrored push landing at rank 0, in
    rank 0's push order."""
    landed, out = 0.0, []
    for push in pushes:
        a, b = costs(push, params)
        landed = max(push.ready_us + a, landed + b)
        out.append((pushing_peer(push.to_peer, params.world), landed))
    return out


def all_gather_pushes(world: int, chunk_bytes: int) -> list[Push]:
    """Rank 0's pushes of an all-gather: its shard to rank - 1, rank - 2, ... (steps 1..W-1),
    all ready at once."""
    return [Push((world - step) % world, chunk_bytes) for step in range(1, world)]


def reduce_scatter_pushes(world: int, partial_bytes: int, matmul_us: float, stores: bool) -> list[Push]:
    """Rank 0's pushes of a matmul + reduce-scatter: its partial of chunk 1, 2, ... (its own,
    last, stays), each ready when its share of the matmul is done."""
    share = matmul_us / world
    return [Push(chunk, partial_bytes, chunk * share, stores) for chunk in range(1, world)]
