"""The plugin's session state: the strategy measured through (installed,
adopted, followed when a test replaces CuPy's allocator), and each measured
test's record and verdict, judged by the units of ``limits.py``. The hooks
that drive it are in ``plugin.py``; docs/pytest.md describes what they do.
"""

from __future__ import annotations

import os
from fractions import Fraction

import pytest

import cupy_memstrat
from cupy_memstrat import checks as _checks

from . import baseline as _baseline
from . import report as _report
from .limits import LIMITS, Case, limits_json, warn_at_test
from .outside import plain, used_growth
from .measure import Meter

__all__ = ["GpuMemAllocatorWarning", "State", "METER", "NOTICE", "OOM_SNAPSHOT", "FOREIGN", "is_xdist_controller"]

METER = pytest.StashKey[object]()  # the meter a test's call was measured through
NOTICE = pytest.StashKey[str]()  # an allocator change found before the test (pytest-xdist's summary)
OOM_SNAPSHOT = pytest.StashKey[str]()  # the file an out-of-memory error of the call wrote (oom_snapshot)
FOREIGN = pytest.StashKey[str]()  # the test runs inside using_allocator() of an allocator not a strategy


class GpuMemAllocatorWarning(pytest.PytestWarning):
    """A test or fixture replaced CuPy's allocator during the session."""


