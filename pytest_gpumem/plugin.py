"""The pytest plugin: per-test GPU memory budgets, leak checks and page-fault
budgets, through cupy_memstrat's public API.

Nothing is measured unless asked for (an option, an ini key, an environment
variable, a marker or the ``gpumem`` fixture); a session without a GPU runs
normally and says once why nothing is measured. See docs/pytest.md.

What a measured test gets, all within its *call* (the test function; fixture
setup and teardown are not part of the window, as in pytest-memray):

* peak: highest bytes in use during the call, on top of what was in use when
  the call began (per device; the highest device is reported);
* leaks: allocations made from the start of the call on that are still live
  after teardown, ``gc.collect()`` and clearing CuPy's caches;
* page faults: a ``cupy_memstrat.faults.FaultCounter`` around the call;
* peak reserved: the highest memory the strategy held from CUDA during the
  call, on top of what it held when the call began (after a trim, where a
  fragmentation limit applies).

The test's reports are logged after its teardown (this plugin runs the
test protocol for measured tests, as pytest-rerunfailures does), so that a
leak found after teardown fails the test's call report.

This module holds the hooks and fixtures; the session's state and each test's
verdict are in ``session.py``, the limits it is judged by (one unit each, with
its marker) in ``limits.py``, the settings in ``options.py``.
"""

from __future__ import annotations

import contextlib
import os

import pytest

import cupy_memstrat
from cupy_memstrat import checks as _checks

from . import report as _report
from .limits import BUDGET, GpuMemLeakWarning, GpuMemUncheckedWarning, size_words
from .measure import GpuMem, Meter
from .options import MARKERS, add_options, plan_for, resolve
from .session import FOREIGN, METER, NOTICE, OOM_SNAPSHOT, GpuMemAllocatorWarning, State

__all__ = ["GpuMemLeakWarning", "GpuMemAllocatorWarning", "GpuMemUncheckedWarning"]

fmt = cupy_memstrat.format_size

_KEY = pytest.StashKey[State]()
_PLAN = pytest.StashKey[object]()
_WINDOW = pytest.StashKey[object]()
_BAD = pytest.StashKey[str]()  # a bad marker's message (pytest-xdist workers: the test errors with it)
_JUDGED = pytest.StashKey[bool]()  # the test runs under this plugin's protocol: its verdict judges findings
_CHECK_MARK = pytest.StashKey[int]()  # cupy_memstrat.checks.mark() when the test's setup began
_INSTALL_MARK = pytest.StashKey[int]()  # cupy_memstrat.install_mark() when the test's setup began


def _state(config) -> State | None:
    return config.stash.get(_KEY, None)


# -- configuration -----------------------------------------------------------------------


def pytest_addoption(parser):
    add_options(parser)


def pytest_configure(config):
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    settings = resolve(config)
    if settings.max_growth is not None and not settings.compare:
        raise pytest.UsageError(f"{settings.source('max_growth')}={settings.text('max_growth')!r}: a growth limit "
                                "needs a baseline to compare with: give --gpumem-compare=BASELINE.json (an earlier "
                                "--gpumem-json report)")
    if not settings.outside:
        for name, value in (("budget_reading", settings.budget_reading == "driver"),
                            ("driver_sample", bool(settings.driver_sample))):
            if value and settings.source(name) is not None:
                raise pytest.UsageError(
                    f"{settings.source(name)}={settings.text(name)!r} reads the driver, which "
                    f"{settings.source('outside')}={settings.text('outside')!r} switches off: give one of the two")
    state = State(config, settings)
    config.stash[_KEY] = state
    config.pluginmanager.register(_Recorder(state), "gpumem-recorder")
    if state.controller:
        return  # the workers measure; the controller merges their reports
    if settings.measuring or settings.strategy or _fake_backend_asked():
        # (with CUPY_MEMSTRAT_BACKEND=fake, CuPy must allocate through a strategy on the simulated
        # GPU in every test, whether or not a neighbour asks for measuring: CuPy's own allocator
        # would call CUDA)
        state.activate()


def _fake_backend_asked() -> bool:
    """CUPY_MEMSTRAT_BACKEND names a backend other than CUDA (the fake, or a bad value,
    which activating then refuses as a usage error)."""

    return os.environ.get("CUPY_MEMSTRAT_BACKEND", "").strip().lower() not in ("", "cuda", "real")


