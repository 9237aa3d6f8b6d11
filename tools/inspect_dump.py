"""Print a readable summary of an overlap dump folder.

    python -m tools.inspect_dump overlap_dump/          # every rank and graph below it
    python -m tools.inspect_dump overlap_dump/rank0/model__0_forward_1

One row per candidate collective: graph, kind, collective node, dim, shapes, whether it was
rewritten, the implementation chosen, and the reason it was not. A split all-reduce shows the
row-wise ops it runs on the shard, the tensors it gathers, and its cost estimate.
"""

import argparse
import glob
import json
import os
import sys

COLUMNS = ("graph", "kind", "collective", "dim", "shapes", "rewritten", "impl", "reason")


def _shape(described: dict | None) -> str:
    if not described or "shape" not in described:
        return "?"
    return "x".join(str(s) for s in described["shape"])


def _shapes(candidate: dict) -> str:
    """The operand shapes of a candidate: shard -> matmul outputs, or input @ mat2 -> out."""
    split = candidate.get("split")
    if split:  # an all-reduce split around row-wise ops (overlap_pass/regions/split_regions.py)
        gathered = ",".join(g["name"] + ("(fused)" if g["fused_with_matmul"] else "") for g in split["gathered"])
        return f"{_shape(candidate['collective'])}: {split['row_wise_ops']} row-wise ops, gathered {gathered or '-'}"
    nodes = candidate.get("nodes")
    if not nodes:
        return _shape(candidate.get("collective"))
    if candidate["kind"] == "all_gather_matmul":
        outs = ",".join(_shape(m["mm"]) for m in nodes["matmuls"] + nodes.get("contractions", []))
        riders = f" (+{candidate['passengers']} passengers)" if candidate.get("passengers") else ""
        return f"{_shape(nodes['shard'])} -> {outs}{riders}"
    terms = " + ".join(f"{_shape(m['input'])} @ {_shape(m['mat2'])}" for m in nodes["matmuls"])
    return f"{terms} -> {_shape(candidate['collective'])}"


def rows(folder: str) -> list[tuple[str, ...]]:
    """One row per candidate of every decisions.json at or below ``folder``."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "decisions.json"), recursive=True))
    found = []
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        graph = os.path.relpath(os.path.dirname(path), folder)
        for c in record["candidates"]:
            found.append(
                (
                    graph if graph != "." else record["graph"],
                    c["kind"],
                    c["collective"]["name"],
                    str(c.get("dim", "")),
                    _shapes(c),
                    "yes" if c["rewritten"] else "no",
                    c.get("implementation") or "",
                    c.get("reason") or (c.get("split") or {}).get("cost", ""),
                )
            )
    return found


def format_table(table: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [COLUMNS, *table]) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [COLUMNS, *table]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a dump folder (config.debug_dir) or any folder below it")
    args = parser.parse_args(argv)
    table = rows(args.folder)
    if not table:
        graphs = glob.glob(os.path.join(args.folder, "**", "decisions.json"), recursive=True)
        if graphs:  # dumped graphs with no all-gather or reduce-scatter in them
            count = f"{len(graphs)} graph{'s' if len(graphs) > 1 else ''}"
            print(f"{count} under {args.folder}, none with an all-gather or reduce-scatter")
            return 0
        print(f"no decisions.json under {args.folder}", file=sys.stderr)
        return 1
    print(format_table(table))
    done = sum(r[5] == "yes" for r in table)
    print(f"\n{done} of {len(table)} candidates rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
