"""Measuring windows over a cupy_memstrat strategy (public API only).

A *window* is a span of time (a test's call, a ``gpumem.measure()`` block).
Opening one reads the strategy's statistics on each device, resets the peaks
and snapshots the live allocations; windows nest: opening an inner window
first folds the current peak into every open outer window, so resetting the
peak for the inner one loses nothing for the outer ones.

Per window, per device:

* peak = highest ``bytes_in_use`` during the window - ``bytes_in_use`` when it
  opened (what the window added on top of what was already held);
* peak reserved = highest ``bytes_reserved`` during the window - ``bytes_reserved``
  when it opened (what the strategy took from CUDA on top of what it held);
* allocated / freed = allocations and frees made during the window (counts);
* leaked = allocations made since the window opened that are still live when
  asked (after ``gc.collect()`` and clearing CuPy's caches that hold device
  memory on purpose, when there were any).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass, field

import cupy_memstrat
from cupy_memstrat import faults as _faults

from . import outside as _outside

__all__ = ["Meter", "Window", "Measurement", "GpuMem", "clear_cupy_caches"]


def clear_cupy_caches(devices) -> None:
    """Clear CuPy's caches that keep device memory on purpose (CuPy v14):
    the cuFFT plan cache (each plan holds its work area), per device, for the
    calling thread. Only if CuPy's FFT module was imported; errors ignored."""
    if "cupy.fft" not in sys.modules:
        return
    try:
        import cupy
    except ImportError:
        return
    for d in devices:
        try:
            with cupy.cuda.Device(d):
                cupy.fft.config.get_plan_cache().clear()
        except Exception:  # noqa: BLE001 - no CUDA (fake backend) or no cuFFT: nothing cached
            pass


@dataclass
class Window:
    base: list  # bytes in use per device when opened
    peak_abs: list  # highest bytes in use seen so far (absolute), per device
    allocs0: list
    frees0: list
    live0: dict | None  # {ptr: size} when opened
    base_reserved: list = field(default_factory=list)  # bytes reserved per device when opened
    peak_reserved_abs: list = field(default_factory=list)  # highest bytes reserved so far (absolute)
    peak: list = field(default_factory=list)  # per device, once closed
    peak_reserved: list = field(default_factory=list)  # per device, once closed (on top of base_reserved)
    n_allocs: int = 0
    n_frees: int = 0
    closed: bool = False
    faults: object = None  # FaultCounts
    # filled by the plugin
    top_live: list = field(default_factory=list)
    check_start: int = 0  # cupy_memstrat.checks.mark() when the test's setup began
    history: object = None  # cupy_memstrat.history.History of the call (--gpumem-history)
    history_error: str | None = None  # why the call could not be recorded
    strategy_name: str | None = None  # set when measured through another strategy than the session's
    allocator_change: tuple | None = None  # (message, as an error) when the test replaced CuPy's allocator
    checked: bool | None = None  # whether the call ran under the checks (None: no check asked anywhere)
    install_start: int = 0  # cupy_memstrat.install_mark() when the call began
    setup_install_start: int = 0  # cupy_memstrat.install_mark() when the test's setup began
    unchecked_why: str | None = None  # why the call ran unchecked, where the plugin knew it at its start
    installs: list = field(default_factory=list)  # strategies the call installed (cupy_memstrat.installs)
    check_error: str | None = None  # why the checks' pending work could not be finished after the call
    outside0: object = None  # outside.Reading when opened (the meter's outside check on)
    outside1: object = None  # outside.Reading when closed
    sampler: object = None  # outside.Sampler during the call (--gpumem-driver-sample)
    sampled_peak: list | None = None  # its highest reading per device, once closed


