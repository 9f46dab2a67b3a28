"""The fake's managed memory: residency per 64 KiB page, faults, migrations
and the driver's counters (docs/managed.md)
(:class:`cupy_memstrat.backends.ManagedBackend`)."""

from __future__ import annotations

import operator

from .. import codes as _codes
from .core import _round_up

_MANAGED_BASE = 1 << 46  # managed memory lives in its own range, 2 MiB aligned
_MANAGED_ALIGN = 2 << 20
_PAGE = 64 << 10  # the driver migrates managed memory in 64 KiB pages (docs/claims.md)
_UNPOPULATED, _HOST_RES = -2, -1  # page residency codes; >= 0: a device


class _Managed:
    __slots__ = ("ptr", "size", "pages", "advice")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size = ptr, size
        self.pages = [_UNPOPULATED] * (-(-size // _PAGE))
        self.advice: list[tuple[int, int, int, int]] = []  # (offset, size, advice, location)


class _ManagedMixin:
    """``cudaMallocManaged`` memory, prefetch, advice and the simulated
    faults (:meth:`touch`)."""

    def _init_managed(self) -> None:
        self._managed: dict[int, _Managed] = {}
        self._next_managed = _MANAGED_BASE
        self._counters = dict(bytes_htod=0, bytes_dtoh=0, cpu_faults=0, gpu_faults=0)
        self.n_prefetch_calls = 0
        self.n_advise_calls = 0

    def _free_managed(self, ptr: int) -> bool:
        # cudaFree of managed memory (under the lock): its device pages are given back
        m = self._managed.pop(ptr, None)
        if m is None:
            return False
        for loc in m.pages:
            if loc >= 0:
                self._used[loc] -= _PAGE
        return True

    # -- managed memory ----------------------------------------------------------
    def malloc_managed(self, size: int) -> int:
        """``cudaMallocManaged``: 2 MiB-aligned; no device memory until populated."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        size = operator.index(size)  # a size_t, as CUDA's wrappers take it: a float is a TypeError
        if size < 0:
            self._fail(_codes.ERROR_INVALID_VALUE)
        if size == 0:
            self._fail(_codes.ERROR_INVALID_VALUE)  # CUDA refuses a 0-byte managed allocation
        self._contexts.add(self.get_device())
        with self._lock:
            self.n_malloc_calls += 1
            if size > sum(self._capacity) * 4:  # beyond any host + device memory
                self._fail(_codes.ERROR_MEMORY_ALLOCATION)
            ptr = self._next_managed
            self._next_managed += _round_up(size, _MANAGED_ALIGN)
            self._managed[ptr] = _Managed(ptr, size)
            return ptr

    def _managed_range(self, ptr: int, size: int) -> tuple[_Managed, int, int]:
        # (allocation, first page, end page) of [ptr, ptr + size) inside one managed allocation
        for m in self._managed.values():
            if m.ptr <= ptr < m.ptr + m.size:
                if size < 0 or ptr + size > m.ptr + m.size:
                    break
                off = ptr - m.ptr
                return m, off // _PAGE, -(-(off + size) // _PAGE)
        self._fail(_codes.ERROR_INVALID_VALUE)

    def _check_location(self, location: int) -> None:
        if type(location) is not int or not (location == _codes.HOST or 0 <= location < len(self._capacity)):
            self._fail(_codes.ERROR_INVALID_DEVICE)

    def memory_type(self, ptr: int) -> str:
        """``cudaPointerGetAttributes(ptr).type`` as a name."""
        with self._lock:
            for m in self._managed.values():
                if m.ptr <= ptr < m.ptr + m.size:
                    return "managed"
            for p, (size, _d) in self._live.items():
                if p <= ptr < p + size:
                    return "device"
            if self._mappings_in(ptr, 1):  # mapped virtual memory (sim/vmm.py)
                return "device"
        return "unregistered"

    def _move(self, m: _Managed, page: int, to: int, fault: bool) -> None:
        # one 64 KiB page of m to location `to` (a device or _HOST_RES)
        src = m.pages[page]
        if src == to:
            return
        if to >= 0:
            self._make_device_room(to, m, page)
            self._used[to] += _PAGE
        if src >= 0:
            self._used[src] -= _PAGE
        c = self._counters
        if to >= 0:
            if fault:
                c["gpu_faults"] += 1
            if src == _HOST_RES:
                c["bytes_htod"] += _PAGE
        else:
            if fault:
                c["cpu_faults"] += 1
            if src >= 0:
                c["bytes_dtoh"] += _PAGE
        m.pages[page] = to

    def _make_device_room(self, device: int, keep: _Managed, keep_page: int) -> None:
        # The driver evicts other managed pages to the host when a device is full.
        if self._used[device] + _PAGE <= self._capacity[device]:
            return
        for m in self._managed.values():
            for i, loc in enumerate(m.pages):
                if loc == device and not (m is keep and i == keep_page):
                    m.pages[i] = _HOST_RES
                    self._used[device] -= _PAGE
                    self._counters["bytes_dtoh"] += _PAGE
                    if self._used[device] + _PAGE <= self._capacity[device]:
                        return
        self._fail(_codes.ERROR_MEMORY_ALLOCATION)

    def touch(self, ptr: int, size: int, processor="device") -> None:
        """Simulate ``processor`` (a device ordinal, ``"device"`` for the
        current one, or ``"host"``) reading and writing ``[ptr, ptr + size)``
        of managed memory: pages that are elsewhere fault and migrate."""
        to = _HOST_RES if processor == "host" else (self.get_device() if processor == "device" else processor)
        if to != _HOST_RES:
            self._check_location(to)
        with self._lock:
            m, first, end = self._managed_range(ptr, size)
            for page in range(first, end):
                if m.pages[page] != to:
                    self._move(m, page, to, fault=True)

    def mem_prefetch(self, ptr: int, size: int, location: int, stream: int) -> None:
        """``cudaMemPrefetchAsync``: pages move to ``location`` with no faults."""
        self._check_location(location)
        with self._lock:
            self._stream_key(stream)
            self.n_prefetch_calls += 1
            m, first, end = self._managed_range(ptr, size)
            to = _HOST_RES if location == _codes.HOST else location
            if to >= 0 and not self._props["concurrent_managed_access"]:
                self._fail(_codes.ERROR_INVALID_DEVICE)
            for page in range(first, end):
                self._move(m, page, to, fault=False)

    def mem_advise(self, ptr: int, size: int, advice: int, location: int) -> None:
        """``cudaMemAdvise``: checked and recorded (see :meth:`advice`)."""
        if advice not in range(1, 7):
            self._fail(_codes.ERROR_INVALID_VALUE)
        self._check_location(location)
        with self._lock:
            self.n_advise_calls += 1
            m, _first, _end = self._managed_range(ptr, size)
            m.advice.append((ptr - m.ptr, size, advice, location))

    def advice(self, ptr: int) -> list[tuple[int, int, int]]:
        """Advice given for the managed allocation that holds ``ptr``:
        ``(size, advice, location)`` for each call on a range starting at ``ptr``."""
        m, _f, _e = self._managed_range(ptr, 1)
        return [(sz, adv, loc) for off, sz, adv, loc in m.advice if m.ptr + off == ptr]

    def residency(self, ptr: int, size: int) -> dict:
        """Bytes of ``[ptr, ptr + size)`` by location: ``"host"``, a device
        ordinal, or ``None`` (not populated), in 64 KiB pages (for tests)."""
        with self._lock:
            m, first, end = self._managed_range(ptr, size)
            out: dict = {}
            for loc in m.pages[first:end]:
                key = None if loc == _UNPOPULATED else ("host" if loc == _HOST_RES else loc)
                out[key] = out.get(key, 0) + _PAGE
            return out

    def uvm_counters(self) -> dict:
        """Cumulative migration counters, as the driver's counters report them:
        ``bytes_htod``, ``bytes_dtoh``, ``cpu_faults``, ``gpu_faults``."""
        with self._lock:
            return dict(self._counters)
