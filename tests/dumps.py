"""Reading the pass's debug dumps in tests."""


def collective_calls(code: str) -> list[str]:
    """The collectives and overlap ops of a dumped graph's code (after.txt), in order, each as
    its call (what it reads, by node name). Every rank must build the same ones in the same
    order; the rest of a graph may differ between ranks (the slices of a rank's own rows)."""
    calls = []
    for line in code.splitlines():
        if "_c10d_functional." in line or "ops.overlap." in line:
            calls.append(line.split(" = ", 1)[-1].strip())  # a call not assigned stands alone
    return calls


def assert_same_collectives(graphs_per_rank: list[dict]) -> None:
    """``graphs_per_rank[r]``: {graph name: its rewritten code} of rank r. Every rank built the
    same graphs, with the same collectives in the same order (one in another order aborts gloo
    and hangs NCCL)."""
    first = graphs_per_rank[0]
    for rank, graphs in enumerate(graphs_per_rank[1:], start=1):
        assert graphs.keys() == first.keys(), f"rank {rank} compiled {sorted(graphs)}, rank 0 {sorted(first)}"
        for name, code in first.items():
            ours, theirs = collective_calls(code), collective_calls(graphs[name])
            assert ours and ours == theirs, f"{name}: rank 0's and rank {rank}'s collectives differ:\n{ours}\n{theirs}"
