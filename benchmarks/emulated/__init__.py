"""One rank of a W-rank world on one GPU: rank 0 runs for real, its peers are emulated.

    python3 -m benchmarks.bench_ops --emulate 4 --op all_gather_matmul
    OVERLAP_EMULATE_WORLD=8 python3 -m benchmarks.bench_model ...    # (the same, for any tool)

What rank 0 runs is its own: its kernels, overlap's protocol, choices and per-call graphs, its
host time. What its peers do to it is emulated (timeline.py has the model and its parameters,
defaults.py their values and sources):
- overlap's ops (peers.py): the peers' pushes and flags land in rank 0's workspace through the
  copy engine, in the order and at the times real peers' would;
- NCCL's collectives, whoever calls them (nccl.py): a kernel holding NCCL's SMs for NCCL's time;
- PyTorch's async TP (asynctp.py): its own pipelines, their pulls paced at the link's rate.
A persistent kernel of overlap's takes one SM less than the GPU has: the emulation's one-warp
kernels need one to run on while it waits for them.

Every number from here is labelled "emulated", with the parameters printed beside it.
"""

import os

import torch
import torch.distributed as dist

from . import defaults, timeline

ENV = "OVERLAP_EMULATE_WORLD"
RESERVED_SMS = 1
_COLLECTIVES: list = []  # the replaced c10d kernels' owner: they last as long as it does


def add_argument(parser) -> None:
    """--emulate W (default: the environment's OVERLAP_EMULATE_WORLD)."""
    parser.add_argument(
        "--emulate", type=int, default=int(os.environ.get(ENV) or 0), metavar="W",
        help=f"one process on one GPU, rank 0 of W ranks whose peers are emulated (or {ENV}=W)",
    )  # fmt: skip


def init_process_group(device: torch.device, emulate: int = 0, **changes) -> timeline.Parameters | None:
    """NCCL's process group of torchrun's ranks, or with ``emulate`` = W an emulated world of W
    ranks (``changes``: parameters over defaults.py's); returns the world's parameters, or None."""
    if not emulate:
        dist.init_process_group("nccl", device_id=device)
        return None
    return start(defaults.parameters(emulate, **changes), device)


def start(params: timeline.Parameters, device: torch.device) -> timeline.Parameters:
    """Makes this process rank 0 of ``params.world`` ranks (once a process) and prints the
    parameters."""
    from overlap_pass.lowering import gluon_kernels, symm
    from overlap_pass.templates import all_reduce, gemm
    from overlap_pass.templates import matmul_reduce_scatter as producer

    from . import asynctp, nccl, nccl_kernel, pacing, peers

    if _COLLECTIVES:
        raise RuntimeError("this process is an emulated world already")
    nccl.register_backend()
    collectives = nccl.Collectives(params)
    collectives.install()
    _COLLECTIVES.append(collectives)
    dist.init_process_group(nccl.BACKEND, rank=0, world_size=params.world, store=dist.HashStore())
    peers.EmulatedWorkspace.params = params
    symm.Workspace = peers.EmulatedWorkspace  # what symm.workspace() makes from now on
    # the kernels that store into the peers: their mirrors queued once they launched
    all_reduce.ONE_SHOT = peers.MirroredOneShot(all_reduce.ONE_SHOT)
    producer.matmul_reduce_scatter_producer = peers.MirroredProducer(producer.matmul_reduce_scatter_producer)
    gluon = gluon_kernels.load()
    if gluon is not None:
        gluon.producer.matmul_reduce_scatter_pingpong = peers.MirroredProducer(gluon.producer.matmul_reduce_scatter_pingpong)
    all_sms = gemm._sm_count_of
    gemm._sm_count_of = lambda index: all_sms(index) - RESERVED_SMS
    asynctp.AsyncTP(params).install()
    pacing.preload(device)
    nccl_kernel.preload(device)
    print(params.describe(), flush=True)
    return params
