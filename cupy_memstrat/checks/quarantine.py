"""The ``poison`` and ``redzone`` checks: freed blocks filled with
:data:`POISON_BYTE` and held in a quarantine, red zones of
:data:`CANARY_BYTE` after each allocation, and the kernels that verify both
(see the package docstring and docs/checks.md).

:class:`QuarantineChecks` holds the checks' methods; the allocation path in
:mod:`cupy_memstrat.checks.layer` pads the block and fills the red zone
inline.
"""

from __future__ import annotations

import collections
import threading
import weakref

from ..sizes import format_count, format_size
from ..stats import capture_origin
from .findings import Finding, live_layers, quiet_warn, thread_name

__all__ = ["POISON_BYTE", "CANARY_BYTE", "QuarantineChecks"]

#: the byte freed blocks are filled with (NaN in float16/32/64 and bfloat16, -1 in signed ints)
POISON_BYTE = 0xFF
#: the byte red zones are filled with
CANARY_BYTE = 0xCB

_verifiers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # check kernels -> their _Verifier


class _Verifier:
    """Result slots of the check kernels of one backend, shared by every
    checked strategy on it: which slot holds which block's check.

    No lock: CuPy frees memory from finalisers, which the garbage collector
    runs in the middle of whatever allocates a Python object, this class's
    own code included. A lock held there deadlocks (a pytest-xdist worker
    running CuPy's test suite hangs). Each step is one GIL-atomic list or
    dict operation instead.
    """

    def __init__(self, kernels, backend):
        self.kernels, self.backend = kernels, backend
        self.free: dict[int, list[int]] = {}
        self.pending: dict[int, dict[int, tuple]] = {}

    def submit(self, device: int, ptr: int, start: int, end: int, pattern: int, stream: int, info: tuple) -> None:
        free = self.free.get(device)
        if free is None:
            free = self.free.setdefault(device, list(range(self.kernels.SLOTS)))
            self.pending.setdefault(device, {})
        try:
            slot = free.pop()
        except IndexError:  # every slot is waiting: finish them (a synchronisation)
            for layer, finding in self.collect(device):
                layer._report(finding)
            slot = free.pop()
        pend = self.pending[device]
        pend[slot] = info
        try:
            self.kernels.verify(device, ptr, start, end, pattern, slot, stream)
        except BaseException:
            pend.pop(slot, None)
            free.append(slot)
            raise

    def collect(self, device: int | None = None) -> list:
        """Wait for the queued checks (of ``device``, or all) and return
        ``(layer, Finding)`` for each that found damage."""
        out = []
        # the slots to finish are those queued before the synchronisation
        todo = {d: list(self.pending[d]) for d in ([device] if device is not None else list(self.pending))
                if self.pending.get(d)}
        for d in todo:
            self.backend.device_synchronize(d)
        # A kernel that finds damage sets the host-mapped flag: without it
        # there is nothing to read (no copy of the result slots).
        flagged = self.kernels.flagged()
        if device is None:
            self.kernels.clear_flag()  # every kernel has finished; later damage sets it again
        for d, slots in todo.items():
            pend, free = self.pending[d], self.free[d]
            bad = self.kernels.read(d) if flagged else {}
            for slot in slots:
                info = pend.pop(slot, None)
                if info is None:
                    continue
                free.append(slot)
                r = bad.get(slot)
                if r is not None and r[0]:
                    layer = info[1]
                    out.append((layer, layer._gpu_finding(info, r)))
        return out


