"""What a strategy has handed out, per device: the accounts every strategy keeps.

:class:`Accounts` owns the live table (pointer -> size, per device), the origins
of live blocks (``track_origins``), the counters behind
:class:`~cupy_memstrat.Stats`, and the two ways a hot path reports to them
without a lock:

* the Python hot path appends ``+size`` (before the live insert) and ``-size``
  (after the live pop) to a per-device event list; :meth:`Accounts.fold` folds
  the list, in order, into the counters;
* the C hot path (``csrc/hotpath.c``, its ``Accounting``) keeps C counts per
  device (the running sum, its largest value, allocations, frees) that
  :meth:`Accounts.fold` drains in one call each (:meth:`Accounts.add_drain`).

Either way the peak is the exact peak of the sequence of allocations and frees,
also with many threads. Everything else here takes :attr:`Accounts.lock`.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["Accounts", "Counters"]


class Counters:
    """One device's counts, in bytes and numbers of calls (what :class:`~cupy_memstrat.Stats` reports)."""

    __slots__ = (
        "in_use",
        "peak_in_use",
        "reserved",
        "peak_reserved",
        "n_allocs",
        "n_frees",
        "n_failed",
        "n_oom_recoveries",
    )

    def __init__(self):
        self.in_use = self.peak_in_use = self.reserved = self.peak_reserved = 0
        self.n_allocs = self.n_frees = self.n_failed = self.n_oom_recoveries = 0


class Accounts:
    """The live tables and counters of one strategy over ``n_devices`` devices.

    The hot path uses :attr:`live`, :attr:`events` and :attr:`origins`
    directly (one dict operation and one list append per call, atomic in
    CPython); everything else goes through the methods, which take :attr:`lock`.
    """

    def __init__(self, n_devices: int):
        #: per device: live pointer -> size in bytes
        self.live: list[dict[int, int]] = [{} for _ in range(n_devices)]
        #: live pointer -> its origin (track_origins), kept aside from the sizes
        self.origins: dict[int, object] = {}
        #: per device: the Python hot path's +size / -size events, folded by :meth:`fold`
        self.events: list[list[int]] = [[] for _ in range(n_devices)]
        #: per device: the counters the events and the C counts are folded into
        self.counters = [Counters() for _ in range(n_devices)]
        #: re-entrant: the statistics' readers fold under it, and so may what they call
        self.lock = threading.RLock()
        #: frees of pointers this strategy does not own (not per device: a bad pointer names none)
        self.n_invalid_frees = 0
        self._drains: list = []

    @property
    def n_devices(self) -> int:
        return len(self.counters)

    def add_drain(self, drain) -> None:
        """A C hot path's ``drain(device) -> (total, top, n_allocs, n_frees)``, called by :meth:`fold`."""
        self._drains.append(drain)

    @property
    def n_drains(self) -> int:
        """How many C hot paths report here (one per strategy: its hot path is built once)."""
        return len(self._drains)

    def fold(self, device: int) -> Counters:
        """Fold what the hot paths reported on ``device`` into its counters, and return them."""
        with self.lock:
            c = self.counters[device]
            for drain in self._drains:  # the C hot path's counts (one C call each)
                total, top, n_allocs, n_frees = drain(device)
                if n_allocs or n_frees:
                    c.peak_in_use = max(c.peak_in_use, c.in_use + top)
                    c.in_use += total
                    c.n_allocs += n_allocs
                    c.n_frees += n_frees
            ev = self.events[device]
            # Only fold removes (under the lock) and only the first n items;
            # appends racing with it land after them. Both are single C calls.
            n = len(ev)
            if n:
                deltas = np.array(ev[:n], dtype=np.int64)
                del ev[:n]
                running = np.cumsum(deltas)
                c.peak_in_use = max(c.peak_in_use, c.in_use + int(running.max()))
                c.in_use += int(running[-1])
                n_allocs = int(np.count_nonzero(deltas > 0))
                c.n_allocs += n_allocs
                c.n_frees += n - n_allocs
            return c

    def read(self, device: int, read):
        """``read(counters)`` of ``device``, folded first, under the lock: one moment's values."""
        with self.lock:
            return read(self.fold(device))

    def reset_peak(self, device: int, reserved: bool) -> None:
        """The peaks of ``device`` set to the present values (the reserved one too with ``reserved``)."""
        with self.lock:
            c = self.fold(device)
            c.peak_in_use = c.in_use
            if reserved:
                c.peak_reserved = c.reserved

    def add_reserved(self, device: int, delta: int) -> None:
        """``delta`` bytes taken from (> 0) or given back to (< 0) CUDA on ``device``."""
        with self.lock:
            c = self.counters[device]
            c.reserved += delta
            if c.reserved > c.peak_reserved:
                c.peak_reserved = c.reserved

    def note_reserved_seen(self, device: int, reserved: int) -> int:
        """For a strategy that caches nothing: ``reserved`` bytes were seen now; returns the peak seen."""
        with self.lock:
            c = self.counters[device]
            c.peak_reserved = max(c.peak_reserved, reserved)
            return c.peak_reserved

    def count_failed(self, device: int) -> None:
        """An allocation on ``device`` finally failed."""
        with self.lock:
            self.counters[device].n_failed += 1

    def count_recovery(self, device: int) -> None:
        """An allocation on ``device`` succeeded after giving memory back (``n_oom_recoveries``)."""
        with self.lock:
            self.counters[device].n_oom_recoveries += 1

    def count_invalid_free(self) -> None:
        with self.lock:
            self.n_invalid_frees += 1

    def pop_live(self, ptr) -> tuple[int, int | None]:
        """``(device, size)`` of a live pointer freed without its device, removed from the
        table; ``(-1, None)`` if no device has it (or it is not a pointer)."""
        for device, live in enumerate(self.live):
            try:
                size = live.pop(ptr, None)
            except TypeError:  # unhashable: not a pointer
                return -1, None
            if size is not None:
                return device, size
        return -1, None

    def device_of(self, ptr: int) -> int | None:
        """The device whose live table has ``ptr``, or None."""
        for device, live in enumerate(self.live):
            if ptr in live:
                return device
        return None

    def is_live(self, ptr: int, device: int) -> bool:
        return 0 <= device < len(self.live) and ptr in self.live[device]

    def any_live(self) -> bool:
        return any(self.live)

    def sizes(self, device: int | None = None) -> dict[int, int]:
        """A copy of the live table of ``device``, or of every device (None): ``{ptr: size}``."""
        if device is not None:
            return dict(self.live[device])
        if len(self.live) == 1:
            return dict(self.live[0])
        out: dict[int, int] = {}
        for live in self.live:
            out.update(live)
        return out
