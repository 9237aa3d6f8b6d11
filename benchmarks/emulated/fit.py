"""NCCL's links of the emulated world, fitted on the op tables measured on real ranks: a least
squares line through each collective's time alone against the bytes it moves (timeline.py's
model), per collective and world size.

    python3 -m benchmarks.emulated.fit     # prints the fits that defaults.py holds
"""

import glob
import json
import os

from . import timeline

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
COLLECTIVES = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "reduce_scatter"}


def samples(pattern: str = "ops_w*/*.json") -> dict:
    """(device, world, collective) -> [(bytes moved, µs)], from every bf16 op run (replayed
    timings where the run has them)."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        with open(path) as f:
            run = json.load(f)
        meta = run["meta"]
        if meta.get("dtype", "bf16") != "bf16" or meta.get("op") not in COLLECTIVES:
            continue
        world = meta["world"]
        for row in run["rows"]:
            us = row.get("us_graph") or row["us"]
            nbytes = row["M"] * row["N" if meta["op"] == "matmul_reduce_scatter" else "K"] * 2
            key = (meta["device"], world, COLLECTIVES[meta["op"]])
            out.setdefault(key, []).append((nbytes * (world - 1) / world, us["collective"]))
    return out


def line(points) -> timeline.Link:
    """The Link through (bytes moved, µs) points with the least squared relative error (each
    point weighted 1 / µs², so small collectives count as much as large ones)."""
    weights = [1 / (y * y) for _, y in points]
    total = sum(weights)
    mx = sum(w * x for w, (x, _) in zip(weights, points)) / total
    my = sum(w * y for w, (_, y) in zip(weights, points)) / total
    slope = sum(w * (x - mx) * (y - my) for w, (x, y) in zip(weights, points))
    slope /= sum(w * (x - mx) ** 2 for w, (x, _) in zip(weights, points))
    return timeline.Link(latency_us=round(my - slope * mx, 1), gbps=round(1e-3 / slope, 1))


def main() -> None:
    for (device, world, collective), points in sorted(samples().items()):
        fitted = line(points)
        worst = max(abs(fitted.us(x) - y) / y for x, y in points)
        print(f"{device} W={world} {collective}: {fitted} over {len(points)} shapes, worst {worst:.1%}")


if __name__ == "__main__":
    main()