class QuarantineChecks:
    """The ``poison`` and ``redzone`` checks' part of
    :class:`~cupy_memstrat.checks.CheckedStrategy`."""

    def _init_quarantine(self) -> None:
        self._quarantine: collections.deque = collections.deque()  # (ptr, padded, device, StreamRecord, info)
        self._q_bytes = 0
        self._verifier = None

    def _verifier_of(self) -> _Verifier:
        v = self._verifier
        if v is None:
            kernels = self.backend.check_kernels()
            v = _verifiers.get(kernels)
            if v is None:
                v = _verifiers[kernels] = _Verifier(kernels, self.backend)
            self._verifier = v
        return v

    def _after_free(self, ptr, size, padded, device, origin, ent, tid) -> None:
        b = self.backend
        try:
            cur_dev = b.get_device()
            if cur_dev != device:
                b.set_device(device)
            try:
                sptr = ent.handle
                if ent.ref() is None:  # the allocating stream is gone: wait for its work, use the null stream
                    self._synchronize(device)
                    sptr = 0
                fstream = b.current_stream(device).ptr
                info = (self, ptr, size, padded, device, origin, capture_origin(0), ent.handle, fstream, tid,
                        threading.current_thread().name)
                if self._redzone or (self._poison and not self._closed):
                    self._mark_own_work(device, sptr)
                if self._redzone:
                    self._verifier_of().submit(device, ptr, size, padded, CANARY_BYTE, sptr, ("redzone",) + info)
                if self._poison and not self._closed:
                    b.memset_async(ptr, POISON_BYTE, padded, sptr)
                    self._quarantine.append((ptr, padded, device, ent, info))
                    self._q_bytes += padded
                    while self._quarantine and (
                        len(self._quarantine) > self._q_limit_count or self._q_bytes > self._q_limit_bytes
                    ):
                        self._release_oldest()
                    return
            finally:
                if cur_dev != device:
                    b.set_device(cur_dev)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            quiet_warn(f"cupy_memstrat.checks: checking the free of 0x{ptr:x} failed: {exc!r}")
        self._inner_free(ptr, device)

    def _release_oldest(self) -> None:
        ptr, padded, device, ent, info = self._quarantine.popleft()
        self._q_bytes -= padded
        try:
            sptr = ent.handle
            if ent.ref() is None:
                self._synchronize(device)
                sptr = 0
            self._mark_own_work(device, sptr)
            self._verifier_of().submit(device, ptr, 0, padded, POISON_BYTE, sptr, ("poison",) + info)
        except Exception as exc:  # noqa: BLE001
            quiet_warn(f"cupy_memstrat.checks: verifying the poison of 0x{ptr:x} failed: {exc!r}")
        self._inner_free(ptr, device)

    def _synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize``, after deciding what the stream checks
        waiting on events can decide (a synchronisation finishes their events)."""
        for layer in live_layers():
            if layer._deferred:
                layer._poll_deferred()
        self.backend.device_synchronize(device)

    def drain(self, device: int | None = None) -> None:
        """Verify every quarantined block (of ``device``, or of every device) and give it back to
        the strategy this layer checks; a block that fails verification is reported as a
        finding. What :func:`cupy_memstrat.using` does when a layer over a strategy passed in
        ends while arrays live."""
        if device is None:
            while self._quarantine:
                self._release_on_device(self._quarantine[0][2])
            return
        keep = collections.deque()
        while self._quarantine:
            item = self._quarantine.popleft()
            if item[2] == device:
                self._quarantine.appendleft(item)
                self._release_on_device(device)
            else:
                keep.append(item)
        self._quarantine.extend(keep)

    def _release_on_device(self, device: int) -> None:
        b = self.backend
        cur = b.get_device()
        if cur != device:
            b.set_device(device)
        try:
            self._release_oldest()
        finally:
            if cur != device:
                b.set_device(cur)

    def _gpu_finding(self, info: tuple, result: tuple) -> Finding:
        check, _, ptr, size, padded, device, origin, free_site, astream, fstream, tid, fthread = info
        n_bad, first = result
        if check == "redzone":
            kind = "out-of-bounds write"
            msg = (
                f"{format_count(n_bad, 'byte')} of the red zone after a {format_size(size)} block "
                f"0x{ptr:x} on device {device} changed, the first at offset {first} (byte {first - size + 1} "
                "past the end): something wrote past the end of the array before it was freed"
            )
        else:
            kind = "write after free"
            msg = (
                f"{format_count(n_bad, 'byte')} of a freed {format_size(size)} block 0x{ptr:x} on "
                f"device {device} changed while it was in quarantine, the first at offset {first}: something "
                "wrote to the array's memory after it was freed"
            )
        return Finding(
            kind=kind, check=check, message=msg, device=device, ptr=ptr, size=size, alloc_site=origin,
            free_site=free_site, alloc_stream=astream, free_stream=fstream, alloc_thread=thread_name(tid),
            free_thread=fthread, bad_bytes=n_bad, first_bad_offset=first, strategy=self.name,
        )