class State:
    """The session's plugin state (``config.stash``)."""

    def __init__(self, config, settings):
        self.config = config
        self.settings = settings
        self.worker = os.environ.get("PYTEST_XDIST_WORKER") if hasattr(config, "workerinput") else None
        self.controller = is_xdist_controller(config)
        self.strategy = None
        self.meter: Meter | None = None
        self.installed = False
        self.previous = None
        self.why_off: str | None = None
        self.tried = False
        self.records: list[dict] = []
        self.machine: dict | None = None
        self.machine_sent = False
        self.remote_strategy = None  # under pytest-xdist: the workers' strategy, from their first record
        self.n_unmeasured = 0  # tests that asked for measuring while it was off
        self._expected_allocator = None  # CuPy's allocator as the plugin installed or adopted it
        self.allocator_changes: list[str] = []
        self.usage_error: str | None = None  # a pytest-xdist worker's usage error: its tests error with it
        self.initial_strategy = None  # the session's strategy as first installed (the table's title)
        self.n_histories = 0  # timelines recorded for failing tests (--gpumem-history)
        self.checks = settings.checks_asked  # the checks asked for the session (option or strategy spec)
        self.checks_source: str | None = None  # where the checks came from, when not from a setting
        self._suspended = None  # (strategy, meter) while CuPy's allocator is not a strategy (resume_if_restored)
        self.json_skipped: str | None = None  # why the JSON report was not written (--collect-only)
        self.baseline = _baseline.load_baseline(settings.compare) if settings.compare else None
        self.growth = settings.max_growth or _baseline.Growth(share=Fraction(1, 10), text="10%")

    # -- the strategy ----------------------------------------------------------------
    def activate(self) -> None:
        """Install (or adopt) the strategy to measure through; on failure
        remember why measuring is off."""
        if self.tried:
            return
        self.tried = True
        spec = self.settings.strategy
        try:
            import cupy
        except ImportError:
            self.why_off = "CuPy is not installed (pip install 'cupy-memstrat[cuda13]' or [cuda12])"
            return
        try:
            current = None if spec else cupy_memstrat.current()
            checks = self.settings.check
            extra = {"check": _check_words(checks), "on_finding": "record"} if checks else {}
            spec_checks = self.settings.values.get("spec_check")
            if spec and spec_checks:
                if checks:
                    s = self.settings
                    raise pytest.UsageError(
                        f"checks given in two places: {s.source('check')}={s.text('check')!r} and the check= of "
                        f"{s.source('strategy')}={spec!r}; give them in one place"
                    )
                if self.settings.source("check") is not None:  # --gpumem-check=off: the spec's checks go
                    spec = _without_checks(spec)
                else:  # the plugin reports findings per test: record them unless the spec says otherwise
                    extra = {} if "on_finding" in cupy_memstrat.parse_spec(spec)[1] else {"on_finding": "record"}
            if current is not None and (not checks or isinstance(current, _checks.CheckedStrategy)):
                self.strategy = current  # a strategy the session installed (conftest): measured as it is
                if isinstance(current, _checks.CheckedStrategy) and not self.checks:
                    self.checks = frozenset(current.checks)  # its checks are the session's
                    self.checks_source = "the checked strategy installed before the session"
            else:
                previous = cupy.cuda.get_allocator()
                self.strategy = cupy_memstrat.use(current if current is not None else (spec or "pool"), **extra)
                self.previous, self.installed = previous, True
            self.meter = self._new_meter(self.strategy)
            self.initial_strategy = self.strategy
            self._expected_allocator = cupy.cuda.get_allocator()
        except (cupy_memstrat.NoDeviceError, cupy_memstrat.CuPyNotInstalledError, RuntimeError) as exc:
            self.why_off = str(exc)
            self.strategy = self.meter = None
        except (ValueError, pytest.UsageError) as exc:  # a bad CUPY_MEMSTRAT_BACKEND, an option the device
            where = self.settings.source("strategy")   # refuses, checks given twice
            named = isinstance(exc, pytest.UsageError) or not (spec and where) or str(exc).startswith(where)
            msg = str(exc) if named else f"{where}={spec!r}: {exc}"
            self.strategy = self.meter = None
            if self.worker is not None:
                # A pytest-xdist worker that raised here would crash, be replaced and crash again:
                # each of its tests errors with the message instead (docs/pytest.md)
                self.usage_error, self.why_off = msg, msg
                return
            raise pytest.UsageError(msg) from None

    def adopt_conftest_checks(self) -> None:
        """Before the tests are planned: a checked strategy that conftest.py installed (and no
        --gpumem-check given) makes its checks the session's, so every test is measured and
        judged by them, as checks given in a setting are."""
        import sys

        s = self.settings
        if s.source("check") is not None or s.values.get("spec_check") or s.values.get("adopted_check"):
            return
        if self.tried:
            current = self.strategy
        else:
            current = cupy_memstrat.current() if "cupy" in sys.modules else None
        if isinstance(current, _checks.CheckedStrategy):
            s.values["adopted_check"] = frozenset(current.checks)
            self.checks = frozenset(current.checks)
            self.checks_source = "the checked strategy installed before the session"

    def follow_allocator(self, item) -> None:
        """Before a measured call: if a test or fixture replaced CuPy's
        allocator (``cupy_memstrat.use``, ``cupy.cuda.set_allocator``), measure
        through the new strategy, or, if it is not a cupy_memstrat strategy,
        stop measuring; either way say so once.

        Returns ``(meter, strategy)`` for this call: a test that runs inside
        ``cupy_memstrat.using()`` (the ``gpumem_strategy`` fixture does that)
        is measured through that strategy, for this test only and without a
        warning; the session's strategy stays as it is."""
        import cupy

        local = getattr(cupy.cuda.memory, "_get_thread_local_allocator", lambda: None)()
        if local is not None:
            new = cupy_memstrat.current()
            if new is not None and new is not self.strategy:
                return self._new_meter(new), new
            if new is None:  # cupy.cuda.using_allocator() of CuPy's own allocator, for this test only
                item.stash[FOREIGN] = (
                    f"ran inside cupy.cuda.using_allocator() of {_describe(local, cupy)}, which is not a "
                    "cupy_memstrat strategy: what it allocated there was neither measured nor checked")
                return self.meter, self.strategy
        if cupy.cuda.get_allocator() is self._expected_allocator:
            return self.meter, self.strategy
        msg, as_error = self.adopt_allocator(item, "before")
        if as_error:  # fail the test cleanly: no plugin traceback, no chained warning
            pytest.fail(f"gpumem: {msg} (GpuMemAllocatorWarning, an error under -W)", pytrace=False)
        return self.meter, self.strategy

    def allocator_changed(self) -> bool:
        """Whether CuPy's process-wide allocator is not the one measured through."""
        import cupy

        return self._expected_allocator is not None and cupy.cuda.get_allocator() is not self._expected_allocator

    def adopt_allocator(self, item, when: str):
        """CuPy's allocator was replaced ``before`` or ``during`` ``item``:
        measure through the new strategy from here on, or, if it is not a
        cupy_memstrat strategy, stop measuring; say so once, with a
        ``GpuMemAllocatorWarning`` at the test's line. Returns ``(message or
        None, whether -W made the warning an error)``."""
        import cupy

        new = cupy_memstrat.current()
        if new is self.strategy:  # the same strategy, installed again
            self._expected_allocator = cupy.cuda.get_allocator()
            return None, False
        what = "before" if when == "before" else "during"
        if new is not None:
            same = self.strategy is not None and new.name == self.strategy.name
            msg = (f"CuPy's allocator changed {what} {item.nodeid} to "
                   f"{'another ' if same else ''}strategy {new.name!r}{' object' if same else ''} "
                   f"(cupy_memstrat.use in a test or fixture); gpumem measures through it from here on")
            if self.checks and isinstance(new, _checks.CheckedStrategy) and not self.checks <= set(new.checks):
                msg += (f", whose checks ({_check_words(new.checks)}) are fewer than the session's "
                        f"({_check_words(self.checks)}): the tests from here on are reported unchecked")
            elif self.checks and not isinstance(new, _checks.CheckedStrategy):
                carried = self._with_session_checks(new)
                if carried is not None:
                    new = carried
                    msg += (f", with the session's checks ({_check_words(self.checks)}) around it: "
                            "cupy_memstrat.current() is now the checking layer over it")
                else:
                    msg += f", without the session's checks ({_check_words(self.checks)}): they cannot wrap it"
            self.strategy, self.meter = new, self._new_meter(new)
            self._expected_allocator = cupy.cuda.get_allocator()
        else:
            msg = (f"CuPy's allocator changed {what} {item.nodeid} to {_describe_allocator(cupy)}, "
                   "which is not a cupy_memstrat strategy: gpumem cannot measure through it, and the "
                   "tests from here on are not measured until the session's strategy is CuPy's allocator "
                   "again (install strategies with cupy_memstrat.use, or restore CuPy's allocator at the "
                   "end of the test)")
            self.why_off = msg
            self._suspended = (self.strategy, self.meter)
            self.strategy = self.meter = None
        self.allocator_changes.append(msg)
        try:
            warn_at_test(item, GpuMemAllocatorWarning(msg))
            return msg, False
        except Warning:  # -W error: the warning is an error
            return msg, True

    def resume_if_restored(self, item) -> None:
        """Measuring stopped when CuPy's allocator became one that is not a cupy_memstrat
        strategy; if the session's strategy is CuPy's allocator again (a fixture restored it),
        measure and check through it again, and say so once."""
        import cupy

        suspended = self._suspended
        if suspended is None or suspended[0] is None or cupy.cuda.get_allocator() is not self._expected_allocator:
            return
        self.strategy, self.meter = suspended
        self._suspended, self.why_off = None, None
        msg = (f"CuPy's allocator is strategy {self.strategy.name!r} again before {item.nodeid}: gpumem "
               "measures (and checks) through it again")
        self.allocator_changes.append(msg)

    def _with_session_checks(self, strategy):
        """``strategy`` (installed by a test or fixture) wrapped in the session's checks and
        installed as CuPy's allocator in its place, or None where it cannot be (CuPy forbids
        changing the allocator inside ``using_allocator``). The checks record their findings
        for the verdict, as the session's own do."""
        try:
            return cupy_memstrat.use(strategy, check=",".join(sorted(self.checks)), on_finding="record")
        except (RuntimeError, ValueError, TypeError):
            return None

    def checked_state(self, strategy) -> bool | None:
        """Whether a test measured through ``strategy`` runs under cupy_memstrat's checks: True
        (its strategy is checked), False (checks were asked for the session, and the test's
        own strategy is not checked) or None (no check asked anywhere)."""
        if isinstance(strategy, _checks.CheckedStrategy):
            return self.checks <= set(strategy.checks)  # fewer checks than the session asked: unchecked
        return False if self.checks else None

    def restore(self) -> None:
        if self.installed:
            import cupy

            cupy.cuda.set_allocator(self.previous)  # what was there before the session
            self.installed = False

    def _new_meter(self, strategy) -> Meter:
        """A meter over ``strategy`` with the session's driver-reading settings."""
        return Meter(strategy, outside=self.settings.outside, sample_interval=self.settings.driver_sample)

    def fault_unavailable(self) -> str | None:
        """Why page faults cannot be counted here, or None."""
        if self.meter is None:
            return f"GPU measurement is off: {self.why_off or 'no GPU'}"
        try:
            self.meter.fault_counter()
        except cupy_memstrat.FaultCountersUnavailable as exc:
            return str(exc)
        return None

    # -- verdicts ------------------------------------------------------------------------
    def verdict(self, item, plan, w, reports) -> None:
        meter = item.stash[METER]  # the one its call was measured through
        n = meter.n_devices
        call = next((r for r in reports if r.when == "call"), None)
        not_passed = call is None or not call.passed or any(r.failed for r in reports) or hasattr(call, "wasxfail")
        peak_dev = max(range(n), key=lambda d: w.peak[d]) if n else 0
        rec = {
            "nodeid": item.nodeid,
            "peak_bytes": w.peak[peak_dev] if n else 0,
            "peak_device": peak_dev,
            "peak_bytes_per_device": list(w.peak),
            "peak_reserved_bytes": max(w.peak_reserved, default=0),
            "peak_reserved_bytes_per_device": list(w.peak_reserved),
            "in_use_before_bytes": sum(w.base),
            "allocated": w.n_allocs,
            "freed": w.n_frees,
            "budget_bytes": None,
            "leak_check": plan.leaks,
            "leaked_bytes": None,
            "leaked_count": None,
            "leaks": [],
            "faults": w.faults.as_dict() if w.faults is not None else None,
            "fault_limits": plan.fault_limits,
            "limits": limits_json(plan),
            "verdict": None,
            "worker": self.worker,
            "duration": getattr(call, "duration", None),
        }
        if w.outside0 is not None and w.outside1 is not None:
            # the driver's reading beside the strategy's count (--gpumem-outside)
            rec["driver_used_before_bytes_per_device"] = plain(w.outside0.driver_used)
            rec["driver_used_after_bytes_per_device"] = plain(w.outside1.driver_used)
            rec["process_used_before_bytes_per_device"] = plain(w.outside0.process_used)
            rec["process_used_after_bytes_per_device"] = plain(w.outside1.process_used)
            growth, source = used_growth(w.outside0, w.outside1)
            rec["driver_source_per_device"] = source  # "process" (NVML's count of this process) or "device"
            rec["driver_peak_bytes_per_device"] = plain(meter.driver_peak(w))
            if w.sampler is not None:
                rec["driver_readings"] = w.sampler.n_readings  # during the call (--gpumem-driver-sample)
            rec["outside_bytes_per_device"] = [
                max(0, g - (r1 - r0)) if src is not None else None
                for g, src, r0, r1 in zip(plain(growth), source, plain(w.outside0.reserved),
                                          plain(w.outside1.reserved))]
        problems, details = [], []
        change, change_is_error = getattr(w, "allocator_change", None) or (None, False)
        notice = item.stash.get(NOTICE, None)
        if notice is not None:
            rec["allocator_notice"] = notice
        if change is not None:
            # its allocations after the change went to another allocator: its numbers are not the
            # test's, and no budget or leak verdict is given on them
            rec["measured"] = False
            rec["allocator_change"] = change
            if plan.leaks != "off":
                rec["leak_check"] = "skipped: the test changed CuPy's allocator"
            for key in ("peak_bytes", "peak_device", "allocated", "freed", "peak_reserved_bytes"):
                rec[key] = None  # not the test's numbers
            rec["peak_bytes_per_device"] = rec["peak_reserved_bytes_per_device"] = None
            plan = _unchecked(plan)
            if change_is_error:
                problems.append(("allocator", f"gpumem: {change} (GpuMemAllocatorWarning, an error under -W)"))
        case = Case(item, plan, w, meter, call, not not_passed, rec, self)
        for unit in LIMITS:  # limits.py: budget, leaks, checks, faults, fragmentation, growth
            problem = unit.judge(case)
            if problem is not None:
                problems.extend((problem.kind, m) for m in problem.messages)
                if problem.detail is not None:
                    details.append(problem.detail)
        if problems and not not_passed:
            kinds = sorted({k for k, _ in problems})
            rec["verdict"] = "+".join(kinds)
            call.outcome = "failed"
            call.longrepr = "\n".join(m for _, m in problems)
            if details:
                call.sections.append(("gpumem", "\n\n".join(details)))
            call.gpumem_failed = rec["verdict"]
        rec["outcome"] = _outcome(reports)
        failing = rec["outcome"] in ("failed", "error")
        snap = item.stash.get(OOM_SNAPSHOT, None)
        if snap is not None:
            rec["oom_snapshot"] = snap
            if call is not None and call.failed:
                call.sections.append(("gpumem", (
                    f"out of memory: the strategy wrote the memory at the error to {snap}\n"
                    f"  python -m cupy_memstrat export {snap} -o oom.pickle   (for PyTorch's memory viewer)")))
        if w.history is not None and (failing or self.settings.history_keep == "all"):
            # the timeline of a failing test, or of every test (--gpumem-history, --gpumem-history-keep)
            rec["history"] = w.history.as_dict()
            self.n_histories += 1
        if w.history_error is not None and failing:
            rec["history_error"] = f"not recorded: {w.history_error}"
        if w.strategy_name is not None:
            rec["strategy"] = w.strategy_name  # measured through the test's own strategy (using())
        props = _report.user_properties(rec)
        item.user_properties.extend(props)
        for r in reports:
            r.user_properties.extend(props)
        if not self.machine_sent:
            rec["machine"] = meter.machine()
            rec["strategy_info"] = self._strategy_info()  # the controller under xdist installs none
            self.machine_sent = True
        reports[-1].gpumem = rec

    def findings_since(self, w) -> tuple[list, list]:
        """``(every finding since w opened, the findings not yet delivered)`` after finishing
        every pending check (quarantine, queued kernels). Not yet delivered: found by a checked
        strategy with ``on_finding="raise"`` (a test's own) and not raised to the test yet."""
        pending = []
        try:
            _checks.collect()
        except _checks.CheckError as exc:
            pending = list(exc.findings)
        except Exception as exc:  # noqa: BLE001 - a GPU left unusable by the test: judge what was found
            w.check_error = f"the checks' pending work could not be finished: {type(exc).__name__}: {exc}"
        return _checks.findings(since=w.check_start), pending

    def _strategy_info(self):
        s = self.initial_strategy or self.strategy  # the session's; a test's other one is on its row
        if s is None:
            return None
        return {"name": s.name,
                "options": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                            for k, v in s.config.items()}}

    def info(self) -> dict:
        s = self.settings
        strategy = self._strategy_info() or self.remote_strategy
        return {
            "strategy": strategy,
            "strategy_spec": s.strategy,
            "settings": {k: s.values[k] for k in ("budget", "budget_reading", "leaks", "outside", "outside_tolerance",
                                                  "faults", "faults_missing")}
            | {"driver_sample_ms": round(s.driver_sample * 1000), "measure": s.measuring,
               "check": sorted(self.checks), "stream_policy": s.stream_policy,
               "history": s.history,
               "max_fragmentation": (None if s.max_fragmentation is None else
                                     {"ratio": s.max_fragmentation[0], "slack_bytes": s.max_fragmentation[1]})},
            "baseline": s.compare,
            "max_growth": self.growth.text if s.compare else None,
            "setting_sources": {k: v for k, v in s.sources.items() if v is not None},
            "setting_texts": dict(s.texts),
            "packages": _package_versions(),
            "machine": self.machine,
            "measuring_off": self.why_off,
        }