def pytest_unconfigure(config):
    state = _state(config)
    if state is not None:
        state.restore()
    recorder = config.pluginmanager.get_plugin("gpumem-recorder")
    if recorder is not None:
        config.pluginmanager.unregister(recorder)


def _settings_summary(state) -> str:
    s = state.settings
    parts = []
    if s.budget is not None:
        parts.append(f"budget {size_words(s.budget, s.text('budget'))} ({s.source('budget')})"
                     + (f" on the driver's reading ({s.source('budget_reading')})" if s.budget_reading == "driver"
                        else ""))
    if not s.outside:
        parts.append(f"driver's reading off ({s.source('outside')})")
    elif s.driver_sample:
        parts.append(f"driver read every {s.driver_sample * 1000:g} ms in each call ({s.source('driver_sample')})")
    elif s.source("outside_tolerance") is not None:
        parts.append(f"outside tolerance {fmt(s.outside_tolerance)} ({s.source('outside_tolerance')})")
    if s.leaks != "off":
        parts.append(f"leaks: {s.leaks} ({s.source('leaks')})")
    if s.max_fragmentation is not None:
        ratio, slack = s.max_fragmentation
        parts.append(f"max fragmentation {ratio:g}x + {fmt(slack)} ({s.source('max_fragmentation')})")
    if s.faults:
        parts.append("page faults: " + (state.meter.fault_status() if state.meter else "on"))
    if state.checks:
        where = state.checks_source or (s.source("check") if s.check else s.source("strategy"))
        parts.append(f"checks: {','.join(c for c in _checks.CHECKS if c in state.checks)} ({where})")
    if s.stream_policy != "current":
        parts.append(f"stream policy: {s.stream_policy} ({s.source('stream_policy')})")
    return "; ".join(parts)


def pytest_report_header(config):
    state = _state(config)
    if state is None:
        return None
    s = state.settings
    if not (s.measuring or s.strategy):
        return None
    extra = _settings_summary(state)
    if state.controller:
        what = "measuring every test" if s.measuring else f"strategy {s.strategy!r}"
        if s.measuring and s.strategy:
            what += f" through strategy {s.strategy!r}"
        return f"gpumem: {what} on each pytest-xdist worker" + (f"; {extra}" if extra else "")
    if state.strategy is None:
        if s.measuring:
            return f"gpumem: GPU measurement is off, tests run unmeasured: {state.why_off}"
        return f"gpumem: strategy {s.strategy!r} not installed, tests run with CuPy's own allocator: {state.why_off}"
    lines = []
    if s.strategy:
        lines.append(
            f"gpumem: CuPy allocates with strategy {state.strategy.name!r} ({s.source('strategy')}={s.strategy!r})"
        )
    if s.measuring:
        m = state.meter
        devs = m.machine()["devices"]
        names = ", ".join(f"{d.get('name')} ({fmt(d.get('total_memory') or 0)})" for d in devs)
        how = "" if state.installed or s.strategy else " (already installed)"
        lines.append(
            f"gpumem: measuring every test through strategy {state.strategy.name!r}{how} on "
            f"{len(devs)} device{'' if len(devs) == 1 else 's'}: {names}" + (f"; {extra}" if extra else "")
        )
    return lines


# -- collection ------------------------------------------------------------------------------


def pytest_collection_modifyitems(session, config, items):
    state = _state(config)
    if state is None:
        return
    if not state.controller:
        state.adopt_conftest_checks()  # a checked strategy from conftest.py: its checks judge every test
    wanted = False
    errors = []
    for item in items:
        try:
            plan = plan_for(item, state.settings)  # a bad marker: UsageError, before any test runs
        except pytest.UsageError as exc:
            errors.append(str(exc))
            item.stash[_BAD] = str(exc)
            continue
        if plan is not None:
            item.stash[_PLAN] = plan
            wanted = True
        elif "gpumem" in getattr(item, "fixturenames", ()):
            wanted = True
    if errors and state.worker is not None:
        # A pytest-xdist worker cannot stop the session with a usage error (the controller
        # reports an INTERNALERROR): each test with a bad marker errors at setup with it
        errors = []
    if errors:  # every bad marker of the run, one per line
        lines = "\n".join(errors).splitlines()
        head = f"{len(lines)} bad gpumem markers:\n" if len(lines) > 1 else ""
        raise pytest.UsageError(head + "\n".join(lines))
    if wanted and not state.controller:
        state.activate()


