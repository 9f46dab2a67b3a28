"""The limits a measured test is judged by, one unit each: its marker's
arguments (where it has a marker) and its verdict on the test's call.

=============  =========================  ==================================
unit           marker                     fails the test when
=============  =========================  ==================================
budget         ``limit_gpu_memory``       its peak exceeds the budget
leaks          ``limit_gpu_leaks``        it leaves more than the limit
                                          allocated
checks         (``--gpumem-check``)       the checking layer found something
faults         ``limit_page_faults``      it causes more page faults or
                                          migrated bytes than given
fragmentation  ``limit_fragmentation``    its strategy reserved more than
                                          ratio x its peak in use + slack
growth         (``--gpumem-compare``)     its peak grew beyond the baseline's
=============  =========================  ==================================

The plugin's verdict (``pytest_gpumem.plugin``) asks each unit of
:data:`LIMITS` in this order; the problems they return, in that order, are
the lines of the failure, and their details the ``gpumem`` section of the
report. docs/pytest.md describes each limit.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any

import pytest

import cupy_memstrat

from .measure import describe
from .outside import LIBRARY_NAMES, plain, used_growth

__all__ = [
    "LIMITS",
    "MARKER_HELP",
    "OFF_WORDS",
    "Case",
    "GpuMemLeakWarning",
    "GpuMemUncheckedWarning",
    "Limit",
    "Problem",
    "FRAGMENTATION_SLACK",
    "limits_json",
    "parse_fragmentation",
    "marker_errors",
    "size_words",
    "warn_at_test",
]

fmt = cupy_memstrat.format_size

#: The words that switch a size setting or a marker's size off (``None``: no limit).
OFF_WORDS = ("off", "none", "no", "false")


class GpuMemLeakWarning(pytest.PytestWarning):
    """A test left GPU memory allocated (``--gpumem-leaks=warn``)."""


class GpuMemUncheckedWarning(pytest.PytestWarning):
    """Checks were asked for the session, and a test ran under a strategy of its own that the
    checks do not wrap (``cupy_memstrat.using()`` in the test or a fixture of the user's)."""


def warn_at_test(item, warning: Warning) -> None:
    """Warn, attributed to the test function's first line (so that pytest's
    warnings summary points at the test, not at this plugin).

    Raises:
        Warning: ``warning`` itself, where ``-W error`` makes it an error.
    """
    path, lineno = str(item.path), 0
    fn = getattr(item, "function", None)
    code = getattr(fn, "__code__", None)
    if code is not None:
        path, lineno = code.co_filename, code.co_firstlineno
    elif item.location and item.location[1] is not None:
        lineno = item.location[1] + 1
    module = getattr(getattr(item, "module", None), "__name__", None) or item.path.stem
    warnings.warn_explicit(warning, type(warning), path, lineno, module=module)


def size_words(value, text) -> str:
    """A size (bytes, or ``"N%"``) for a message: as the user wrote it where
    its unit differs from the one shown (``200MB (190.7 MiB)``), else
    formatted (``64.0 MiB``)."""
    if isinstance(value, str):  # "N%"
        return value
    shown = fmt(value)
    if text and text.lower().rstrip("s").lstrip("0123456789._ ") != shown.split(" ")[-1].lower():
        return f"{text} ({shown})"
    return shown


# -- markers' arguments ------------------------------------------------------------------


def _safe_repr(value, width: int = 200) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose __repr__ raises is still named
        return f"<{type(value).__name__} object>"
    return text if len(text) <= width else f"{text[:width - 20]}...({len(text)} characters)"


def _marker_error(marker, item, exc) -> pytest.UsageError:
    args = ", ".join([_safe_repr(a) for a in marker.args] + [f"{k}={_safe_repr(v)}" for k, v in marker.kwargs.items()])
    return pytest.UsageError(f"marker {marker.name}({args}) on {item.nodeid}: {exc}")


def _one_arg(marker, name: str, default=pytest):  # pytest: a sentinel for "required"
    args, kwargs = list(marker.args), dict(marker.kwargs)
    extra = sorted(set(kwargs) - {name})
    if extra:
        raise ValueError(f"unknown argument {extra[0]!r}; expected {name}")
    if len(args) > 1 or (args and name in kwargs):
        raise ValueError(f"expected one argument, {name}")
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    if default is pytest:
        raise ValueError(f"missing the {name} argument, e.g. {marker.name}('512MiB')")
    return default


def _marker_size(value, what: str, percent: bool):
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in OFF_WORDS:
        return None
    if percent and isinstance(value, str) and value.strip().endswith("%"):
        cupy_memstrat.parse_size(value, total=100, what=what)
        return value.strip()
    return cupy_memstrat.parse_size(value, what=what)


def _count(value, what: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected a whole number >= 0 or None, got {value!r}")
    return value


# -- the units ---------------------------------------------------------------------------


@dataclass
class Case:
    """What a unit judges: one measured test, after its teardown.

    ``state`` is the plugin's session state (``checks``,
    ``findings_since(window)``, ``baseline``, ``growth``, ``settings``);
    ``rec`` the test's record (JSON), which the units fill in; ``passed``
    whether the test passed so far (no failed report, not xfailed).
    """

    item: Any
    plan: Any
    window: Any
    meter: Any
    call: Any
    passed: bool
    rec: dict
    state: Any


@dataclass
class Problem:
    """A limit the test went over: ``kind`` names it in the verdict
    (``"budget"``...), ``messages`` are the lines of the failure (one per
    number over its limit), ``detail`` the text for the report's ``gpumem``
    section, or None."""

    kind: str
    messages: list
    detail: str | None = None


class Limit:
    """One limit: ``kind`` (its name in verdicts), ``marker`` (its marker's
    name, or None) and ``marker_help`` (the marker's line for ``pytest
    --markers``)."""

    kind = ""
    marker: str | None = None
    marker_help: str | None = None
    json_key: str | None = None  # its entry in the record's "limits"

    def parse(self, marker):
        """The marker's arguments, checked.

        Raises:
            ValueError: a bad argument (named in the message).
        """
        raise NotImplementedError

    def apply(self, plan, marker) -> None:
        """Make the closest ``marker`` of a test the plan's limit (after
        :meth:`parse` has accepted it)."""

    def as_json(self, plan) -> dict | None:
        """The limit as it applied to a test, with where it came from, or None."""
        return None

    def judge(self, case: Case) -> Problem | None:
        """The problem the test has with this limit, or None."""
        return None


class Budget(Limit):
    """The peak budget: ``--gpumem-budget`` or ``limit_gpu_memory(size)``
    (bytes, a size string, ``"N%"`` of each device's memory, or None)."""

    kind = "budget"
    marker = "limit_gpu_memory"
    marker_help = ("limit_gpu_memory(size): fail the test if its peak GPU memory exceeds size ('512MiB', '2GB', "
                   "'10%'; None: no budget for this test); overrides --gpumem-budget")
    json_key = "budget"

    def parse(self, marker):
        size = _one_arg(marker, "size")
        return _marker_size(size, "size", percent=True), (size.strip() if isinstance(size, str) else None)

    def apply(self, plan, marker) -> None:
        plan.budget, plan.budget_text = self.parse(marker)
        plan.budget_source = "limit_gpu_memory marker"

    def as_json(self, plan):
        if plan.budget is None:
            return None
        return {"value": plan.budget if isinstance(plan.budget, str) else int(plan.budget),
                "as_given": plan.budget_text, "source": plan.budget_source}

    @staticmethod
    def peaks(plan, meter, w) -> list:
        """The peaks the budget judges, per device: the strategy's peak in use, or with
        ``--gpumem-budget-reading=driver`` the driver-level peak (Meter.driver_peak)."""
        return meter.driver_peak(w) if plan.budget_reading == "driver" else w.peak

    @staticmethod
    def exceeded(plan, meter, w) -> bool:
        """Whether the window's peak went over the plan's budget on a device."""
        if plan.budget is None:
            return False
        peaks = Budget.peaks(plan, meter, w)
        return any(peaks[d] > meter.limit(plan.budget, d) for d in meter.devices)

    def judge(self, case):
        plan, meter, w, rec = case.plan, case.meter, case.window, case.rec
        if plan.budget is None:
            return None
        n = meter.n_devices
        peaks = self.peaks(plan, meter, w)
        peak_dev = max(range(n), key=lambda d: peaks[d]) if n else 0
        limits = [meter.limit(plan.budget, d) for d in meter.devices]
        rec["budget_bytes"] = limits[peak_dev] if n else None
        rec["budget_reading"] = plan.budget_reading
        over = [d for d in meter.devices if peaks[d] > limits[d]]
        if not over:
            return None
        d = max(over, key=lambda d: peaks[d] - limits[d])
        on = f" on device {d}" if n > 1 else ""
        share = f" = {plan.budget} of device {d}'s {fmt(meter.totals[d])}" if isinstance(plan.budget, str) else ""
        words = size_words(limits[d], None if share else plan.budget_text)
        what = "peak" if peaks is w.peak else "driver-level peak"
        msg = f"{what} {fmt(peaks[d])}{on} > budget {words}{share} ({plan.budget_source})"
        grown, source = _driver_growth(w, d)
        if peaks is not w.peak and peaks[d] > w.peak[d]:
            msg += (f"; through the strategy: peak in use {fmt(w.peak[d])}, peak reserved "
                    f"{fmt(w.peak_reserved[d])}; outside it, {_WHOSE[source]} grew by "
                    f"{fmt(grown)} by the end of the call")
        counts = (f"during the call: {w.n_allocs} allocation{'' if w.n_allocs == 1 else 's'}, "
                  f"{w.n_frees} free{'' if w.n_frees == 1 else 's'}; in use when it began: "
                  f"{fmt(sum(w.base))}")
        if w.top_live:
            detail = (counts + "\nlargest allocations made by the test and still live at the end "
                      "of its call:\n" + describe(w.top_live))
        elif peaks is not w.peak and peaks[d] > max(w.peak[d], w.peak_reserved[d]):
            detail = (counts + "\nthe peak is memory outside the strategy: a library that allocates on its own "
                      "(PyTorch, Numba, a raw cudaMalloc, another CuPy pool), or CUDA's own growth"
                      + _OTHERS[source] + " (docs/pytest.md, 'Memory outside the strategy')")
        elif w.n_allocs:
            detail = (counts + "\n(none of them was still live when the call returned; "
                      "gpumem.measure() blocks narrow the peak down)")
        else:
            detail = counts
        return Problem(self.kind, [msg], detail)


#: what the figures outside the strategy were read from (outside.used_growth's sources)
_WHOSE = {"process": "this process's memory, as NVML counts it,", "device": "the device's used memory",
          None: "the device's used memory"}
#: where the device's reading was used, the other processes on it move it too
_OTHERS = {"process": "", None: "",
           "device": ", or another process on the device (pytest-xdist's other workers, another job)"}


def _driver_growth(w, d) -> tuple[int, str | None]:
    """What the used memory grew by on device ``d`` during the call (bytes, at least 0), and
    its source."""
    if w.outside0 is None or w.outside1 is None:
        return 0, None
    growth, sources = used_growth(w.outside0, w.outside1)
    return max(0, growth[d]), sources[d]


def _whose(out: dict) -> str:
    sources = set(out.get("driver_source") or ())
    return _WHOSE["process" if sources == {"process"} else "device"]


def outside_lines(out: dict, tolerance: int) -> list[str]:
    """The report's lines on memory held outside the strategy (Meter.outside_now)."""
    lines = []
    for name, lib in out["libraries"].items():
        held = sum(lib["held"])
        if held and sum(lib["in_use"]):
            lines.append(f"  {fmt(held):>10}  held by {LIBRARY_NAMES.get(name, name)} for "
                         f"{fmt(sum(lib['in_use']))} still allocated there")
    sources = out.get("driver_source") or [None] * len(out["unexplained"])
    for d, n in enumerate(out["unexplained"]):
        if n > tolerance:
            lines.append(f"  {fmt(n):>10}  on device {d}, which no library the plugin reads explains: a raw "
                         "cudaMalloc, another CuPy memory pool, or a library's own cache" + _OTHERS[sources[d]]
                         + f" (the tolerance is {fmt(tolerance)}, --gpumem-outside-tolerance)")
    return lines


def _origins_from_history(leaked, history) -> list:
    """The leaked allocations with the origins a recording holds for them."""
    where = {}
    for _t, action, ptr, _size, device, _stream, origin in list(history.events):
        if action == "alloc" and origin is not None:
            where[(ptr, device)] = origin
    return [dataclasses.replace(a, origin=where[(a.ptr, a.device)]) if (a.ptr, a.device) in where else a
            for a in leaked]


class Leaks(Limit):
    """The leak check: ``--gpumem-leaks`` (off, warn, fail) or
    ``limit_gpu_leaks(size='0B')`` (fail above size bytes; None: off)."""

    kind = "leaks"
    marker = "limit_gpu_leaks"
    marker_help = ("limit_gpu_leaks(size='0B'): fail the test if it leaves more than size of GPU memory "
                   "allocated after it ends; overrides --gpumem-leaks")
    json_key = "leaks"

    def parse(self, marker):
        return _marker_size(_one_arg(marker, "size", "0B"), "size", percent=False)

    def apply(self, plan, marker) -> None:
        limit = self.parse(marker)
        if limit is None:
            plan.leaks, plan.leak_limit = "off", 0
        else:
            plan.leaks, plan.leak_limit = "fail", limit
        plan.leak_source = "limit_gpu_leaks marker"

    def as_json(self, plan):
        if plan.leaks == "off":
            return None
        return {"mode": plan.leaks, "limit_bytes": plan.leak_limit, "source": plan.leak_source}

    def judge(self, case):
        plan, meter, w, rec, item = case.plan, case.meter, case.window, case.rec, case.item
        if plan.leaks == "off":
            return None
        if not case.passed:
            rec["leak_check"] = "skipped: the test did not pass"
            return None
        leaked = meter.leaks(w)
        if w.history is not None and not any(a.origin for a in leaked):
            leaked = _origins_from_history(leaked, w.history)  # --gpumem-history knows where
        inside = sum(a.size for a in leaked)
        out = meter.outside_now(w, plan.outside_tolerance)
        outside = out["leaked_bytes"] if out is not None else 0
        total = inside + outside
        rec["leaked_bytes"], rec["leaked_count"] = total, len(leaked)
        rec["leaks"] = [
            {"size": a.size, "device": a.device, "ptr": a.ptr, "origin": str(a.origin) if a.origin else None}
            for a in leaked[:50]
        ]
        if out is not None:
            rec["leaked_outside_bytes"] = int(outside)
            rec["outside"] = plain({**{k: out[k] for k in ("driver_growth", "strategy_growth", "outside",
                                                          "libraries", "unexplained", "leaked", "by")},
                                    "tolerance": plan.outside_tolerance})
        if total <= plan.leak_limit:
            return None
        k = len(leaked)
        parts = []
        if k or not outside:
            parts.append(f"{k} allocation{'' if k == 1 else 's'}, {fmt(inside)}")
        if outside:
            by = ", ".join(f"{LIBRARY_NAMES.get(n, 'not explained by a library' if n == 'unexplained' else n)} "
                           f"{fmt(b)}" for n, b in out["by"].items())
            parts.append(f"{fmt(outside)} outside the strategy ({by})")
        msg = f"leaked {' and '.join(parts)} > limit {fmt(plan.leak_limit)} ({plan.leak_source})"
        listing = ""
        if leaked:
            listing = ("allocations made by the test and still live after its teardown and gc.collect(), "
                       "largest first:\n" + describe(leaked))
            if not any(a.origin for a in leaked):
                if w.strategy_name is not None:  # the test's own strategy (gpumem_strategy, using()):
                    # a recording cannot wrap it
                    how = (f"create the test's strategy with track_origins=True "
                           f"({w.strategy_name}:track_origins=true)")
                else:
                    how = (f"run with --gpumem-strategy={meter.strategy.name}:track_origins=true, or with "
                           "--gpumem-history and --gpumem-json")
                listing += f"\n  (where each was allocated: {how})"
        if outside:
            listing += ("\n" if listing else "") + (
                "GPU memory held outside the strategy after the teardown, gc.collect() and emptying the caches "
                f"({_whose(out)} grew by more than the strategy's reserve):\n"
                + "\n".join(outside_lines(out, plan.outside_tolerance)))
        if plan.leaks == "fail":
            return Problem(self.kind, [msg], listing)
        rec["verdict"] = "leak warning"
        try:
            warn_at_test(item, GpuMemLeakWarning(f"{item.nodeid}: {msg}\n{listing}"))
        except Warning:  # -W error: the warning is an error: fail the test
            return Problem(self.kind, [msg + " (GpuMemLeakWarning, an error under -W)"], listing)
        return None


class Findings(Limit):
    """The checking layer's findings: any finding during the test fails it.

    Judged for every test that ran under checks (``--gpumem-check``, a
    strategy spec with ``check=`` however given, the ``gpumem_strategy``
    fixture under either, a test's own checked strategy). A test whose own
    strategy the session's checks do not wrap gets ``"checked": false`` and
    a :class:`GpuMemUncheckedWarning`, never ``n_findings: 0``. Findings a
    test's own strategy with ``on_finding="raise"`` has not raised yet fail
    the test in any case."""

    kind = "checks"

    def judge(self, case):
        state, rec, call, w = case.state, case.rec, case.call, case.window
        found, pending = state.findings_since(w)
        checked = w.checked
        if checked is None and not pending:
            return None  # no check asked, none pending: nothing to say
        if checked is None:
            found = pending  # no session checks: findings of the test's own checked strategy, not delivered
        why, warn = None, False
        escaped = [i for i in w.installs if not i.checked or not state.checks <= i.checks]
        if checked and w.allocator_change is not None:  # checked until the test installed another allocator
            why = "the test changed CuPy's allocator during its call: what it allocated after that was not checked"
        elif checked and escaped:  # switched to a strategy of its own and back within the call
            names = ", ".join(sorted({repr(i.name) + (f" (checks {_words(i.checks)} only)" if i.checked else "")
                                      for i in escaped}))
            hows = " and ".join(sorted({f"cupy_memstrat.{i.how}()" for i in escaped}))
            why = (f"switched to strategy {names} during its call ({hows}), which the session's checks do not "
                   "wrap: what it allocated there was not checked with them (give it the session's checks, as in "
                   "cupy_memstrat.using('async', check='all'))")
            warn = True
        elif checked is False and w.allocator_change is None:
            why, warn = w.unchecked_why or self._unchecked_why(case), True
        if why is not None:
            checked = False
            rec["unchecked"] = why
        if checked is not None or state.checks:
            rec["checked"] = bool(checked)
        if checked:
            rec["checks"] = [c for c in cupy_memstrat.checks.CHECKS if c in getattr(case.meter.strategy, "checks", ())]
        if checked or found:
            rec["n_findings"] = len(found)
            rec["findings"] = [f.as_dict() for f in found[:20]]
        if warn:
            try:
                warn_at_test(case.item, GpuMemUncheckedWarning(f"{case.item.nodeid} {why}"))
            except Warning:  # -W error: the warning is an error: fail the test
                if not found:
                    return Problem(self.kind, [f"{why} (GpuMemUncheckedWarning, an error under -W)"])
        if w.check_error is not None:
            rec["check_error"] = w.check_error
            if call is not None:
                call.sections.append(("gpumem checks", w.check_error))
        if not found:
            return None
        k = len(found)
        kinds = ", ".join(sorted({f.kind for f in found}))
        text = "\n\n".join(str(f) for f in found[:10])
        if k > 10:
            text += f"\n\n... and {k - 10} more (--gpumem-json lists 20)"
        if not case.passed:  # the test failed anyway: the findings go with its report
            if call is not None:
                call.sections.append(("gpumem checks", text))
            return None
        return Problem(self.kind, [f"{k} check finding{'' if k == 1 else 's'} ({kinds}): {found[0].message}"], text)

    @staticmethod
    def _unchecked_why(case) -> str:
        """Why a test under a strategy of its own ran without the session's checks."""
        w, item = case.window, case.item
        own = case.meter.strategy
        if getattr(own, "checks", None) is not None:  # checked, with fewer checks than the session's
            return (f"ran under strategy {own.name!r} with checks {_words(own.checks)} only, fewer than the "
                    f"session's ({_words(case.state.checks)}): its memory was not checked with the others")
        if w.strategy_name is None:
            return (f"ran under strategy {case.meter.strategy.name!r}, which a test or fixture installed and the "
                    "session's checks could not wrap: its memory was not checked")
        if "gpumem_strategy" in getattr(item, "fixturenames", ()):
            return (f"ran under the gpumem_strategy fixture's strategy {w.strategy_name!r}, whose parameter turns "
                    "the checks off (check=off): its memory was not checked (drop check=off from the parameter)")
        return (f"ran under strategy {w.strategy_name!r} of its own (cupy_memstrat.using() in the test or a "
                "fixture), which the session's checks do not wrap: its memory was not checked (run it under the "
                "gpumem_strategy fixture, which takes the session's checks, or give it check=...)")


def _words(checks) -> str:
    return ",".join(c for c in cupy_memstrat.checks.CHECKS if c in checks)


class Faults(Limit):
    """The page-fault budget: ``limit_page_faults(gpu=None, cpu=None,
    migrated=None)`` (counts of GPU and CPU page faults, bytes migrated both
    ways; None: no limit)."""

    kind = "faults"
    marker = "limit_page_faults"
    marker_help = ("limit_page_faults(gpu=None, cpu=None, migrated=None): fail the test if it causes more GPU "
                   "page faults, CPU page faults or migrated bytes than given (skipped or failed where no "
                   "counter exists, per --gpumem-faults-missing)")
    json_key = "page_faults"

    def parse(self, marker):
        """The limits of a limit_page_faults marker; every bad argument named at once."""
        problems, limits = [], {}
        if marker.args:
            problems.append("takes keyword arguments only: gpu=, cpu=, migrated=")
        for k in sorted(set(marker.kwargs) - {"gpu", "cpu", "migrated"}):
            problems.append(f"unknown argument {k!r}; expected gpu, cpu, migrated")
        for key, parse in (("gpu", lambda v: _count(v, "gpu")), ("cpu", lambda v: _count(v, "cpu")),
                           ("migrated", lambda v: _marker_size(v, "migrated", percent=False))):
            try:
                limits[key] = parse(marker.kwargs.get(key))
            except Exception as exc:  # noqa: BLE001 - any bad value (an __index__ that raises) is the user's
                problems.append(str(exc))
        if problems:
            raise ValueError("; ".join(problems))
        return {k: v for k, v in limits.items() if v is not None}

    def apply(self, plan, marker) -> None:
        plan.fault_limits = self.parse(marker)
        plan.faults = True
        plan.fault_source = "limit_page_faults marker"

    def as_json(self, plan):
        if not plan.fault_limits:
            return None
        return dict(plan.fault_limits, source=plan.fault_source)

    def judge(self, case):
        plan, f = case.plan, case.window.faults
        if not plan.fault_limits or f is None:
            return None
        src = f"{f.source} counters" + ("" if f.exact else ", lower bounds")
        actual = {"gpu": f.gpu_faults, "cpu": f.cpu_faults, "migrated": f.bytes_htod + f.bytes_dtoh}
        words = {"gpu": "GPU page faults", "cpu": "CPU page faults"}
        messages = []
        for key, limit in plan.fault_limits.items():
            if actual[key] > limit:
                if key == "migrated":
                    text = f"migrated {fmt(actual[key])} > limit {fmt(limit)}"
                else:
                    text = f"{actual[key]} {words[key]} > limit {limit}"
                messages.append(f"{text} ({plan.fault_source}; {src})")
        if not messages:
            return None
        return Problem(self.kind, messages, f"page faults during the call: {f}")


#: The reserve a test may take beyond ratio x its peak in use when no slack is given: one
#: growth step of the stream-ordered pool, which reserves device memory in 32 MiB steps
#: (measured on the H100 and H200); managed memory grows in 2 MiB chunks.
FRAGMENTATION_SLACK = 32 << 20


_RATIO_TEXT = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def _ratio(value, what: str) -> float:
    """A fragmentation ratio: a finite number >= 1 (an int, a float or its text)."""
    if isinstance(value, (bool, bytes, bytearray)):
        raise ValueError(f"{what}: expected a number >= 1 such as 1.5, got {value!r:.60}")
    if isinstance(value, str) and not _RATIO_TEXT.fullmatch(value.strip()):
        # float() would take "1_5", "1e0", "inf" and other scripts' digits
        raise ValueError(f"{what}: expected a number >= 1 such as 1.5 (ASCII digits), got {value!r:.60}")
    try:
        r = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what}: expected a number >= 1 such as 1.5, got {value!r:.60}") from None
    if not (r == r and r != float("inf")) or r < 1:  # NaN, infinity, below 1
        raise ValueError(f"{what}: expected a finite number >= 1 (reserved memory is never below the memory in "
                         f"use), got {value!r:.60}")
    return r


def parse_fragmentation(raw: str):
    """``--gpumem-max-fragmentation``'s value: ``None`` (``off``) or ``(ratio, slack_bytes)`` from
    ``"RATIO"`` or ``"RATIO+SLACK"`` (``"1.5"``, ``"1.25+64MiB"``; the slack defaults to
    :data:`FRAGMENTATION_SLACK`).

    Raises:
        ValueError: a bad ratio or slack, named.
    """
    v = raw.strip()
    if v.lower() in OFF_WORDS:
        return None
    ratio, plus, slack = v.partition("+")
    if not ratio.strip() or (plus and not slack.strip()):
        raise ValueError(f"expected RATIO or RATIO+SLACK such as 1.5 or 1.5+64MiB, got {raw!r}")
    return (_ratio(ratio, "ratio"), _slack(slack) if plus else FRAGMENTATION_SLACK)


def _slack(value) -> int:
    """The slack of a fragmentation limit: a size in bytes or units (a percentage has no total
    to be a percentage of)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        raise ValueError(f"slack: expected a size such as 64MiB, got {value!r} (a percentage of what is in use "
                         "is what the ratio says: raise the ratio instead)")
    try:
        return cupy_memstrat.parse_size(value, what="slack")
    except ValueError as exc:
        raise ValueError(str(exc).replace(", or a percentage such as '80%'", "")) from None


class Fragmentation(Limit):
    """Reserved memory against memory in use: ``--gpumem-max-fragmentation=RATIO[+SLACK]`` or
    ``limit_fragmentation(ratio, slack='32MiB')``. A test fails when, on a device, the memory
    its strategy reserved during the call (on top of what it held when the call began) exceeds
    ``ratio`` x the test's peak in use (on top likewise) + ``slack``. The plugin gives the
    strategy's cached memory back to CUDA (``Strategy.trim()``) before each such test's call, so
    that the verdict does not depend on the tests that ran before it."""

    kind = "fragmentation"
    marker = "limit_fragmentation"
    marker_help = ("limit_fragmentation(ratio, slack='32MiB'): fail the test if the GPU memory its strategy "
                   "reserved during it exceeds ratio x its peak in use + slack (None: no limit for this test); "
                   "overrides --gpumem-max-fragmentation")
    json_key = "fragmentation"

    def parse(self, marker):
        args, kwargs = list(marker.args), dict(marker.kwargs)
        extra = sorted(set(kwargs) - {"ratio", "slack"})
        if extra:
            raise ValueError(f"unknown argument {extra[0]!r}; expected ratio, slack")
        if args and "ratio" in kwargs:
            raise ValueError(f"the ratio given twice: {args[0]!r} and ratio={kwargs['ratio']!r}")
        if len(args) > 1 and "slack" in kwargs:
            raise ValueError(f"the slack given twice: {args[1]!r} and slack={kwargs['slack']!r}")
        if len(args) > 2:
            raise ValueError(f"expected at most two arguments, ratio and slack, got {len(args)}")
        if not args and "ratio" not in kwargs:
            raise ValueError("missing the ratio argument, e.g. limit_fragmentation(1.5)")
        ratio = args[0] if args else kwargs["ratio"]
        slack = args[1] if len(args) > 1 else kwargs.get("slack")
        if ratio is None or (isinstance(ratio, str) and ratio.strip().lower() in OFF_WORDS):
            if slack is not None:
                raise ValueError(f"slack={slack!r} given with no ratio; give a ratio such as 1.5")
            return None
        if isinstance(ratio, str) and "+" in ratio:  # the command line's form, "1.5+64MiB"
            if slack is not None:
                raise ValueError(f"the slack given twice: in {ratio!r} and as {slack!r}")
            return parse_fragmentation(ratio)
        return (_ratio(ratio, "ratio"), FRAGMENTATION_SLACK if slack is None else _slack(slack))

    def apply(self, plan, marker) -> None:
        plan.fragmentation = self.parse(marker)
        plan.fragmentation_source = "limit_fragmentation marker"

    def as_json(self, plan):
        if plan.fragmentation is None:
            return None
        ratio, slack = plan.fragmentation
        return {"ratio": ratio, "slack_bytes": slack, "source": plan.fragmentation_source}

    def judge(self, case):
        plan, meter, w, rec = case.plan, case.meter, case.window, case.rec
        if plan.fragmentation is None or not w.peak_reserved:
            return None
        ratio, slack = plan.fragmentation
        top = max(meter.devices, key=lambda d: w.peak_reserved[d], default=0)
        rec["reserved_over_in_use"] = round(w.peak_reserved[top] / w.peak[top], 3) if w.peak[top] else None
        over = [d for d in meter.devices if w.peak_reserved[d] > ratio * w.peak[d] + slack]
        if not over:
            return None
        d = max(over, key=lambda d: w.peak_reserved[d] - ratio * w.peak[d])
        on = f" on device {d}" if meter.n_devices > 1 else ""
        times = f"{w.peak_reserved[d] / w.peak[d]:.2f}x" if w.peak[d] else "with nothing in use"
        msg = (f"reserved {fmt(w.peak_reserved[d])}{on} for a peak in use of {fmt(w.peak[d])} ({times}) > "
               f"{ratio:g}x + {fmt(slack)} ({plan.fragmentation_source})")
        st = meter.strategy.stats(d)
        detail = (f"strategy {meter.strategy.name!r} at the end of the call: {st.fragmentation()}\n"
                  "(reserved and in use are counted on top of what the strategy held when the call began; "
                  "python -m cupy_memstrat replay compares strategies on the test's own allocations, recorded "
                  "with --gpumem-history --gpumem-history-keep=all)")
        return Problem(self.kind, [msg], detail)


class Growth(Limit):
    """Growth over a baseline: ``--gpumem-compare=BASELINE.json`` with
    ``--gpumem-max-growth`` (default 10%)."""

    kind = "growth"

    def judge(self, case):
        state, rec = case.state, case.rec
        if state.baseline is None or not case.passed or rec.get("peak_bytes_per_device") is None:
            return None
        where = state.settings.source("max_growth")
        comparison, grown = state.baseline.compare(rec, state.growth, fmt, where or "the default")
        rec["baseline"] = comparison  # None: a test the baseline does not have
        rec["limits"]["growth"] = {"max_growth": state.growth.text, "baseline": state.baseline.path,
                                   "source": where or "default"}
        if not grown:
            return None
        return Problem(self.kind, list(grown))


BUDGET, LEAKS, FINDINGS, FAULTS, FRAGMENTATION, GROWTH = (Budget(), Leaks(), Findings(), Faults(),
                                                         Fragmentation(), Growth())

#: The units, in the order a test is judged (and its failure's lines are written).
LIMITS = (BUDGET, LEAKS, FINDINGS, FAULTS, FRAGMENTATION, GROWTH)


def limits_json(plan) -> dict:
    """Each limit that applied to a test, with where it came from (the
    record's ``"limits"``: ``budget``, ``leaks``, ``page_faults``, ``fragmentation``)."""
    out = {}
    for unit in LIMITS:
        entry = unit.as_json(plan)
        if entry is not None:
            out[unit.json_key] = entry
    return out


#: The markers' lines for ``pytest --markers``.
MARKER_HELP = tuple(u.marker_help for u in LIMITS if u.marker) + (
    "gpumem_skip: do not measure or check this test's GPU memory",
)


def marker_errors(item) -> list[str]:
    """Every bad gpumem marker on ``item``, one message each: all of them, the
    class's and module's too, also where a closer marker or ``gpumem_skip``
    means it would not apply."""
    errors = []
    for unit in LIMITS:
        if unit.marker is None:
            continue
        for m in item.iter_markers(unit.marker):
            try:
                unit.parse(m)
            except Exception as exc:  # noqa: BLE001 - a bad value, whatever it raises, is a usage error
                errors.append(str(_marker_error(m, item, exc)))
    return errors