def _check_words(checks) -> str:
    """The checks in their documented order: ``streams,poison,redzone``."""
    return ",".join(c for c in _checks.CHECKS if c in checks)


def _without_checks(spec: str) -> str:
    """``spec`` without the checking layer's options (``async:check=all,release_threshold=1GiB``
    -> ``async:release_threshold=1GiB``)."""
    name, options = cupy_memstrat.parse_spec(spec)
    kept = [f"{k}={v}" for k, v in options.items() if k not in _checks.OPTION_NAMES]
    return name + (":" + ",".join(kept) if kept else "")


def _describe(allocator, cupy) -> str:
    owner = getattr(allocator, "__self__", None)
    if owner is cupy.get_default_memory_pool():
        return "CuPy's default memory pool"
    if getattr(allocator, "__name__", "") == "_malloc":
        return "plain cudaMalloc (cupy.cuda.memory._malloc)"
    return repr(allocator)


def _unchecked(plan):
    """The plan without the budget, leak and fragmentation checks (a test whose allocator changed)."""
    import dataclasses

    return dataclasses.replace(plan, budget=None, leaks="off", fragmentation=None)


def _describe_allocator(cupy) -> str:
    """CuPy's current allocator in words a user recognises."""
    a = cupy.cuda.get_allocator()
    owner = getattr(a, "__self__", None)
    if owner is cupy.get_default_memory_pool():
        return "CuPy's default memory pool (cupy.get_default_memory_pool().malloc)"
    if getattr(a, "__name__", "") == "_malloc" and getattr(owner, "__name__", None) == "cupy.cuda.memory":
        return "plain cudaMalloc, no pool (cupy.cuda.set_allocator(None))"
    return repr(a)


def _package_versions() -> dict:
    try:
        from cupy_memstrat.info import package_versions

        return package_versions()
    except Exception:  # noqa: BLE001 - a report must not crash
        return {}


def _outcome(reports) -> str:
    for r in reports:
        if r.failed:
            return "failed" if r.when == "call" else "error"
    for r in reports:
        if hasattr(r, "wasxfail"):
            return "xfailed" if r.skipped else "xpassed"
        if r.skipped:
            return "skipped"
    return "passed"


def is_xdist_controller(config) -> bool:
    if hasattr(config, "workerinput"):
        return False
    try:
        dist = config.getoption("dist")
        n = config.getoption("numprocesses")
    except ValueError:  # pytest-xdist is not installed or not loaded
        return False
    return bool(n) and dist != "no"
