"""The fake's side of the checking layer (:mod:`cupy_memstrat.checks`):
queued work, events, a model of memory contents and the verification kernels
(:class:`cupy_memstrat.backends.CheckBackend`)."""

from __future__ import annotations

import threading

from .. import codes as _codes
from ..protocols import Backend
from .core import _UINT64_MAX



class _Contents:
    """Simulated memory contents: sorted, disjoint byte runs ``[start, end)``
    with one value each; bytes never written are unknown (None)."""

    def __init__(self):
        self._starts: list[int] = []
        self._runs: list[list] = []  # [start, end, value], sorted by start
        self._lock = threading.RLock()

    def set(self, start: int, end: int, value: int) -> None:
        with self._lock:
            self._set(start, end, value)

    def _set(self, start: int, end: int, value: int) -> None:
        import bisect

        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._runs[i][1] <= start:
            i += 1
        new = []
        j = i
        while j < len(self._runs) and self._runs[j][0] < end:
            r = self._runs[j]
            if r[0] < start:
                new.append([r[0], start, r[2]])
            if r[1] > end:
                new.append([end, r[1], r[2]])
            j += 1
        new.append([start, end, value])
        new.sort()
        self._runs[i:j] = new
        self._starts[i:j] = [r[0] for r in new]

    def get(self, addr: int):
        with self._lock:
            return self._get(addr)

    def _get(self, addr: int):
        import bisect

        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._runs[i][1]:
            return self._runs[i][2]
        return None

    def mismatches(self, start: int, end: int, value: int) -> tuple[int, int]:
        """(bytes in [start, end) that are not ``value``, first such address or -1)."""
        with self._lock:
            return self._mismatches(start, end, value)

    def _mismatches(self, start: int, end: int, value: int) -> tuple[int, int]:
        import bisect

        bad, first, pos = 0, -1, start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while pos < end:
            r = self._runs[i] if i < len(self._runs) else None
            if r is None or r[0] >= end:
                bad += end - pos
                first = pos if first < 0 else first
                break
            if r[1] <= pos:
                i += 1
                continue
            if r[0] > pos:  # a gap: unknown bytes
                bad += r[0] - pos
                first = pos if first < 0 else first
                pos = r[0]
                continue
            stop = min(r[1], end)
            if r[2] != value:
                bad += stop - pos
                first = pos if first < 0 else first
            pos = stop
            i += 1
        return bad, first


class FakeCheckKernels:
    """The fake's :class:`cupy_memstrat.backends.CheckKernels`: the same
    interface, checking the contents model at once."""

    SLOTS = 1 << 14

    def __init__(self, backend: Backend):
        self._backend = backend
        self._flag = False
        self._bad: dict[int, dict[int, tuple[int, int]]] = {}
        self.n_launches = 0

    def verify(self, device: int, ptr: int, start: int, end: int, pattern: int, slot: int, stream: int) -> None:
        self._backend._stream_key(stream)
        self.n_launches += 1
        bad, first = self._backend._contents.mismatches(ptr + start, ptr + end, pattern & 0xFF)
        if bad:
            prev = self._bad.setdefault(device, {}).get(slot, (0, _UINT64_MAX))
            self._bad[device][slot] = (prev[0] + bad, min(prev[1], first - ptr))
            self._flag = True

    def flagged(self) -> bool:
        return self._flag

    def clear_flag(self) -> None:
        self._flag = False

    def read(self, device: int) -> dict:
        return self._bad.pop(device, {})


class _CheckMixin:
    """Work on streams, events and memory contents."""

    def _init_checks(self) -> None:
        self._submitted: dict = {}
        self._completed: dict = {}
        self._events: dict[int, object] = {}
        self._contents = _Contents()
        self._check_kernels = None

    # -- work on streams (the checking layer) ------------------------------------
    # A stream's queue is a count of items submitted and completed; nothing
    # completes until the test says so (finish) or a synchronisation does.
    def launch(self, stream, writes=()) -> None:
        """Simulate a kernel queued on ``stream`` (an object with ``.ptr`` or a
        handle): the stream is busy until :meth:`finish` or a synchronisation.
        ``writes``: ``(address, bytes)`` pairs the kernel writes, applied at
        once (the contents model does not order them)."""
        handle = getattr(stream, "ptr", stream)
        key = self._work_key(handle)
        with self._lock:
            self._submitted[key] = self._submitted.get(key, 0) + 1
        for addr, data in writes:
            self.write(addr, data)

    def finish(self, stream=None) -> None:
        """Complete the queued work of ``stream`` (default: every stream)."""
        with self._lock:
            if stream is None:
                self._completed.update(self._submitted)
            else:
                key = self._work_key(getattr(stream, "ptr", stream))
                self._completed[key] = self._submitted.get(key, 0)

    def stream_busy(self, stream: int) -> bool:
        """``cudaStreamQuery``: True while :meth:`launch` work is unfinished."""
        key = self._work_key(stream)
        return self._completed.get(key, 0) < self._submitted.get(key, 0)

    def stream_non_blocking(self, stream: int) -> bool:
        return bool(self._stream_flags.get(stream, 0))

    def event_create(self) -> int:
        with self._lock:
            self._next_handle += 0x100
            self._events[self._next_handle] = None
            return self._next_handle

    def event_record(self, event: int, stream: int) -> None:
        key = self._stream_key(stream)  # a destroyed stream fails
        with self._lock:
            if event not in self._events:
                self._fail(_codes.ERROR_INVALID_RESOURCE_HANDLE)
            self._events[event] = (key, self._submitted.get(key, 0))

    def event_done(self, event: int) -> bool:
        rec = self._events.get(event)
        if rec is None:
            return True
        key, ticket = rec
        return self._completed.get(key, 0) >= ticket

    def event_destroy(self, event: int) -> None:
        with self._lock:
            self._events.pop(event, None)

    # -- memory contents (the checking layer) ------------------------------------------
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """``cudaMemsetAsync``: applied at once in the contents model."""
        self._stream_key(stream)  # a destroyed stream fails
        if nbytes:
            self._contents.set(ptr, ptr + nbytes, value & 0xFF)

    def write(self, ptr: int, data: bytes) -> None:
        """Simulate a kernel (or copy) writing ``data`` at address ``ptr``."""
        for i, b in enumerate(bytes(data)):
            self._contents.set(ptr + i, ptr + i + 1, b)

    def read(self, ptr: int, nbytes: int) -> list:
        """The simulated bytes at ``ptr`` (None where nothing was written)."""
        return [self._contents.get(ptr + i) for i in range(nbytes)]

    def check_kernels(self) -> "FakeCheckKernels":
        if self._check_kernels is None:
            self._check_kernels = FakeCheckKernels(self)
        return self._check_kernels