def pytest_generate_tests(metafunc):
    if "gpumem_strategy" not in metafunc.fixturenames:
        return
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0] if m.args else m.kwargs.get("argnames", "")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "gpumem_strategy" in names:
            return  # the test chose its strategies itself
    from cupy_memstrat.registry import get_registry

    reg = get_registry()
    params = []
    for name in cupy_memstrat.available():
        why = reg.get(name).unavailable()  # e.g. 'torch' without PyTorch: skipped, with the reason
        params.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=why) if why else ()))
    metafunc.parametrize("gpumem_strategy", params, indirect=True)


# -- running a test --------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    state = _state(item.config)
    if state is None:
        return
    bad = item.stash.get(_BAD, None) or state.usage_error  # under pytest-xdist, see above
    if bad is not None:
        pytest.fail(f"gpumem usage error: {bad}", pytrace=False)
    if state.meter is not None and item.stash.get(_PLAN, None) is not None:
        item.stash[_CHECK_MARK] = _checks.mark()  # findings of its fixtures' setup are the test's too
        item.stash[_INSTALL_MARK] = cupy_memstrat.install_mark()  # a thread its fixtures start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    state = _state(item.config)
    if state is not None and state.meter is None and item.stash.get(_PLAN, None) is not None:
        state.resume_if_restored(item)  # CuPy's allocator is the session's strategy again
    if state is None or state.meter is None or item.stash.get(_PLAN, None) is None:
        return None  # pytest's own protocol
    from _pytest.runner import runtestprotocol

    item.stash[_JUDGED] = True
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    w = item.stash.get(_WINDOW, None)
    if w is not None:
        del item.stash[_WINDOW]
        if state.allocator_changed():  # the test (or its fixtures) installed another allocator
            w.allocator_change = state.adopt_allocator(item, "during")
        state.verdict(item, item.stash[_PLAN], w, reports)
    elif state.checks and item.stash.get(_CHECK_MARK, None) is not None:
        _setup_findings(item, reports)  # the call never ran (setup skipped or failed)
    for rep in reports:
        ihook.pytest_runtest_logreport(report=rep)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _setup_findings(item, reports) -> None:
    """A test whose call never ran (a fixture skipped it, or failed): the findings of its setup
    and teardown are its own, not the next test's. They make a skipped setup an error."""
    try:
        _checks.collect()
    except _checks.CheckError:
        pass  # recorded: read below
    except Exception:  # noqa: BLE001 - a GPU left unusable: nothing more to read
        return
    found = _checks.findings(since=item.stash[_CHECK_MARK])
    if not found:
        return
    k = len(found)
    text = f"gpumem: {k} check finding{'' if k == 1 else 's'} during the test's setup or teardown:\n\n" + \
        "\n\n".join(str(f) for f in found[:10])
    setup = reports[0]
    if setup.skipped:
        setup.outcome, setup.longrepr = "failed", text
    else:
        setup.sections.append(("gpumem checks", text))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    state = _state(item.config)
    plan = item.stash.get(_PLAN, None)
    if state is None or plan is None:
        return (yield)
    if plan.fault_limits is not None:
        why = state.fault_unavailable()
        if why is not None:
            msg = f"gpumem: limit_page_faults cannot be checked: {why}"
            if state.settings.faults_missing == "fail":
                pytest.fail(msg, pytrace=False)
            try:  # reported at the test's location, as a skipif marker's reason is
                exc = pytest.skip.Exception(msg, _use_item_location=True)
            except TypeError:  # a pytest without that argument
                exc = pytest.skip.Exception(msg)
            raise exc
    meter = strategy = None
    n_changes = len(state.allocator_changes)
    if state.meter is not None:
        meter, strategy = state.follow_allocator(item)
    if len(state.allocator_changes) > n_changes:  # found before this test: its record carries it
        item.stash[NOTICE] = state.allocator_changes[-1]
    if meter is None:
        state.n_unmeasured += 1
        return (yield)
    item.stash[METER] = meter
    if plan.fragmentation is not None:
        # the verdict judges what the test's call reserves: nothing cached by earlier tests serves it
        strategy.trim()
    counter = None
    if plan.faults:
        try:
            counter = meter.fault_counter()
        except cupy_memstrat.FaultCountersUnavailable:
            counter = None
    w = meter.open(snapshot=True, sample=True, warm=plan.leaks != "off" or (
        plan.budget is not None and plan.budget_reading == "driver"))
    w.checked = state.checked_state(strategy)
    if strategy is not state.initial_strategy:
        w.strategy_name = strategy.name  # named on the test's row (the title names the session's)
    item.stash[_WINDOW] = w
    w.check_start = item.stash.get(_CHECK_MARK, None)
    if w.check_start is None:
        w.check_start = _checks.mark()
    if state.settings.history:
        try:
            w.history = cupy_memstrat.record_history(strategy=strategy)
        except RuntimeError:  # inside cupy_memstrat.using() (the gpumem_strategy fixture): not recordable
            w.history_error = ("the test runs inside cupy_memstrat.using() (as under the gpumem_strategy "
                               "fixture), whose per-thread allocator a recording cannot wrap; it is measured")
    # strategies the call switches to (and back from); from the setup on, those of other threads
    w.install_start = cupy_memstrat.install_mark()
    w.setup_install_start = item.stash.get(_INSTALL_MARK, w.install_start)
    foreign = item.stash.get(FOREIGN, None)
    if foreign is not None and state.checks:
        w.checked, w.unchecked_why = False, foreign
    with contextlib.ExitStack() as scope:
        if state.settings.stream_policy == "fresh":
            scope.enter_context(_checks.fresh_stream(backend=strategy.backend))
        if counter is not None:
            counter.start()
        try:
            return (yield)
        except MemoryError as exc:  # cupy_memstrat.OutOfMemoryError: the snapshot it wrote, if any
            snap = getattr(exc, "snapshot", None)
            if isinstance(snap, str):
                item.stash[OOM_SNAPSHOT] = snap
            raise
        finally:
            _finish_call(state, plan, meter, w, counter)


