"""Page-fault and migration counters for unified (managed) memory::

    from cupy_memstrat import faults

    with faults.count() as c:
        ...                                    # GPU work
    print(c.gpu_faults, c.bytes_htod)          # deltas over the block
    print(c.counts)                            # "12 GPU faults, ... (driver counters, exact)"

Four numbers, each a difference over the counted span, for the whole process
(all devices): ``gpu_faults`` and ``cpu_faults`` (page faults that the
unified-memory driver serviced) and ``bytes_htod`` / ``bytes_dtoh`` (bytes
that the driver migrated host->device / device->host, by faults *and* by
prefetches).

Sources, best first (``source=None`` takes the first that opens):

``"driver"``
    The NVIDIA UVM driver's own counters, read from ``/dev/nvidia-uvm-tools``
    in "counter mode": exact, and nearly free (reading them is a memory load
    from a page the driver updates in place). This is the open-source
    driver's tools interface, not a documented API: it is feature-detected,
    its replies are checked, and any failure falls back cleanly. Layout from
    NVIDIA's open-gpu-kernel-modules, ``kernel-open/nvidia-uvm/``
    (``uvm_ioctl.h``, ``uvm_linux_ioctl.h``, ``uvm_types.h``, ``uvm_tools.c``,
    ``uvm_api.h``; tags 515.43.04 to 595.45.04); how it is verified on a GPU
    is in docs/faults.md.
``"cupti"``
    CUPTI's unified-memory activity records, through ``cupti-python``
    (``pip install 'cupy-memstrat[cupti]'``). Lower bounds only
    (``exact=False``): CUPTI silently drops records under heavy paging (a
    large share of the bytes goes unrecorded while its dropped-record counter
    reads 0), it sees only managed memory allocated after the first CUPTI
    counter started (it then stays on, and fault-driven kernels run slower),
    and each read costs a flush of milliseconds. Only one CUPTI user per
    process (R580 driver): a profiler attached to the process makes it
    unavailable. The costs are in docs/faults.md.
``"fake"``
    Chosen when the ``backend`` passed has ``uvm_counters()``
    (:class:`cupy_memstrat.testing.FakeBackend`): the simulator's counters,
    for tests without a GPU.

:func:`status` and :func:`available` say which sources this machine offers
and why the others are not.

The sources live in this package's internal modules: ``_uvm`` (the driver's
tools interface), ``_cupti`` (CUPTI), ``_sources`` (the fake source and the
process-wide cache that opens the others once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import FaultCountersUnavailable, MemstratError
from ..sizes import format_size
from ..stats import Record
from . import _cupti, _sources
from ._uvm import DriverCounters

__all__ = [
    "FaultCounts",
    "FaultCounter",
    "FaultCountersUnavailable",
    "count",
    "status",
    "available",
    "SOURCES",
]

#: Values accepted by ``source=`` (``None`` too: the best available).
SOURCES = ("driver", "cupti", "fake")


def _real_backend():
    from ..backends import get_backend

    return get_backend()


_LABELS = {"driver": "driver counters, exact", "cupti": "CUPTI records, lower bound", "fake": "fake backend, exact"}


def _n(value: int, what: str) -> str:
    s = f"{value:,}".replace(",", " ")
    return f"{s} {what}" + ("" if value == 1 else "s")


@dataclass(frozen=True)
class FaultCounts(Record):
    """Unified-memory activity over a counted span, for the whole process.

    Attributes:
        gpu_faults: GPU page faults serviced by the driver (``cupti``: fault
            records, each a group of faults).
        cpu_faults: CPU page faults on managed memory.
        bytes_htod: bytes migrated host -> device (faults and prefetches).
        bytes_dtoh: bytes migrated device -> host (faults, prefetches, evictions).
        source: ``"driver"``, ``"cupti"`` or ``"fake"``.
        exact: ``True`` for driver and fake counts; ``False`` for CUPTI,
            whose counts are lower bounds (it drops records, docs/faults.md).
    """

    gpu_faults: int
    cpu_faults: int
    bytes_htod: int
    bytes_dtoh: int
    source: str
    exact: bool

    def __str__(self) -> str:
        return (
            f"{_n(self.gpu_faults, 'GPU fault')}, {_n(self.cpu_faults, 'CPU fault')}, "
            f"{format_size(self.bytes_htod)} host->device, {format_size(self.bytes_dtoh)} device->host "
            f"({_LABELS.get(self.source, self.source)})"
        )

    def _combine(self, other, sign: int):
        if not isinstance(other, FaultCounts):
            return NotImplemented
        if other.source != self.source:
            raise ValueError(
                f"cannot combine {self.source!r} counts with {other.source!r} counts: "
                "exact counts and lower bounds do not add up to a meaningful number"
            )
        return FaultCounts(
            self.gpu_faults + sign * other.gpu_faults,
            self.cpu_faults + sign * other.cpu_faults,
            self.bytes_htod + sign * other.bytes_htod,
            self.bytes_dtoh + sign * other.bytes_dtoh,
            self.source,
            self.exact and other.exact,
        )

    def __add__(self, other):
        return self._combine(other, 1)

    def __sub__(self, other):
        return self._combine(other, -1)


class FaultCounter:
    """Counts unified-memory page faults and migrations between
    :meth:`start` and :meth:`stop`; a context manager (``with`` starts and
    stops it); restartable.

    Args:
        source: ``None`` (the best available: ``"driver"``, else
            ``"cupti"``), ``"driver"``, ``"cupti"``, or ``"fake"`` (only with
            a fake ``backend``). A fake backend (one with ``uvm_counters()``)
            selects ``"fake"`` by itself.
        device: the device to synchronise at start and stop (``None``: all).
            The counts always cover the whole process: the driver counts per
            address space, not per device.
        backend: the backend used to synchronise (default: the process's
            :func:`cupy_memstrat.backends.get_backend`; with
            ``CUPY_MEMSTRAT_BACKEND=fake`` that is a fake, whose simulated
            counters are then used).

    Raises:
        ValueError: an unknown ``source``; ``"fake"`` without a fake backend,
            or ``"driver"``/``"cupti"`` with one; ``device`` out of range.
        TypeError: ``device`` is not an int.
        FaultCountersUnavailable: the source asked for (or, with ``None``,
            every source) cannot be opened; the message says why for each.
            Sources are opened once per process and kept open, so creating a
            counter is cheap.

    Costs (CPU time beyond the device synchronisations): driver and fake
    sources, a few microseconds per start/stop; CUPTI, a flush per start and
    stop (milliseconds each, docs/faults.md). A counter object is not thread-safe; use
    one per thread.
    """

    def __init__(self, source=None, device=None, backend=None):
        if source is not None and source not in SOURCES:
            raise ValueError(
                f"unknown page-fault counter source {source!r}; expected None (the best available) "
                f"or one of {', '.join(repr(s) for s in SOURCES)}"
            )
        if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
            raise TypeError(f"device must be an int device ordinal or None, got {type(device).__name__} {device!r}")
        if backend is None and os.environ.get("CUPY_MEMSTRAT_BACKEND", "").strip().lower().startswith("fake"):
            backend = _real_backend()  # the process-wide fake that CUPY_MEMSTRAT_BACKEND asks for
        if isinstance(backend, type):
            raise TypeError(
                f"backend: expected a backend object, got the class {backend.__name__}; "
                f"pass an instance such as {backend.__name__}()"
            )
        if backend is not None and _sources.is_fake(backend):
            if source not in (None, "fake"):
                raise ValueError(
                    f"source {source!r} counts the real driver's activity and cannot be used with the fake "
                    f"backend {type(backend).__name__}; use source=None or 'fake'"
                )
            self._src = _sources.FakeSource(backend)
            self._backend = backend
        else:
            if source == "fake":
                raise ValueError(
                    "source 'fake' needs a fake backend (one with uvm_counters()), "
                    "e.g. backend=cupy_memstrat.testing.FakeBackend()"
                )
            get_backend = (lambda: backend) if backend is not None else _real_backend
            self._src = _sources.select(source, get_backend)
            self._backend = get_backend()
        n = self._backend.device_count()
        if device is None:
            self._devices = tuple(range(n))
        elif 0 <= device < n:
            self._devices = (device,)
        else:
            raise ValueError(f"device {device} does not exist: expected 0..{n - 1} ({n} device(s))")
        self._base = None
        self._last = None

    # -- properties ---------------------------------------------------------------
    @property
    def source(self) -> str:
        """``"driver"``, ``"cupti"`` or ``"fake"``."""
        return self._src.name

    @property
    def exact(self) -> bool:
        """``False`` for CUPTI (lower bounds), else ``True``."""
        return self._src.exact

    @property
    def running(self) -> bool:
        return self._base is not None

    @property
    def counts(self) -> FaultCounts:
        """The counts of the last :meth:`stop`; while running, :meth:`read`."""
        if self._base is not None:
            return self.read()
        if self._last is None:
            raise RuntimeError("FaultCounter has not counted yet: call start() (or use it in a with block)")
        return self._last

    gpu_faults = property(lambda self: self.counts.gpu_faults, doc="``counts.gpu_faults``")
    cpu_faults = property(lambda self: self.counts.cpu_faults, doc="``counts.cpu_faults``")
    bytes_htod = property(lambda self: self.counts.bytes_htod, doc="``counts.bytes_htod`` (bytes)")
    bytes_dtoh = property(lambda self: self.counts.bytes_dtoh, doc="``counts.bytes_dtoh`` (bytes)")

    # -- counting -----------------------------------------------------------------
    def _sync(self) -> None:
        sync = self._backend.device_synchronize
        for d in self._devices:
            sync(d)

    def _delta(self) -> FaultCounts:
        now = self._src.read()
        b = self._base
        return FaultCounts(now[0] - b[0], now[1] - b[1], now[2] - b[2], now[3] - b[3], self._src.name, self._src.exact)

    def start(self) -> FaultCounter:
        """Synchronise the device(s), so that work queued earlier is not
        counted, and take the starting snapshot. Returns ``self``.

        Raises:
            RuntimeError: already running.
        """
        if self._base is not None:
            raise RuntimeError("FaultCounter.start(): already running; call stop() first")
        self._last = None  # a failed stop() must not leave the previous run's counts behind
        self._src.acquire()
        try:
            self._sync()
            self._base = self._src.read()
        except BaseException:
            self._src.release()
            raise
        return self

    def read(self) -> FaultCounts:
        """The counts since :meth:`start`, without stopping (after a device
        synchronisation); after :meth:`stop`, the final counts.

        Raises:
            RuntimeError: never started.
        """
        if self._base is None:
            if self._last is None:
                raise RuntimeError("FaultCounter.read(): not started; call start() first")
            return self._last
        self._sync()
        return self._delta()

    def stop(self) -> FaultCounts:
        """Synchronise, read, stop; returns the counts since :meth:`start`.

        Raises:
            RuntimeError: not running.
        """
        if self._base is None:
            raise RuntimeError("FaultCounter.stop(): not running; call start() first")
        try:
            self._sync()
            self._last = self._delta()
        finally:
            self._base = None
            self._src.release()
        return self._last

    def __enter__(self) -> FaultCounter:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._base is not None:
            self.stop()

    def __str__(self) -> str:
        """The counts (:class:`FaultCounts`) once counted, e.g. after a ``with`` block."""
        if self._base is None and self._last is not None:
            return str(self._last)
        return repr(self)

    def __repr__(self) -> str:
        state = "running" if self._base is not None else ("stopped" if self._last is not None else "new")
        return f"<FaultCounter source={self.source!r} devices={list(self._devices)} {state}>"


def count(source=None, device=None, backend=None) -> FaultCounter:
    """A :class:`FaultCounter` for a ``with`` block::

        with faults.count() as c:
            ...
        c.gpu_faults, c.bytes_htod, c.counts

    Same arguments and errors as :class:`FaultCounter`.
    """
    return FaultCounter(source=source, device=device, backend=backend)


def available() -> dict:
    """Which sources this process can use: ``{"driver": None or the reason it
    is unavailable, "cupti": None or the reason}``. Never raises.

    The driver source is opened to answer (cheap, kept open). CUPTI is only
    probed (cupti-python importable and a CUDA device present) unless it was
    already opened in this process, because setting it up makes this process
    CUPTI's one user; its activity API is first enabled by a counter.
    """
    out = {}
    try:
        _sources.open_source("driver", _real_backend)
        out["driver"] = None
    except FaultCountersUnavailable as exc:
        out["driver"] = exc.reasons.get("driver", str(exc))
    except Exception as exc:  # noqa: BLE001 - a report must not crash
        out["driver"] = f"probe failed: {exc}"
    v = _sources.cached("cupti")
    if isinstance(v, str):
        out["cupti"] = v
    elif v is not None:
        out["cupti"] = None
    else:
        try:
            _cupti.import_cupti()
            _real_backend()
            out["cupti"] = None
        except FaultCountersUnavailable as exc:
            out["cupti"] = exc.reasons.get("cupti", str(exc))
        except MemstratError as exc:
            out["cupti"] = f"CUDA is not usable: {exc}"
        except Exception as exc:  # noqa: BLE001
            out["cupti"] = f"probe failed: {exc}"
    return out


def status() -> str:
    """One line for ``python -m cupy_memstrat info``: which counters this
    machine offers, and why not the others. Never raises."""
    try:
        a = available()
    except Exception as exc:  # noqa: BLE001
        return f"unknown (probe failed: {exc})"
    drv, cup = a.get("driver"), a.get("cupti")
    if drv is None:
        src = _sources.cached("driver")
        head = src.describe() if isinstance(src, DriverCounters) else "driver counters (exact)"
        tail = "CUPTI fallback available" if cup is None else f"CUPTI unavailable: {cup}"
        return f"{head}; {tail}"
    if cup is None:
        return f"CUPTI records only (lower bounds, ~2x slower faults); driver counters unavailable: {drv}"
    return f"unavailable: driver: {drv}; CUPTI: {cup}"
