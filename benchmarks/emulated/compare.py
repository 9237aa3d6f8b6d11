"""The emulated world against real ranks: a run measured on W GPUs beside the same run emulated
on one, row by row.

    python3 -m benchmarks.emulated.compare MEASURED.json EMULATED.json [--keys mm,overlap,...]
    python3 -m benchmarks.emulated.compare benchmarks/results EMULATED_DIR    # every run of both

Either file is a bench_ops or a bench_model JSON (any tool whose rows hold a "us" table of
times per compiler or variant). Per row and timing: measured, emulated, error, and the host time
of a call beside it where the runs keep one; then per row
whether the compilers rank as measured (which is faster of each pair, and whether overlap beats
plain Inductor); last the median and largest |error|. Given two folders, every emulated run
(EMULATED_DIR/NAME.json, as ``EMULATE=1 OUT=EMULATED_DIR bash benchmarks/SCRIPT.sh`` writes
them) beside the measured run of the same name anywhere under the first, then the totals over
the model rows (the check) and over the ops (what the parameters were fitted on).
"""

import argparse
import itertools
import json
import pathlib
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


def run_pairs(measured_dir: str, emulated_dir: str) -> list[tuple[str, str, str]]:
    """(name, measured path, emulated path) for every emulated run with a measured one of its
    name under ``measured_dir``."""
    measured = {p.name: p for p in sorted(pathlib.Path(measured_dir).rglob("*.json"))}
    return [
        (p.stem, str(measured[p.name]), str(p))
        for p in sorted(pathlib.Path(emulated_dir).glob("*.json"))
        if p.name in measured
    ]


def errors_of(rows: list[tuple[str, str, float, float]]) -> list[float]:
    """|emulated - measured| / measured per timing both runs have."""
    return [abs(e - m) / m for _, _, m, e in rows if m and e is not None]


def print_comparison(measured: dict, emulated: dict, keys=None) -> list[tuple[str, str, float, float]]:
    """The table of one pair of runs (module docstring); returns its rows."""
    rows = pairs(measured, emulated, keys)
    print(f"measured: {measured['meta'].get('device')} W={measured['meta'].get('world')}; "
          f"emulated: {emulated['meta'].get('device')} W={emulated['meta'].get('world')} (EMULATED)")  # fmt: skip
    # a rank's host time per call (the emulation measures rank 0's for real), where a tool keeps it
    hosts = [{_row_name(r): r.get("host_us", {}) for r in run["rows"]} for run in (measured, emulated)]
    print("| row | timing | measured (µs) | emulated (µs) | error | host time, measured / emulated (µs) |")
    print("|---|---|---|---|---|---|")
    for name, key, m, e in rows:
        if m and e is not None:
            host = [h.get(name, {}).get(key) for h in hosts]
            host_cell = f"{host[0]:.0f} / {host[1]:.0f}" if None not in host else ""
            print(f"| {name} | {key} | {m:.0f} | {e:.0f} | {(e - m) / m:+.1%} | {host_cell} |")
    alike = ranked_alike(rows)
    print("\nranked as measured: " + ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in alike.items()))
    errors = errors_of(rows)
    if errors:
        print(f"|error| median {statistics.median(errors):.1%}, largest {max(errors):.1%} over {len(errors)} timings")
    return rows


def _total(label: str, rows: list, alike: dict) -> None:
    errors = errors_of(rows)
    if not errors:
        print(f"{label}: no timing in both")
        return
    ranked = sum(alike.values())
    print(f"{label}: |error| median {statistics.median(errors):.1%}, largest {max(errors):.1%} over "
          f"{len(errors)} timings; ranked as measured in {ranked} of {len(alike)} rows")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measured", help="a run's JSON, or a folder of them (searched recursively)")
    parser.add_argument("emulated", help="a run's JSON, or a folder of them")
    parser.add_argument("--keys", default=None, help="only these timings (comma-separated)")
    args = parser.parse_args()
    keys = args.keys.split(",") if args.keys else None
    if not pathlib.Path(args.measured).is_dir():
        print_comparison(_load(args.measured), _load(args.emulated), keys)
        return
    totals = {"model rows": ([], {}), "ops": ([], {})}
    for name, measured_path, emulated_path in run_pairs(args.measured, args.emulated):
        print(f"\n## {name}\n")
        measured = _load(measured_path)
        rows = print_comparison(measured, _load(emulated_path), keys)
        found, alike = totals["ops" if "op" in measured["meta"] else "model rows"]
        found += rows
        alike.update({f"{name}: {row}": ok for row, ok in ranked_alike(rows).items()})
    print()
    for label, (rows, alike) in totals.items():
        _total(label, rows, alike)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
