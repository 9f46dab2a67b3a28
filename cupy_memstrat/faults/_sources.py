"""Where counts come from: the fake backend's counters, and the process-wide
``"driver"`` and ``"cupti"`` sources, each opened once per process (lazily,
thread-safe; a failure is remembered, and a fork child opens its own).
Internal to :mod:`cupy_memstrat.faults`.
"""

from __future__ import annotations

import os
import threading

from ..errors import FaultCountersUnavailable
from ._cupti import open_cupti_counters
from ._errors import unavailable
from ._uvm import DriverCounters, open_driver_counters

# ---------------------------------------------------------------------------
# The fake source
# ---------------------------------------------------------------------------

_FAKE_KEYS = ("gpu_faults", "cpu_faults", "bytes_htod", "bytes_dtoh")


def is_fake(backend) -> bool:
    """Whether ``backend`` simulates the counters (it has ``uvm_counters()``,
    as :class:`cupy_memstrat.testing.FakeBackend`)."""
    return callable(getattr(backend, "uvm_counters", None))


class FakeSource:
    """The ``"fake"`` source: a fake backend's simulated counters (exact).

    Raises:
        TypeError: ``backend`` lacks ``device_synchronize`` or
            ``device_count``; at :meth:`read`, ``uvm_counters()`` lacks
            one of the four keys.
    """

    name = "fake"
    exact = True

    def __init__(self, backend):
        missing = [m for m in ("device_synchronize", "device_count") if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(
                f"a fake backend needs uvm_counters(), device_synchronize(device) and device_count(); "
                f"{type(backend).__name__} lacks {', '.join(missing)}"
            )
        self._backend = backend

    def read(self) -> tuple[int, int, int, int]:
        c = self._backend.uvm_counters()
        try:
            return tuple(int(c[k]) for k in _FAKE_KEYS)
        except KeyError as exc:
            raise TypeError(f"uvm_counters() must return the keys {', '.join(_FAKE_KEYS)}; missing {exc}") from None

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def describe(self) -> str:
        return "fake backend counters (exact)"


# ---------------------------------------------------------------------------
# Process-wide sources: opened once, lazily, thread-safe
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_opened: dict = {}  # "driver" / "cupti" -> source object, or the reason string it failed with
_opened_pid = os.getpid()


def _open_driver(init_cuda):
    return open_driver_counters(init_cuda=init_cuda)


def _open_cupti(init_cuda):
    return open_cupti_counters(init_cuda=init_cuda)


OPENERS = {"driver": _open_driver, "cupti": _open_cupti}


def _init_cuda_with(get_backend):
    def init():
        backend = get_backend()
        for d in range(backend.device_count()):
            backend.device_synchronize(d)  # creates the context: CUDA opens /dev/nvidia-uvm

    return init


def _check_pid() -> None:
    global _opened_pid
    pid = os.getpid()
    if pid != _opened_pid:  # a fork child: the parent's trackers count the parent
        for v in _opened.values():
            if isinstance(v, DriverCounters):
                v.close()
        _opened.clear()
        _opened_pid = pid


def open_source(name: str, get_backend):
    """The process's source ``name`` (``"driver"`` or ``"cupti"``), opened on
    first use (``get_backend()`` gives the backend whose devices are
    synchronised to initialise CUDA); a failure is remembered (the probe runs
    once per process).

    Raises:
        FaultCountersUnavailable: the source cannot be opened (now or at the
            first try), with the reason.
    """
    v = _opened.get(name)
    if v is None or os.getpid() != _opened_pid:
        with _lock:
            _check_pid()
            v = _opened.get(name)
            if v is None:
                try:
                    v = OPENERS[name](_init_cuda_with(get_backend))
                except FaultCountersUnavailable as exc:
                    v = exc.reasons.get(name, str(exc))
                _opened[name] = v
    if isinstance(v, str):
        raise unavailable(name, v)
    return v


def cached(name: str):
    """The source ``name`` as opened in this process, the reason string it
    failed with, or ``None`` if it was not tried. Opens nothing."""
    return _opened.get(name)


def select(source, get_backend):
    """The source ``source`` (:func:`open_source`), or with ``None`` the
    first of ``"driver"``, ``"cupti"`` that opens.

    Raises:
        FaultCountersUnavailable: the source asked for cannot be opened; with
            ``None``, neither can (``reasons`` has both).
    """
    if source is not None:
        return open_source(source, get_backend)
    reasons = {}
    for name in ("driver", "cupti"):
        try:
            return open_source(name, get_backend)
        except FaultCountersUnavailable as exc:
            reasons[name] = exc.reasons.get(name, str(exc))
    raise FaultCountersUnavailable(
        "no page-fault counters are available: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()),
        reasons,
    )


def reset() -> None:
    """Forget the process-wide sources (tests only; closes the driver tracker)."""
    with _lock:
        for v in _opened.values():
            if isinstance(v, DriverCounters):
                v.close()
        _opened.clear()

