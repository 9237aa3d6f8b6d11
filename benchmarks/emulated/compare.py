"""The emulated world against real ranks: a run measured on W GPUs beside the same run emulated
on one, row by row.

    python3 -m benchmarks.emulated.compare MEASURED.json EMULATED.json [--keys mm,overlap,...]

Either file is a bench_ops or a bench_model JSON (any tool whose rows hold a "us" table of
times per compiler or variant). Per row and timing: measured, emulated, error; then per row
whether the compilers rank as measured (which is faster of each pair, and whether overlap beats
plain Inductor); last the median and largest |error|.
"""

import argparse
import itertools
import json
import statistics


def _row_name(row: dict) -> str:
    if "shape" in row:
        return row["shape"]
    parts = [row.get("model", ""), row.get("layout", ""), row.get("size", ""), f"batch {row.get('batch', 1)}"]
    return " ".join(str(p) for p in parts if p)


def _timings(row: dict) -> dict:
    return row.get("us_graph") or row["us"]


def pairs(measured: dict, emulated: dict, keys=None) -> list[tuple[str, str, float, float]]:
    """(row, timing, measured µs, emulated µs) for every timing both runs have."""
    theirs = {_row_name(r): _timings(r) for r in emulated["rows"]}
    out = []
    for row in measured["rows"]:
        name = _row_name(row)
        if name not in theirs:
            continue
        for key, value in _timings(row).items():
            if key in theirs[name] and (keys is None or key in keys):
                out.append((name, key, value, theirs[name][key]))
    return out


def ranked_alike(rows: list[tuple[str, str, float, float]]) -> dict[str, bool]:
    """Per row: whether every pair of its timings is ordered the same in both runs."""
    by_row: dict[str, list] = {}
    for name, key, m, e in rows:
        by_row.setdefault(name, []).append((key, m, e))
    return {
        name: all((a[1] < b[1]) == (a[2] < b[2]) for a, b in itertools.combinations(entries, 2))
        for name, entries in by_row.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measured")
    parser.add_argument("emulated")
    parser.add_argument("--keys", default=None, help="only these timings (comma-separated)")
    args = parser.parse_args()
    with open(args.measured) as f:
        measured = json.load(f)
    with open(args.emulated) as f:
        emulated = json.load(f)
    rows = pairs(measured, emulated, args.keys.split(",") if args.keys else None)
    print(f"measured: {measured['meta'].get('device')} W={measured['meta'].get('world')}; "
          f"emulated: {emulated['meta'].get('device')} W={emulated['meta'].get('world')} (EMULATED)")  # fmt: skip
    print("| row | timing | measured (µs) | emulated (µs) | error |\n|---|---|---|---|---|")
    errors = []
    for name, key, m, e in rows:
        if not m or e is None:
            continue
        error = (e - m) / m
        errors.append(abs(error))
        print(f"| {name} | {key} | {m:.0f} | {e:.0f} | {error:+.1%} |")
    alike = ranked_alike(rows)
    print("\nranked as measured: " + ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in alike.items()))
    if errors:
        print(f"|error| median {statistics.median(errors):.1%}, largest {max(errors):.1%} over {len(errors)} timings")


if __name__ == "__main__":
    main()