class Meter:
    """Windows over one strategy, for the whole session."""

    def __init__(self, strategy, outside: bool = False, sample_interval: float = 0.0):
        self.strategy = strategy
        self.n_devices = strategy.backend.device_count()
        self.devices = range(self.n_devices)
        self._totals = None
        self._open: list[Window] = []
        self._counter = None
        self._counter_error = None
        #: read the driver and the libraries' counters at each window (memory outside the strategy)
        self.outside = outside
        #: seconds between readings of the driver during a call (0: none between its start and end)
        self.sample_interval = sample_interval
        self._warmed: set = set()  # devices whose library handles outside.warm_up made

    # -- device facts ---------------------------------------------------------------
    @property
    def totals(self) -> list[int]:
        if self._totals is None:
            self._totals = [self.strategy.backend.device_properties(d)["total_memory"] for d in self.devices]
        return self._totals

    def machine(self) -> dict:
        """Devices, driver and runtime, as the strategy's backend reports them."""
        b = self.strategy.backend
        out = {"backend": getattr(b, "name", type(b).__name__), "devices": []}
        for d in self.devices:
            try:
                p = b.device_properties(d)
                out["devices"].append(
                    {"index": d, "name": p.get("name"), "total_memory": p.get("total_memory"),
                     "compute_capability": p.get("compute_capability")}
                )
            except Exception as exc:  # noqa: BLE001 - a report must not crash
                out["devices"].append({"index": d, "error": str(exc)})
        try:
            v = b.versions()
            out["driver_version"], out["runtime_version"] = v.get("driver"), v.get("runtime")
        except Exception:  # noqa: BLE001
            pass
        return out

    def limit(self, value, device: int) -> int:
        """A budget (bytes or "N%") in bytes for ``device``."""
        if isinstance(value, str):
            return cupy_memstrat.parse_size(value, total=self.totals[device], what="budget")
        return value

    # -- windows ----------------------------------------------------------------------
    def open(self, snapshot: bool = True, warm: bool = False, sample: bool = False) -> Window:
        """A new window. ``warm``: a verdict on memory outside the strategy may follow, so what
        CUDA sets aside once per process (a first kernel launch, the library handles CuPy makes
        on first use) is made first (outside.warm_up), once per device, before anything is
        read. ``sample``: read the driver every ``sample_interval`` seconds until the window
        closes (a test's call)."""
        s = self.strategy
        if self.outside and warm:
            device = s.backend.get_device()
            if device not in self._warmed:
                self._warmed.add(device)
                _outside.warm_up(device)
        sts = [s.stats(d) for d in self.devices]
        for w in self._open:
            for d, st in enumerate(sts):
                w.peak_abs[d] = max(w.peak_abs[d], st.peak_bytes_in_use)
                w.peak_reserved_abs[d] = max(w.peak_reserved_abs[d], st.peak_bytes_reserved)
        for d in self.devices:
            s.reset_peak(d)
        outside0 = _outside.read(s, self.devices) if self.outside else None
        w = Window(
            base=[st.bytes_in_use for st in sts],
            peak_abs=[st.bytes_in_use for st in sts],
            allocs0=[st.n_allocs for st in sts],
            frees0=[st.n_frees for st in sts],
            live0=s.live_sizes() if snapshot else None,
            base_reserved=[st.bytes_reserved for st in sts],
            peak_reserved_abs=[st.bytes_reserved for st in sts],
            outside0=outside0,
        )
        if outside0 is not None and sample and self.sample_interval > 0:
            w.sampler = _outside.Sampler(s.backend, self.devices, self.sample_interval, outside0).start()
        self._open.append(w)
        return w

    def read(self, w: Window) -> tuple[list, list]:
        """(peak per device, in use on top of the window's start per device), now."""
        if w.closed:
            return w.peak, [self.strategy.stats(d).bytes_in_use - w.base[d] for d in self.devices]
        sts = [self.strategy.stats(d) for d in self.devices]
        peak = [max(w.peak_abs[d], st.peak_bytes_in_use) - w.base[d] for d, st in enumerate(sts)]
        return peak, [st.bytes_in_use - w.base[d] for d, st in enumerate(sts)]

    def close(self, w: Window) -> Window:
        sts = [self.strategy.stats(d) for d in self.devices]
        w.peak = [max(w.peak_abs[d], st.peak_bytes_in_use) - w.base[d] for d, st in enumerate(sts)]
        w.peak_reserved = [max(0, max(w.peak_reserved_abs[d], st.peak_bytes_reserved) - w.base_reserved[d])
                           for d, st in enumerate(sts)]
        w.n_allocs = sum(st.n_allocs - w.allocs0[d] for d, st in enumerate(sts))
        w.n_frees = sum(st.n_frees - w.frees0[d] for d, st in enumerate(sts))
        w.closed = True
        if w.sampler is not None:
            w.sampled_peak = w.sampler.stop()
        if w.outside0 is not None:
            w.outside1 = _outside.read(self.strategy, self.devices)
        with contextlib.suppress(ValueError):
            self._open.remove(w)
        return w

    def driver_peak(self, w: Window) -> list:
        """Per device, the call's peak as the driver sees it (bytes, on top of the start):
        the highest of the strategy's peak in use, its peak reserved and the growth of the
        device's used memory at the end of the call, and at each sampled reading during it
        (``sample_interval``). Without the outside reading (off), the strategy's peak in use."""
        if w.outside0 is None or w.outside1 is None:
            return list(w.peak)
        growth, _ = _outside.used_growth(w.outside0, w.outside1)
        out = []
        for d in self.devices:
            grown = growth[d]
            sampled = w.sampled_peak[d] if w.sampled_peak is not None else None
            if sampled is not None:
                grown = max(grown, sampled)
            out.append(max(w.peak[d], w.peak_reserved[d], grown))
        return out

    def outside_now(self, w: Window, tolerance: int) -> dict | None:
        """Memory outside the strategy held now that was not when ``w`` opened, per device:
        ``{"driver_growth", "strategy_growth", "outside", "libraries": {name: {"held",
        "in_use"}}, "unexplained", "leaked", "leaked_bytes", "by"}`` (bytes, lists per
        device). Where something is outside the strategy, read again after a garbage
        collection and emptying the caches that hold memory on purpose
        (:func:`outside.empty_caches`). ``leaked`` per device: the memory libraries hold for
        allocations still in use, plus the unexplained growth where it is above
        ``tolerance``. None when the outside check is off."""
        if w.outside0 is None:
            return None
        now = _outside.read(self.strategy, self.devices)
        r = _outside_figures(w.outside0, now, self.devices, self.strategy.name)
        if any(x > tolerance for x in r["unexplained"]) or any(
                any(h > 0 for h in lib["held"]) for lib in r["libraries"].values()):
            _outside.empty_caches(self.devices, self.strategy.name)  # a gc.collect() first
            now = _outside.read(self.strategy, self.devices)
            r = _outside_figures(w.outside0, now, self.devices, self.strategy.name)
        leaked, by = [], {}
        for d in self.devices:
            n = 0
            for name, lib in r["libraries"].items():
                if lib["in_use"][d] > 0 and lib["held"][d] > 0:
                    n += lib["held"][d]
                    by[name] = by.get(name, 0) + lib["held"][d]
            if r["unexplained"][d] > tolerance:
                n += r["unexplained"][d]
                by["unexplained"] = by.get("unexplained", 0) + r["unexplained"][d]
            leaked.append(n)
        r["leaked"], r["leaked_bytes"], r["by"] = leaked, sum(leaked), by
        return r

    def new_live(self, w: Window) -> set:
        """{(ptr, size)} allocated since ``w`` opened and live now (no GC)."""
        return self.strategy.live_sizes().items() - (w.live0 or {}).items()

    def leaks(self, w: Window, collect: bool = True) -> list:
        """Allocations made since ``w`` opened that are still live, largest
        first (:class:`cupy_memstrat.Allocation`, with origins where tracked).
        With ``collect``, a non-empty answer is checked again after
        ``gc.collect()`` and clearing CuPy's caches."""
        new = self.new_live(w)
        if new and collect:
            # Most arrays kept past a test are in young reference cycles (a
            # traceback's frames): a collection of generations 0 and 1 frees
            # them for a fraction of a full collection's cost, which grows
            # with the session's heap. Only what survives that pays for the
            # full collection and the cleared caches.
            gc.collect(1)
            new = self.new_live(w)
            if new:
                gc.collect()
                # only where the leaked blocks are: making another device
                # current would create a CUDA context there
                clear_cupy_caches(sorted({a.device for a in self.strategy.live_allocations()
                                          if (a.ptr, a.size) in new}))
                new = self.new_live(w)
        if not new:
            return []
        return [a for a in self.strategy.live_allocations() if (a.ptr, a.size) in new]

    def largest_new(self, w: Window, n: int = 10) -> list:
        """The ``n`` largest allocations made since ``w`` opened and live now."""
        new = self.new_live(w)
        if not new:
            return []
        return [a for a in self.strategy.live_allocations() if (a.ptr, a.size) in new][:n]

    # -- page faults ----------------------------------------------------------------------
    def fault_counter(self):
        """The session's FaultCounter, made on first use.

        Raises:
            cupy_memstrat.FaultCountersUnavailable: no counter on this machine.
        """
        if self._counter is None and self._counter_error is None:
            try:
                self._counter = _faults.FaultCounter(backend=self.strategy.backend)
            except cupy_memstrat.FaultCountersUnavailable as exc:
                self._counter_error = exc
        if self._counter is None:
            raise self._counter_error
        return self._counter

    def fault_status(self) -> str:
        try:
            c = self.fault_counter()
        except cupy_memstrat.FaultCountersUnavailable as exc:
            return f"unavailable: {exc}"
        return f"{c.source} counters" + ("" if c.exact else " (lower bounds)")


