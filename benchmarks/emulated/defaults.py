"""The emulated world's parameters per world size, and where each comes from.

- NCCL at W=2 and W=4: fit.py's lines through the op tables' collective-alone times (4×H200
  and 2×H200, 2026-11-22, NVLS off). At W=8, which no table has: W=4's bus bandwidth (NCCL's
  ring reaches the same bus bandwidth from 2 to 8 H100s, about 365-370 GB/s at large sizes:
  github.com/NVIDIA/nccl/issues/1455, and 8×H200's all-gather / reduce-scatter 361 / 363 GB/s
  at 16 GiB: github.com/stas00/ml-engineering network/README.md) and W=4's latency plus four
  more ring hops at NCCL's tuner's 3.4 µs a hop (NVLink, Simple protocol: src/graph/tuning.cc).
- NCCL's all-reduce (no op table times it alone): a reduce-scatter then an all-gather, the
  ring's two halves: their latencies added, their bus bandwidths averaged.
- The SMs NCCL's kernel holds: 24, the collective channels NCCL opens on 8×H100
  (aws-samples/aws-do-eks nccl-test README: "24 coll channels"), one CTA each.
- A copy-engine push: a line through the rank-rotated copy-engine all-gather through symmetric
  memory, one side stream, gathering 64, 128 and 256 MiB on 4×H200 and 2×H200 (2026-11-21):
  372 GB/s and 6.8 µs a push, the rest of its time two barriers (7.5 µs each); the
  same at W=8, where one push still goes to one peer at a time (p2pBandwidthLatencyTest on
  8×H100, 371-377 GB/s one way: github.com/NVIDIA/nccl/issues/1264).
- A producer's stores: an assumption until the fused producer's op rows fit it (NVLink's
  370 GB/s usable rate, 2 µs from the last store to the flag).
"""

import dataclasses

from .timeline import Link, Parameters

_NCCL = {  # world -> (all_gather, reduce_scatter), fit.py on the H200 op tables
    2: (Link(12.9, 216.2), Link(20.1, 216.9)),
    4: (Link(30.2, 296.5), Link(20.5, 295.3)),
}
HOP_US = 3.4


def _nccl(world: int) -> tuple[Link, Link, str]:
    if world in _NCCL:
        return (*_NCCL[world], f"NCCL fitted on the W={world} H200 op tables")
    ag, rs = _NCCL[4]
    extra = HOP_US * (world - 4)
    return (
        Link(ag.latency_us + extra, ag.gbps), Link(rs.latency_us + extra, rs.gbps),
        f"NCCL at W={world} from W=4's fit and published ring figures",
    )  # fmt: skip


def parameters(world: int, **changes) -> Parameters:
    """The defaults at ``world`` ranks, with ``changes`` (field -> value) over them."""
    if world < 2:
        raise ValueError(f"an emulated world needs 2 ranks or more, not {world}")
    ag, rs, nccl_source = _nccl(world)
    ar = Link(ag.latency_us + rs.latency_us, (ag.gbps + rs.gbps) / 2)
    params = Parameters(
        world=world, push=Link(6.8, 372.0), stores=Link(2.0, 370.0), barrier_us=7.5,
        all_gather=ag, reduce_scatter=rs, all_reduce=ar, nccl_sms=24,
        source=f"{nccl_source}; pushes from the H200 copy-engine all-gather",
    )  # fmt: skip
    return dataclasses.replace(params, **changes)
