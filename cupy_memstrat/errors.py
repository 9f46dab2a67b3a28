"""Exceptions and warnings raised by cupy_memstrat.

``OutOfMemoryError`` subclasses CuPy's ``cupy.cuda.memory.OutOfMemoryError``
(itself a ``MemoryError``) so that code already catching CuPy's error keeps
working. It is built on first use, so importing cupy_memstrat does not import
CuPy.
"""

from __future__ import annotations

__all__ = [
    "MemstratError",
    "NoDeviceError",
    "CuPyNotInstalledError",
    "NoStrategyError",
    "InvalidFreeWarning",
    "ManagedMemoryWarning",
    "OutOfMemoryError",  # noqa: F822 - made on first use (module __getattr__)
    "FaultCountersUnavailable",
]


class MemstratError(RuntimeError):
    """Base class of cupy_memstrat's runtime errors."""


class NoDeviceError(MemstratError):
    """No CUDA device is available (no driver, no GPU, or CUDA failed to start)."""


class CuPyNotInstalledError(MemstratError, ImportError):
    """CuPy is needed for this operation and is not importable."""


class NoStrategyError(MemstratError):
    """A module-level call (``stats()``, ``live_allocations()``...) found no
    cupy_memstrat strategy installed as CuPy's allocator in this thread."""


class InvalidFreeWarning(RuntimeWarning):
    """A strategy was asked to free a pointer it does not own (unknown, or
    already freed). Nothing is freed; ``Stats.n_invalid_frees`` counts it."""


class ManagedMemoryWarning(UserWarning):
    """A managed-memory setting that is known to hurt: ``read_mostly`` advice
    on data the GPU writes, or host access on a device without
    ``concurrentManagedAccess``."""


class FaultCountersUnavailable(MemstratError):
    """No page-fault counter source could be opened (see
    :mod:`cupy_memstrat.faults`). ``reasons`` maps each source tried
    (``"driver"``, ``"cupti"``) to why it is unavailable; the message names
    them all."""

    def __init__(self, message: str, reasons: dict | None = None):
        super().__init__(message)
        self.reasons = dict(reasons or {})

    def __reduce__(self):
        return (type(self), (str(self), self.reasons))


_oom_class = None


def out_of_memory_class():
    """The :class:`OutOfMemoryError` class, made on first use (a subclass of
    CuPy's ``OutOfMemoryError`` where CuPy is installed, so that code catching
    CuPy's error catches ours). Internal to the package: not in ``__all__``."""
    global _oom_class
    if _oom_class is None:
        try:
            from cupy.cuda.memory import OutOfMemoryError as _base
        except ImportError:  # CuPy absent: fake-backend use only
            _base = MemoryError

        class OutOfMemoryError(_base):
            """A strategy could not obtain memory for a request.

            Subclass of ``cupy.cuda.memory.OutOfMemoryError``. Attributes:
            ``requested`` (bytes), ``device`` (int), ``stats`` (the strategy's
            :class:`~cupy_memstrat.Stats` for that device when it failed),
            ``strategy`` (its name), ``reason`` (what refused: ``"cuda"`` or a
            strategy-specific guard), ``snapshot`` (the file the strategy's
            ``oom_snapshot`` option wrote, or None).
            """

            def __init__(self, message, *, requested, device, stats, strategy, reason="cuda", snapshot=None):
                MemoryError.__init__(self, message)
                # CuPy's attribute names, for code that reads them.
                self._size = requested
                self._total = stats.bytes_in_use if stats is not None else -1
                self._limit = 0
                self.requested = requested
                self.device = device
                self.stats = stats
                self.strategy = strategy
                self.reason = reason
                self.snapshot = snapshot

            def __reduce__(self):
                # pickled (a Dask worker's error at the client) or copied: the same class, a subclass
                # too, with every attribute (notes included) restored from __dict__, no __init__ called
                return (_rebuild_out_of_memory, (type(self), str(self)), self.__dict__)

        OutOfMemoryError.__module__ = __name__
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _oom_class = OutOfMemoryError
    return _oom_class


def _rebuild_out_of_memory(cls, message):
    """An ``OutOfMemoryError`` of class ``cls`` (or a subclass) with ``message``; pickle then sets its
    attributes."""
    return cls.__new__(cls, message)


def __getattr__(name):
    if name == "OutOfMemoryError":
        return out_of_memory_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