def _finish_call(state, plan, meter, w, counter) -> None:
    import threading

    me = threading.get_ident()
    w.installs = [i for i in cupy_memstrat.installs(since=w.setup_install_start)
                  if i.seq > w.install_start or i.thread != me]
    if counter is not None and counter.running:
        w.faults = counter.stop()
    if w.history is not None:
        if not w.history.recording:
            w.history_error = ("the recording ended during the call: the test installed another allocator "
                               "(cupy_memstrat.use() or cupy.cuda.set_allocator); its timeline stops there")
        try:
            cupy_memstrat.record_history(False)
        except RuntimeError:  # the test entered using() and is still inside it
            w.history_error = "the test's call left a cupy_memstrat.using() block open; the recording goes on"
    meter.close(w)
    if BUDGET.exceeded(plan, meter, w):
        w.top_live = meter.largest_new(w)  # while the test's arrays may still be alive


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test this plugin does not judge (not measured): findings that a
    checked strategy of its own (``on_finding="raise"``) found and has not
    raised yet fail its call, or its teardown, instead of being lost."""
    rep = yield
    if call.when != "setup" and not item.stash.get(_JUDGED, False) and _state(item.config) is not None:
        skipped = item.get_closest_marker("gpumem_skip") is not None
        try:
            _checks.collect()
        except _checks.CheckError as exc:
            if skipped:  # not judged, and not left pending for the next test either
                return rep
            text = f"gpumem: {exc}"
            if rep.passed and not hasattr(rep, "wasxfail"):  # an xpass keeps its outcome, as a judged test's
                rep.outcome, rep.longrepr = "failed", text
            else:
                rep.sections.append(("gpumem checks", text))
        except Exception as exc:  # noqa: BLE001 - a GPU left unusable by the test: said, never a crash
            rep.sections.append(("gpumem checks", f"the checks' pending work could not be finished: "
                                                  f"{type(exc).__name__}: {exc}"))
    return rep


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    if report.when == "call" and getattr(report, "gpumem_failed", None):
        return "failed", "M", ("GPUMEM", {"red": True})
    return None


class _Recorder:
    """Collects the per-test records of one session from the reports (in
    this process, or sent by pytest-xdist workers to the controller)."""

    def __init__(self, state):
        self.state = state

    def pytest_runtest_logreport(self, report):
        rec = getattr(report, "gpumem", None)
        if not isinstance(rec, dict):
            return
        rec = dict(rec)
        machine = rec.pop("machine", None)
        if machine and self.state.machine is None:
            self.state.machine = machine
        strategy = rec.pop("strategy_info", None)
        if strategy and self.state.remote_strategy is None:
            self.state.remote_strategy = strategy
        self.state.records.append(rec)


def pytest_sessionfinish(session, exitstatus):
    state = _state(session.config)
    if state is None or state.worker is not None:
        return
    path = state.settings.json
    opt = session.config.option
    run_nothing = [flag for flag, on in (("--collect-only", getattr(opt, "collectonly", False)),
                                         ("--setup-plan", getattr(opt, "setupplan", False)),  # sets setuponly
                                         ("--setup-only", getattr(opt, "setuponly", False))) if on]
    if path and run_nothing:  # no test ran: an existing report (a --gpumem-compare baseline) stays as it is
        state.json_skipped = (f"{run_nothing[0]} runs no test: the JSON report {path} is not written "
                              "(an existing one is left as it was)")
        return
    if path:  # also with nothing measured: the file says so (measuring_off, no tests)
        if state.machine is None and state.meter is not None:
            state.machine = state.meter.machine()
        try:
            _report.write_json(path, state.records, state.info())
        except (OSError, RecursionError) as exc:  # checked at start-up; a disk can still fill up, a folder go
            state.json_error = f"cannot write the JSON report {path!r}: {getattr(exc, 'strerror', None) or exc}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = _state(config)
    if state is None:
        return
    tr = terminalreporter
    changes = list(state.allocator_changes)
    for r in state.records:  # under pytest-xdist they come in the workers' records
        for key in ("allocator_notice", "allocator_change"):
            if r.get(key) is not None and r[key] not in changes:
                changes.append(r[key])
    for msg in changes:  # (under pytest-xdist they come in the workers' records)
        tr.write_line(f"gpumem: {msg}")
    if state.why_off and state.n_unmeasured and not state.settings.measuring:
        n = state.n_unmeasured
        tr.write_line(f"gpumem: {n} test{'' if n == 1 else 's'} asked for GPU measurement, which is off: "
                      f"{state.why_off}")
    recs = state.records
    top = state.settings.top
    if recs and top:
        name = (state.info()["strategy"] or {}).get("name")
        title = f"gpumem: top {min(top, len(recs))} of {len(recs)} measured tests by peak GPU memory"
        if name:
            title += f" (strategy {name})"
        tr.write_sep("=", title)
        for line in _report.table_lines(recs, top):
            tr.write_line(line)
        failed = [r for r in recs if r.get("verdict") and r["verdict"] != "leak warning"]
        if failed:
            n = len(failed)
            tr.write_line(f"{n} test{'' if n == 1 else 's'} failed a GPU memory check (status M / GPUMEM)")
    if state.settings.history and not state.settings.json and state.worker is None:
        n = sum(1 for r in recs if "history" in r) or state.n_histories
        if n:
            which = "" if state.settings.history_keep == "all" else "failing "
            tr.write_line(f"gpumem: --gpumem-history recorded the timeline of {n} {which}"
                          f"test{'' if n == 1 else 's'}; {'it goes' if n == 1 else 'they go'} into "
                          "--gpumem-json=PATH (none given), "
                          "drawn by python -m cupy_memstrat plot")
    if state.baseline is not None and state.worker is None:
        for line in _baseline_summary(state, recs):
            tr.write_line(line)
    unchecked = [r["nodeid"] for r in recs if r.get("checked") is False and "allocator_change" not in r]
    if unchecked:  # (under pytest-xdist they come in the workers' records)
        n = len(unchecked)
        tr.write_line(f"gpumem: {n} test{'' if n == 1 else 's'} ran, in whole or in part, under a strategy of "
                      f"{'its' if n == 1 else 'their'} own that the session's checks do not wrap, unchecked "
                      "(GpuMemUncheckedWarning; the JSON report says why for each): "
                      + ", ".join(unchecked[:10]) + (f" and {n - 10} more" if n > 10 else ""))
    if state.json_skipped and state.worker is None:
        tr.write_line(f"gpumem: {state.json_skipped}")
    elif state.settings.json and state.worker is None:
        if getattr(state, "json_error", None):
            tr.write_line(f"gpumem: {state.json_error}", red=True)
        else:
            tr.write_line(f"gpumem: JSON report written to {state.settings.json}")


def _baseline_summary(state, recs) -> list[str]:
    """What the comparison with the baseline found: tests compared, grown,
    new (not in the baseline), and the baseline's tests that did not run."""
    b = state.baseline
    compared = [r for r in recs if r.get("baseline")]
    new = [r["nodeid"] for r in recs if "baseline" in r and r["baseline"] is None]
    ran = {r["nodeid"] for r in recs}
    gone = [n for n in b.tests if n not in ran]
    grown = [r for r in compared if "growth" in (r.get("verdict") or "").split("+")]

    def names(ids):
        return ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")

    out = [f"gpumem: compared {len(compared)} test{'' if len(compared) == 1 else 's'} with the baseline {b.path} "
           f"(max growth {state.growth.text}): {len(grown)} grew more"]
    if new:
        out.append(f"gpumem: {len(new)} test{'' if len(new) == 1 else 's'} not in the baseline, or not measured "
                   f"there (not compared): {names(new)}")
    if gone:
        out.append(f"gpumem: {len(gone)} test{'' if len(gone) == 1 else 's'} of the baseline did not run: "
                   f"{names(gone)}")
    return out


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def gpumem(request):
    """GPU memory of this test, measured from this fixture's setup on:
    ``.peak``, ``.in_use``, ``.measure()``, ``.assert_no_leaks()``,
    ``.live_allocations()``, ``.strategy``. Works without ``--gpumem``;
    skips the test where there is no GPU."""
    state = _state(request.config)
    if state is not None and state.meter is None and not state.controller:
        state.activate()
    if state is None or state.meter is None:
        why = state.why_off if state is not None else "the gpumem plugin is not configured"
        pytest.skip(f"gpumem: GPU measurement is off: {why}")
    meter = state.meter
    if "gpumem_strategy" in request.fixturenames:
        # the test runs under a strategy of its own: measure through that one, whichever
        # fixture pytest sets up first
        own = request.getfixturevalue("gpumem_strategy")
        if own is not state.strategy:
            meter = Meter(own)
    fx = GpuMem(meter, count_faults=state.settings.faults)
    yield fx
    fx._close()


