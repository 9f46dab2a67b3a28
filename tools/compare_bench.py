"""Compare benchmark runs of two trees, made alternately on one machine (ci/bench_ab.sh).

Each run is a JSON file of ``python -m cupy_memstrat bench GROUP --json``, named
``GROUP-TREE-N.json`` (TREE ``before`` or ``after``, N the round). For every ratio a group
reports (the leaves under ``ratio_to_cupy_default`` and ``bars``: each path's time over CuPy's
pool's, measured side by side in one process), this prints the median of each tree's runs and
the A/A spread, the largest difference between two runs of the same tree. A change that moves
a ratio by more than that spread is marked.

    python tools/compare_bench.py DIR [--json OUT.json]

The JSON holds the rows and, per group, the machine its first run reported (GPU, driver and
package versions).

Exit status 1 when a ratio moved beyond the spread, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

RATIO_KEYS = ("ratio_to_cupy_default", "bars")
NAME = re.compile(r"^(?P<group>[a-z]+)-(?P<tree>before|after)-(?P<round>\d+)\.json$")


def ratios(doc, prefix=()) -> dict[tuple, float]:
    """The numeric leaves under the ratio keys of one run, by their path of keys."""
    out = {}
    for key, value in doc.items() if isinstance(doc, dict) else ():
        path = prefix + (str(key),)
        if key in RATIO_KEYS or any(p in RATIO_KEYS for p in prefix):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[path] = float(value)
            elif isinstance(value, dict):
                out.update(ratios(value, path))
        elif isinstance(value, dict):
            out.update(ratios(value, path))
    return out


def compare(folder: pathlib.Path) -> list[dict]:
    """One row per (group, ratio): the medians of both trees, the A/A spread, and whether the
    difference of the medians is beyond it.

    Raises:
        ValueError: no run, or a group without runs of both trees.
    """
    runs: dict[str, dict[str, list[dict]]] = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        if m:
            runs.setdefault(m["group"], {}).setdefault(m["tree"], []).append(ratios(json.loads(path.read_text())))
    if not runs:
        raise ValueError(f"{folder}: no GROUP-before-N.json / GROUP-after-N.json runs")
    rows = []
    for group, trees in sorted(runs.items()):
        if set(trees) != {"before", "after"}:
            raise ValueError(f"{folder}: group {group!r} has runs of {', '.join(sorted(trees))} only")
        keys = set.intersection(*(set(r) for tree in trees.values() for r in tree))
        for key in sorted(keys):
            values = {t: [r[key] for r in trees[t]] for t in ("before", "after")}
            spread = max(max(v) - min(v) for v in values.values())
            before, after = (statistics.median(values[t]) for t in ("before", "after"))
            rows.append({"group": group, "ratio": "/".join(key), "before": before, "after": after,
                         "spread": spread, "beyond": abs(after - before) > spread,
                         "runs": {t: len(v) for t, v in values.items()}})
    return rows


def machines(folder: pathlib.Path) -> dict[str, dict]:
    """Per group, the ``machine`` record of its first run (the GPU, driver and package versions)."""
    out: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        if m and m["group"] not in out:
            out[m["group"]] = json.loads(path.read_text()).get("machine", {})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        rows = compare(args.folder)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"compare_bench: {exc}", file=sys.stderr)
        return 2
    width = max(len(f"{r['group']} {r['ratio']}") for r in rows)
    print(f"{'ratio':<{width}}  {'before':>8}  {'after':>8}  {'A/A spread':>10}")
    for r in rows:
        mark = "  <- beyond the A/A spread" if r["beyond"] else ""
        name = f"{r['group']} {r['ratio']}"
        print(f"{name:<{width}}  {r['before']:8.3f}  {r['after']:8.3f}  {r['spread']:10.3f}{mark}")
    if args.json:
        args.json.write_text(json.dumps({"machines": machines(args.folder), "rows": rows}, indent=1))
    return 1 if any(r["beyond"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
