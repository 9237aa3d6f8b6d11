"""The chunk schedule: which rank's chunk a rank handles at each step.

One place for the order, so the reference decomposition and the GPU kernels agree.
A chunk is one rank's slice along the gathered or scattered dim.
"""

import torch


def all_gather_order(rank: int, world_size: int) -> list[int]:
    """Chunks in the order a rank consumes them: its own first (already local), then the
    others rank-rotated, so at step s every rank pulls from a different peer (rank + s)."""
    return [(rank + step) % world_size for step in range(world_size)]


def reduce_scatter_order(rank: int, world_size: int) -> list[int]:
    """Chunks in the order a rank produces them: the one destined for rank + 1 first, its own
    last, so every peer's partial is ready as early as possible and the own one is summed last."""
    return [(rank + step) % world_size for step in range(1, world_size + 1)]


def all_gather_peers(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """(send_to, receive_from) at ``step`` of the rank-rotated all-gather: a rank receives chunk
    rank + step and sends its own chunk to the rank that wants it at that step, rank - step."""
    return (rank - step) % world_size, (rank + step) % world_size


def reduce_scatter_peers(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """(send_to, receive_from) at ``step`` of the rank-rotated reduce-scatter: a rank sends its
    partial of chunk rank + step to its owner and receives the partial of its own chunk from
    rank - step."""
    return (rank + step) % world_size, (rank - step) % world_size


def chunk(tensor: torch.Tensor, dim: int, index: int, world_size: int) -> torch.Tensor:
    """Rank ``index``'s slice of ``tensor`` along ``dim`` (a view)."""
    size = tensor.shape[dim] // world_size
    return tensor.narrow(dim, index * size, size)