@pytest.fixture
def gpumem_strategy(request):
    """Run the test under one cupy_memstrat strategy (``cupy_memstrat.using``);
    parametrised over every registered strategy unless the test parametrises
    ``gpumem_strategy`` itself (``indirect=True``). A strategy that cannot be
    created here skips with the reason. Under the session's checks
    (``--gpumem-check``, or a ``check=`` in the session's strategy) the
    strategy is made with them. Yields the strategy."""
    name = getattr(request, "param", "pool")
    if not isinstance(name, str) or not name.strip():
        pytest.fail(f"gpumem_strategy: expected a strategy name such as 'device' or 'async:cache=0', got "
                    f"{name!r} (parametrize it with names, indirect=True)", pytrace=False)
    try:
        cupy_memstrat.validate(name)  # a typo is the test's error, not a skip
        bad = None
    except (cupy_memstrat.MemstratError, ValueError, TypeError) as exc:
        bad = str(exc)
    if bad is not None:  # outside the except: one message, no chained exception
        pytest.fail(f"gpumem_strategy: {bad}", pytrace=False)
    state = _state(request.config)
    carry = {}
    if state is not None and state.checks and "check" not in cupy_memstrat.parse_spec(name)[1]:
        # the session's checks (--gpumem-check, a check= in the session's strategy) wrap the
        # test's strategy too, and record their findings for the verdict
        carry = {"check": ",".join(c for c in _checks.CHECKS if c in state.checks), "on_finding": "record"}
    try:
        cm = cupy_memstrat.using(name, **carry)
        s = cm.__enter__()
    except (cupy_memstrat.MemstratError, ValueError, ImportError, RuntimeError) as exc:
        pytest.skip(f"strategy {name!r} cannot be created here: {exc}")
    try:
        yield s
    finally:
        cm.__exit__(None, None, None)
