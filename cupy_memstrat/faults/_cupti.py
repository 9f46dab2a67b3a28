"""The ``"cupti"`` source: CUPTI's unified-memory activity records, through
``cupti-python``; lower bounds (CUPTI drops records under heavy paging,
docs/faults.md). Internal to :mod:`cupy_memstrat.faults`.
"""

from __future__ import annotations

import threading

from ..errors import FaultCountersUnavailable
from ._errors import unavailable

_CUPTI_BUFFER_BYTES = 8 << 20  # as NVIDIA's cupti-python samples (cupti_common.py)


class CuptiCounters:
    """CUPTI's ``UNIFIED_MEMORY_COUNTER`` activity records, summed (from
    :func:`open_cupti_counters`). The activity kind is enabled by the first
    counter that starts and stays enabled: CUPTI only sees managed memory
    allocated while it is on."""

    name = "cupti"
    exact = False

    def __init__(self, cupti):
        self._cupti = cupti
        self._lock = threading.Lock()
        self._enabled = False
        self._totals = [0, 0, 0, 0]  # gpu_faults, cpu_faults, bytes_htod, bytes_dtoh
        k = cupti.ActivityUnifiedMemoryCounterKind
        self._kind = int(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
        self._htod = int(k.BYTES_TRANSFER_HTOD)
        self._dtoh = int(k.BYTES_TRANSFER_DTOH)
        self._cpu = int(k.CPU_PAGE_FAULT_COUNT)
        self._gpu = int(k.GPU_PAGE_FAULT)
        try:
            import importlib.metadata

            self.version = importlib.metadata.version("cupti-python")
        except Exception:  # noqa: BLE001 - informational
            self.version = None

    # CUPTI calls these, possibly from its own thread.
    def _buffer_requested(self):
        return _CUPTI_BUFFER_BYTES, 0

    def _buffer_completed(self, activities):
        g = c = h = d = 0
        for a in activities:
            if int(a.kind) != self._kind:
                continue
            ck = int(a.counter_kind)
            if ck == self._htod:
                h += int(a.value)
            elif ck == self._dtoh:
                d += int(a.value)
            elif ck == self._cpu:
                c += 1  # value is the faulting instruction's address: count, never sum
            elif ck == self._gpu:
                g += 1  # one record per fault group (docs/faults.md)
        with self._lock:
            t = self._totals
            t[0] += g
            t[1] += c
            t[2] += h
            t[3] += d

    def _call(self, step, fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - cuptiError, NotSupportedError (no libcupti/libcuda)...
            raise unavailable("cupti", f"CUPTI {step} failed: {exc}") from None

    def _setup(self) -> None:
        cp = self._cupti
        self._call("activity_register_callbacks", cp.activity_register_callbacks,
                   self._buffer_requested, self._buffer_completed)
        kinds = (self._htod, self._dtoh, self._cpu, self._gpu)
        cfg = cp.ActivityUnifiedMemoryCounterConfig(len(kinds))
        for i, kind in enumerate(kinds):
            cfg[i].scope = int(cp.ActivityUnifiedMemoryCounterScope.PROCESS_ALL_DEVICES)
            cfg[i].kind = kind
            cfg[i].device_id = 0
            cfg[i].enable = 1
        self._config = cfg  # CUPTI reads it during the call; keep it anyway
        self._call("activity_configure_unified_memory_counter",
                   cp.activity_configure_unified_memory_counter, cfg.ptr, len(kinds))
        # Probe once, so that an unusable CUPTI shows at open time, not in a test.
        self._call("activity_enable(UNIFIED_MEMORY_COUNTER)", cp.activity_enable, self._kind)
        self._call("activity_disable(UNIFIED_MEMORY_COUNTER)", cp.activity_disable, self._kind)

    def acquire(self) -> None:
        # Switched on at the first counter and left on: CUPTI reports no
        # migrations of managed memory allocated while the activity kind
        # was off (docs/faults.md), so toggling it per counter would lose them.
        with self._lock:
            first = not self._enabled
            self._enabled = True
        if first:
            try:
                self._call("activity_enable(UNIFIED_MEMORY_COUNTER)", self._cupti.activity_enable, self._kind)
            except FaultCountersUnavailable:
                with self._lock:
                    self._enabled = False
                raise

    def release(self) -> None:
        self._cupti.activity_flush_all(1)

    def read(self) -> tuple[int, int, int, int]:
        """Cumulative totals after a forced flush (``activity_flush_all(1)``;
        the caller has synchronised the devices)."""
        self._cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        with self._lock:
            return tuple(self._totals)

    def describe(self) -> str:
        v = f" {self.version}" if self.version else ""
        return f"CUPTI records (lower bounds; cupti-python{v})"


def import_cupti():
    """The ``cupti.cupti`` module of cupti-python.

    Raises:
        FaultCountersUnavailable: cupti-python is not installed.
    """
    try:
        from cupti import cupti
    except ImportError as exc:
        raise unavailable(
            "cupti", f"cupti-python is not installed (pip install 'cupy-memstrat[cupti]'): {exc}"
        ) from None
    return cupti


def open_cupti_counters(*, init_cuda=None, cupti=None) -> CuptiCounters:
    """Set CUPTI up for unified-memory counters: import ``cupti.cupti``,
    initialise CUDA (CUPTI refuses the activity kind before the driver is
    initialised: ``ERROR_NOT_READY``, docs/faults.md), register the buffer
    callbacks, configure the four counters (HtoD, DtoH, CPU page faults, GPU
    page faults; process scope, all devices), and check that the activity
    kind can be enabled. ``cupti`` is a seam for tests.

    Raises:
        FaultCountersUnavailable: with the reason (``reasons["cupti"]``):
            cupti-python not installed, CUDA not usable, or the CUPTI call
            that failed and its error (e.g. ``ERROR_NOT_READY (13)``, or
            ``ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`` when another tool
            already uses CUPTI in this process).
    """
    if cupti is None:
        cupti = import_cupti()
    if init_cuda is not None:
        try:
            init_cuda()
        except Exception as exc:  # noqa: BLE001
            raise unavailable("cupti", f"CUDA is not usable: {exc}") from None
    src = CuptiCounters(cupti)
    src._setup()
    return src
