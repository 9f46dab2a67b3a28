"""Compare two JUnit XML reports of the same test suite, test by test.

    python tools/compare_junit.py BASELINE.xml CANDIDATE.xml [--json OUT]

Prints the counts of each and every test whose outcome differs; exits 1 if the
candidate has a failure or error that the baseline does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> tuple[dict[str, str], float]:
    root = ET.parse(path).getroot()
    result, seconds = {}, 0.0
    for suite in root.iter("testsuite"):
        seconds += float(suite.get("time", 0))
    for case in root.iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                # pytest writes xfail as <skipped type="pytest.xfail">
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                break
        result[key] = kind
    return result, seconds


def compare(base_path: str, cand_path: str) -> dict:
    base, base_s = outcomes(base_path)
    cand, cand_s = outcomes(cand_path)
    count = lambda d: {k: sum(1 for v in d.values() if v == k) for k in ("passed", "failed", "error", "skipped")}  # noqa: E731
    differ = {k: [base.get(k, "missing"), cand.get(k, "missing")] for k in sorted(set(base) | set(cand))
              if base.get(k) != cand.get(k)}
    bad = ("failed", "error", "missing")
    new_failures = [k for k, (b, c) in differ.items() if c in bad and b not in bad]
    failing = lambda d: sorted(k for k, v in d.items() if v in ("failed", "error"))  # noqa: E731
    return {
        "baseline": {"file": base_path, "seconds": base_s, **count(base), "failing": failing(base)},
        "candidate": {"file": cand_path, "seconds": cand_s, **count(cand), "failing": failing(cand)},
        "time_ratio": cand_s / base_s if base_s else None,
        "differ": differ,
        "new_failures": new_failures,
        "same_outcomes": not differ,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline")
    p.add_argument("candidate")
    p.add_argument("--json", help="write the comparison here")
    args = p.parse_args(argv)
    r = compare(args.baseline, args.candidate)
    for side in ("baseline", "candidate"):
        d = r[side]
        print(f"{side}: {d['passed']} passed, {d['failed']} failed, {d['error']} errors, "
              f"{d['skipped']} skipped in {d['seconds']:.1f} s ({d['file']})")
    print(f"time ratio candidate/baseline: {r['time_ratio']:.2f}" if r["time_ratio"] else "time ratio: n/a")
    for k, (b, c) in r["differ"].items():
        print(f"  {k}: {b} -> {c}")
    print("same outcomes" if r["same_outcomes"]
          else f"{len(r['differ'])} outcomes differ, {len(r['new_failures'])} new failures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 1 if r["new_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
