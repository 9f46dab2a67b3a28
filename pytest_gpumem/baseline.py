"""Budgets against an earlier run: ``--gpumem-compare=BASELINE.json`` with
``--gpumem-max-growth=10%``.

The baseline is the ``--gpumem-json`` report of an earlier run (the last
green CI run's, kept as an artifact). Each measured test is compared with
its own entry there, device by device: its peak (``peak_bytes_per_device``)
and, where both runs checked leaks, the bytes it leaked. A test whose peak
or leak grew by more than the allowed growth fails, and the message names
both numbers. Tests the baseline does not have, and baseline tests that did
not run, are listed at the end, never failed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from fractions import Fraction

import cupy_memstrat

from .report import JSON_VERSION

__all__ = ["Baseline", "Growth", "load_baseline", "parse_growth"]


_PERCENT = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*%$")
_MOST_PERCENT = 10**6


@dataclass(frozen=True)
class Growth:
    """The allowed growth: ``share`` (``Fraction(1, 10)`` for ``10%``) of
    the baseline's value, or ``bytes`` on top of it. Compared exactly."""

    share: Fraction | None = None
    bytes: int | None = None
    text: str = ""

    def exceeded(self, now: int, base: int) -> bool:
        """Whether ``now`` bytes grew more than allowed over ``base``."""
        if self.share is not None:
            return now > base * (1 + self.share)  # exact: Fraction
        return now > base + (self.bytes or 0)


def parse_growth(raw: str) -> Growth:
    """``"10%"`` (of the baseline's value; ASCII digits, at most 1000000%)
    or a size with a unit (``"1MiB"``, ``"512B"``: bytes on top of it).
    Raises ValueError for a negative, unparsable or unit-less value."""
    v = raw.strip()
    if v.endswith("%"):
        m = _PERCENT.match(v)
        if not m:
            why = "a growth of 0% or more" if v.lstrip().startswith("-") else "a growth such as '10%' or '1MiB'"
            raise ValueError(f"expected {why}, got {raw!r}")
        share = Fraction(m.group(1))
        if share > _MOST_PERCENT:
            raise ValueError(f"expected a growth of at most {_MOST_PERCENT}%, got {raw!r}")
        return Growth(share=share / 100, text=v)
    if v.startswith("-"):
        raise ValueError(f"expected a growth of 0 bytes or more, got {raw!r}")
    try:
        float(v)
    except ValueError:
        pass
    else:  # a bare number: a share or bytes?
        raise ValueError(f"{raw!r} has no unit: write '{v}%' for a share of the baseline's value or a size such "
                         "as '1MiB' or '512B' for bytes on top of it")
    try:
        n = cupy_memstrat.parse_size(v, what="growth")
    except (ValueError, TypeError):
        raise ValueError(f"expected a growth such as '10%' or '1MiB', got {raw!r}") from None
    return Growth(bytes=n, text=v)


@dataclass
class Baseline:
    """An earlier run's records by node id."""

    path: str
    tests: dict

    def compare(self, rec: dict, growth: Growth, fmt, source: str) -> tuple[dict | None, list[str]]:
        """``rec`` (this run's record of one test) against the baseline:
        ``(comparison for the JSON, or None if the baseline has no such test;
        problems, one message each)``; ``source`` names where the allowed
        growth came from."""
        base = self.tests.get(rec["nodeid"])
        if base is None:
            return None, []
        out = {"peak_bytes_per_device": base.get("peak_bytes_per_device"), "leaked_bytes": base.get("leaked_bytes")}
        problems = []
        now_peaks, base_peaks = rec.get("peak_bytes_per_device"), base.get("peak_bytes_per_device")
        if isinstance(now_peaks, list) and isinstance(base_peaks, list):
            out["devices_compared"] = min(len(now_peaks), len(base_peaks))
            for d, (now, was) in enumerate(zip(now_peaks, base_peaks)):
                if isinstance(now, int) and isinstance(was, int) and growth.exceeded(now, was):
                    on = f" on device {d}" if len(now_peaks) > 1 else ""
                    problems.append(f"peak {fmt(now)}{on} grew {self._by(now, was, fmt)} over the baseline's "
                                    f"{fmt(was)} ({was:,} B; {self.path}), more than the {growth.text} allowed "
                                    f"({source})")
        now_leak, was_leak = rec.get("leaked_bytes"), base.get("leaked_bytes")
        if isinstance(now_leak, int) and isinstance(was_leak, int) and growth.exceeded(now_leak, was_leak):
            problems.append(f"leak {fmt(now_leak)} grew {self._by(now_leak, was_leak, fmt)} over the baseline's "
                            f"{fmt(was_leak)} ({was_leak:,} B; {self.path}), more than the {growth.text} allowed "
                            f"({source})")
        return out, problems

    @staticmethod
    def _by(now: int, was: int, fmt) -> str:
        if not was:
            return f"by {fmt(now - was)} (from nothing)"
        return f"by {(now - was) / was:.2%} ({now - was:,} B)"


def load_baseline(path: str) -> Baseline:
    """Read a ``--gpumem-json`` report as a baseline.

    Raises:
        ValueError: the file is missing, not JSON, not a gpumem report, or
            from another version of the report (the message says which).
    """
    p = path.strip()
    if not p:
        raise ValueError("expected the path of an earlier --gpumem-json report, got an empty value")
    if not os.path.isfile(p):
        what = "does not exist" if not os.path.exists(p) else "is not a regular file"
        raise ValueError(f"the baseline {p!r} {what}; expected an earlier --gpumem-json report")
    try:
        with open(p) as f:
            doc = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"the baseline {p!r} is not a text file, so not a --gpumem-json report") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"cannot read the baseline {p!r}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), list) or "version" not in doc:
        raise ValueError(f"the baseline {p!r} is not a pytest --gpumem-json report (no 'version' and 'tests')")
    if type(doc["version"]) is not int:
        raise ValueError(f"the baseline {p!r} has version {doc['version']!r}, not a whole number: it is not a "
                         "--gpumem-json report")
    if doc["version"] != JSON_VERSION:
        raise ValueError(f"the baseline {p!r} is a version {doc['version']} report; this pytest_gpumem reads "
                         f"version {JSON_VERSION}: make the baseline again with this version")
    tests = {}
    for i, t in enumerate(doc["tests"]):
        if not isinstance(t, dict) or not isinstance(t.get("nodeid"), str):
            raise ValueError(f"the baseline {p!r}: tests[{i}] is not a test's record (no 'nodeid')")
        if t.get("measured", True) is False or t.get("peak_bytes_per_device") is None:
            continue  # not measured there: the test counts as new
        _check_record(p, t)
        tests[t["nodeid"]] = t
    return Baseline(path=p, tests=tests)


def _bytes(x) -> bool:
    return type(x) is int and 0 <= x < 1 << 64


def _check_record(path: str, t: dict) -> None:
    peaks = t["peak_bytes_per_device"]
    if not (isinstance(peaks, list) and peaks and all(_bytes(x) for x in peaks)):
        raise ValueError(f"the baseline {path!r}: the record of {t['nodeid']} has peak_bytes_per_device={peaks!r}: "
                         "expected a list of byte counts, one per device")
    leaked = t.get("leaked_bytes")
    if leaked is not None and not _bytes(leaked):
        raise ValueError(f"the baseline {path!r}: the record of {t['nodeid']} has leaked_bytes={leaked!r}: "
                         "expected a byte count or null")
