"""The fake's virtual memory management (``cuMemAddressReserve``, ``cuMemCreate``,
``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``, ``cuMemAddressFree``)
(:class:`cupy_memstrat.backends.VmmBackend`), written from what an H100 did
(docs/results/h100/vmm-facts.json): 2 MiB granularity, reserved ranges on 32 MiB boundaries,
64 TiB reservable at once, physical memory counted at creation, access needed after every map."""

from __future__ import annotations

import bisect
import operator

from .. import codes as _codes

_GRANULE = 2 << 20  # cuMemGetAllocationGranularity, minimum and recommended (H100, H200)
_RESERVE_ALIGN = 32 << 20  # where reserved ranges start unless a larger alignment is asked
_MAX_RESERVE = 64 << 40  # 64 TiB reserved at once worked; 256 TiB was out of memory
_VA_BASE = 0x6000_0000_0000  # the fake's reserved addresses (its devices' lie below 2**40 * 65)


class _VmmMixin:
    """Reservations, physical handles, mappings and access, for the ``expandable`` strategy."""

    def _init_vmm(self) -> None:
        self._reservations: dict[int, int] = {}  # start -> size
        self._res_starts: list[int] = []  # sorted
        self._va_next = _VA_BASE
        self._handles: dict[int, list] = {}  # handle -> [device, size, mapped at (or None), released]
        self._next_vmm_handle = 0x5000
        self._mapped: dict[int, int] = {}  # mapping start -> handle
        self._map_starts: list[int] = []  # sorted
        self._access: set[int] = set()  # mapping starts with access set
        self.n_vmm_calls = 0

    def vmm_granularity(self, device: int) -> int:
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        return _GRANULE

    def vmm_reserve(self, size: int, alignment: int = 0, hint: int = 0) -> int:
        size = operator.index(size)
        with self._lock:
            self.n_vmm_calls += 1
            if size <= 0 or size % _GRANULE or alignment < 0 or (alignment and alignment & (alignment - 1)):
                self._fail(_codes.ERROR_INVALID_VALUE)
            if size > _MAX_RESERVE:
                self._fail(_codes.ERROR_MEMORY_ALLOCATION)
            align = max(_RESERVE_ALIGN, alignment)
            if hint and hint % align == 0 and self._va_free(hint, size):
                start = hint
            else:
                start = -(-self._va_next // align) * align
            self._va_next = max(self._va_next, start + size)
            self._reservations[start] = size
            bisect.insort(self._res_starts, start)
            return start

    def _va_free(self, start: int, size: int) -> bool:
        i = bisect.bisect_right(self._res_starts, start + size - 1)
        if i == 0:
            return True
        prev = self._res_starts[i - 1]
        return prev + self._reservations[prev] <= start

    def _reservation_of(self, ptr: int, size: int) -> int | None:
        i = bisect.bisect_right(self._res_starts, ptr) - 1
        if i < 0:
            return None
        start = self._res_starts[i]
        return start if ptr + size <= start + self._reservations[start] else None

    def vmm_free_address(self, ptr: int, size: int) -> None:
        with self._lock:
            self.n_vmm_calls += 1
            if self._reservations.get(ptr) != size:
                self._fail(_codes.ERROR_INVALID_VALUE)
            if self._mappings_in(ptr, size):
                self._fail(_codes.ERROR_INVALID_VALUE)  # unmap first
            del self._reservations[ptr]
            self._res_starts.remove(ptr)

    def vmm_create(self, device: int, size: int) -> int:
        size = operator.index(size)
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        with self._lock:
            self.n_vmm_calls += 1
            if size <= 0 or size % _GRANULE:
                self._fail(_codes.ERROR_INVALID_VALUE)
            if self._used[device] + size > self._capacity[device]:
                raise self.Error(_codes.ERROR_MEMORY_ALLOCATION)  # not sticky (measured)
            self._used[device] += size
            self._contexts.add(device)
            self._next_vmm_handle += 1
            self._handles[self._next_vmm_handle] = [device, size, None, False]
            return self._next_vmm_handle

    def vmm_release(self, handle: int) -> None:
        with self._lock:
            self.n_vmm_calls += 1
            h = self._handles.get(handle)
            if h is None or h[3]:
                self._fail(_codes.ERROR_INVALID_VALUE)
            h[3] = True
            if h[2] is None:  # not mapped: the memory goes back now, else at the unmap
                self._drop_handle(handle)

    def _drop_handle(self, handle: int) -> None:
        device, size, _at, _released = self._handles.pop(handle)
        self._used[device] -= size

    def vmm_map(self, ptr: int, size: int, handle: int) -> None:
        with self._lock:
            self.n_vmm_calls += 1
            h = self._handles.get(handle)
            if (h is None or h[3] or h[2] is not None or ptr % _GRANULE or size != h[1]
                    or self._reservation_of(ptr, size) is None or self._mappings_in(ptr, size)):
                self._fail(_codes.ERROR_INVALID_VALUE)
            h[2] = ptr
            self._mapped[ptr] = handle
            bisect.insort(self._map_starts, ptr)

    def _mappings_in(self, ptr: int, size: int) -> list[int]:
        """Starts of the mappings that overlap ``[ptr, ptr + size)``."""
        out = []
        i = bisect.bisect_right(self._map_starts, ptr) - 1
        i = max(i, 0)
        while i < len(self._map_starts) and self._map_starts[i] < ptr + size:
            start = self._map_starts[i]
            if start + self._handles[self._mapped[start]][1] > ptr:
                out.append(start)
            i += 1
        return out

    def _covering(self, ptr: int, size: int) -> list[int] | None:
        """The mappings that cover ``[ptr, ptr + size)`` with no gap, or None."""
        found = self._mappings_in(ptr, size)
        at = ptr
        for start in found:
            if start > at:
                return None
            at = start + self._handles[self._mapped[start]][1]
        return found if found and at >= ptr + size else None

    def vmm_set_access(self, ptr: int, size: int, device: int) -> None:
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        with self._lock:
            self.n_vmm_calls += 1
            found = self._covering(ptr, size)
            if found is None or size <= 0:
                self._fail(_codes.ERROR_INVALID_VALUE)
            self._access.update(found)

    def vmm_unmap(self, ptr: int, size: int) -> None:
        with self._lock:
            self.n_vmm_calls += 1
            found = self._covering(ptr, size)
            if found is None or found[0] != ptr:
                self._fail(_codes.ERROR_INVALID_VALUE)
            last = found[-1]
            if last + self._handles[self._mapped[last]][1] != ptr + size:
                self._fail(_codes.ERROR_INVALID_VALUE)  # cuts a mapping in two
            for start in found:
                handle = self._mapped.pop(start)
                self._map_starts.remove(start)
                self._access.discard(start)
                h = self._handles[handle]
                h[2] = None
                if h[3]:  # released while mapped: its memory goes back now
                    self._drop_handle(handle)

    # -- inspection, for tests ------------------------------------------------
    def vmm_accessible(self, ptr: int, size: int = 1) -> bool:
        """Whether ``[ptr, ptr + size)`` is mapped with access set (a kernel may touch it)."""
        with self._lock:
            found = self._covering(ptr, size)
            return found is not None and all(s in self._access for s in found)

    def vmm_mapped_bytes(self) -> int:
        """Bytes of physical memory mapped into reserved ranges."""
        with self._lock:
            return sum(self._handles[h][1] for h in self._mapped.values())