@dataclass
class Measurement:
    """The result of ``gpumem.measure()``, filled when the block ends.

    Attributes:
        peak: bytes; the highest GPU memory in use during the block on top of
            what was in use when it began (the highest over devices).
        allocated / freed: allocations and frees made during the block (counts).
        leaked: bytes of allocations made in the block and still live at its
            end (after ``gc.collect()``).
        leaked_allocations: those allocations (``cupy_memstrat.Allocation``).
        faults: ``cupy_memstrat.faults.FaultCounts`` when counting was on, else None.
    """

    peak: int = 0
    allocated: int = 0
    freed: int = 0
    leaked: int = 0
    leaked_allocations: list = field(default_factory=list)
    faults: object = None
    peaks: list = field(default_factory=list)


def describe(allocs, limit: int = 10) -> str:
    lines = [f"  {cupy_memstrat.format_size(a.size):>10}  device {a.device}  0x{a.ptr:x}"
             + (f"  {a.origin}" if a.origin else "") for a in allocs[:limit]]
    if len(allocs) > limit:
        lines.append(f"  ... and {len(allocs) - limit} more")
    return "\n".join(lines)


class GpuMem:
    """The ``gpumem`` fixture: the GPU memory of the test that uses it,
    measured from the fixture's setup on."""

    def __init__(self, meter: Meter, count_faults: bool = False):
        self._meter = meter
        self._count_faults = count_faults
        self._window = meter.open()

    @property
    def strategy(self):
        """The cupy_memstrat strategy measured through."""
        return self._meter.strategy

    def _same_allocator(self) -> None:
        """Raises RuntimeError if CuPy allocates through another allocator than
        the one measured since the fixture's setup (the test installed one):
        the numbers since then would not be the test's."""
        __tracebackhide__ = True
        now = cupy_memstrat.current()
        if now is not self._meter.strategy:
            what = ("an allocator that is not a cupy_memstrat strategy" if now is None else
                    f"another {now.name!r} strategy object" if now.name == self._meter.strategy.name else
                    f"strategy {now.name!r}")
            raise RuntimeError(
                f"gpumem: CuPy allocates through {what} now, installed after the gpumem fixture was set up, "
                f"and gpumem has measured strategy {self._meter.strategy.name!r} since then: its numbers would "
                "not be this test's (run the test under a strategy with the gpumem_strategy fixture or "
                "--gpumem-strategy; gpumem.measure() blocks measure whatever allocates at the time)")

    @property
    def peak(self) -> int:
        """Bytes: the highest GPU memory in use since the fixture was set up,
        on top of what was in use then (the highest over devices).

        Raises:
            RuntimeError: the test installed another allocator since the setup.
        """
        __tracebackhide__ = True
        self._same_allocator()
        return max(self._meter.read(self._window)[0], default=0)

    @property
    def in_use(self) -> int:
        """Bytes in use now on top of what was in use when the fixture was set up (all devices).

        Raises:
            RuntimeError: the test installed another allocator since the setup.
        """
        __tracebackhide__ = True
        self._same_allocator()
        return sum(self._meter.read(self._window)[1])

    def live_allocations(self) -> list:
        """Allocations made since the fixture was set up that are live now,
        largest first (``cupy_memstrat.Allocation``; ``origin`` set when the
        strategy tracks origins).

        Raises:
            RuntimeError: the test installed another allocator since the setup.
        """
        __tracebackhide__ = True
        self._same_allocator()
        return self._meter.leaks(self._window, collect=False)

    def assert_no_leaks(self, limit=0) -> None:
        """Fail (``AssertionError``) if allocations made since the fixture was
        set up are still live, after ``gc.collect()`` and clearing CuPy's
        caches, totalling more than ``limit`` (bytes or a size string)."""
        __tracebackhide__ = True  # the failure points at the test's line, not at this plugin
        self._same_allocator()
        limit = cupy_memstrat.parse_size(limit, what="limit")
        leaked = self._meter.leaks(self._window)
        total = sum(a.size for a in leaked)
        if total > limit:
            n = len(leaked)
            raise AssertionError(
                f"leaked {n} allocation{'' if n == 1 else 's'}, {cupy_memstrat.format_size(total)} > limit "
                f"{cupy_memstrat.format_size(limit)}\n{describe(leaked)}"
            )

    @contextlib.contextmanager
    def measure(self, faults: bool | None = None):
        """Measure a block: ``with gpumem.measure() as m: ...`` then ``m.peak``,
        ``m.allocated``, ``m.freed``, ``m.leaked``, ``m.faults``.

        Args:
            faults: count page faults in the block (default: as the session,
                ``--gpumem-faults``). Raises ``FaultCountersUnavailable``
                where there is no counter.
        """
        m = Measurement()
        meter = self._meter
        now = cupy_memstrat.current()
        if now is not None and now is not meter.strategy:
            meter = Meter(now)  # the test installed another strategy: the block measures what allocates now
        count = self._count_faults if faults is None else faults
        counter = None
        if count:
            counter = _faults.FaultCounter(backend=meter.strategy.backend)
        w = meter.open()
        if counter is not None:
            counter.start()
        try:
            yield m
        finally:
            if counter is not None:
                m.faults = counter.stop()
            meter.close(w)
            m.peaks, m.peak = list(w.peak), max(w.peak, default=0)
            m.allocated, m.freed = w.n_allocs, w.n_frees
            m.leaked_allocations = meter.leaks(w)
            m.leaked = sum(a.size for a in m.leaked_allocations)

    def _close(self) -> None:
        if not self._window.closed:
            self._meter.close(self._window)


def _outside_figures(r0, r1, devices, strategy_name: str) -> dict:
    """The growth between two readings: of the driver's used memory, the strategy's reserved
    memory, the rest (outside), each library's held and in-use bytes (the strategy's own
    library left out: ``torch`` under the torch strategy), and what no library explains."""
    def grew(a, b):
        return [(y - x) if x is not None and y is not None else 0 for x, y in zip(a, b)]

    driver, source = _outside.used_growth(r0, r1)
    strategy = grew(r0.reserved, r1.reserved)
    outside = [max(0, dg - sg) for dg, sg in zip(driver, strategy)]
    libs = {}
    for name, after in r1.libraries.items():
        if name == strategy_name:  # it is the strategy: its memory is in the strategy's count
            continue
        before = r0.libraries.get(name) or [(0, 0)] * len(after)
        libs[name] = {"held": [max(0, a[0] - b[0]) for a, b in zip(after, before)],
                      "in_use": [max(0, a[1] - b[1]) for a, b in zip(after, before)]}
    unexplained = [max(0, outside[d] - sum(lib["held"][d] for lib in libs.values())) for d in devices]
    return {"driver_growth": driver, "driver_source": source, "strategy_growth": strategy, "outside": outside,
            "libraries": libs, "unexplained": unexplained}
