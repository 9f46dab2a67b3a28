"""The ``poison`` and ``redzone`` checks: freed blocks filled with
:data:`POISON_BYTE` and held in a quarantine, red zones of
:data:`CANARY_BYTE` after each allocation, and the kernels that verify both
(see the package docstring and docs/checks.md).

:class:`Quarantine` is the checking layer's part that owns the freed blocks
held poisoned and queues the verification kernels; the allocation path in
:mod:`cupy_memstrat.checks.layer` pads the block and fills the red zone
inline.
"""

from __future__ import annotations

import collections
import threading
import weakref

from ..sizes import format_count, format_size
from ..stats import capture_origin
from .findings import Finding, quiet_warn, thread_name

__all__ = ["POISON_BYTE", "CANARY_BYTE", "Quarantine"]

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
            for owner, finding in self.collect(device):
                owner.report(finding)
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
        ``(Quarantine, Finding)`` for each that found damage: the part that
        queued the check, whose ``report`` takes the finding."""
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
                    owner = info[1]
                    out.append((owner, owner.gpu_finding(info, r)))
        return out


class Quarantine:
    """The ``poison`` and ``redzone`` checks' state, one per checking layer:
    the freed blocks held poisoned (oldest first) and the kernels that verify
    them and the red zones.

    Args:
        backend: the CUDA seam (``memset_async``, ``check_kernels()``).
        poison: hold freed blocks filled with :data:`POISON_BYTE`.
        redzone: red-zone bytes after each block (0: off).
        limit_bytes, limit_count: held at most; the oldest block leaves first
            when either is passed.
        give_back: ``give_back(ptr, device)`` frees a block to the strategy
            the layer checks.
        stream_order: the layer's :class:`~cupy_memstrat.checks.stream_order.StreamOrder`,
            told before this part queues work on a stream.
        synchronize: ``synchronize(device)`` waits for the device after
            deciding what the stream checks can decide.
        report: called with each :class:`Finding` of a verification.
    """

    def __init__(self, backend, *, poison, redzone, limit_bytes, limit_count, give_back, stream_order,
                 synchronize, report):
        self.backend, self.poison, self.redzone = backend, poison, redzone
        self.limit_bytes, self.limit_count = limit_bytes, limit_count
        self.give_back, self.stream_order, self.synchronize, self.report = (
            give_back, stream_order, synchronize, report)
        self._held: collections.deque = collections.deque()  # (ptr, padded, device, StreamRecord, info)
        self.held_bytes = 0
        self.closed = False  # after close(), frees are verified and given back at once
        self._verifier = None

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._held)

    def verifier(self) -> _Verifier:
        """The result slots of the check kernels of this backend (shared by every layer on it)."""
        v = self._verifier
        if v is None:
            kernels = self.backend.check_kernels()
            v = _verifiers.get(kernels)
            if v is None:
                v = _verifiers[kernels] = _Verifier(kernels, self.backend)
            self._verifier = v
        return v

    def after_free(self, ptr, size, padded, device, origin, ent, tid) -> None:
        """A checked block was freed: queue its red-zone verification, fill it
        with poison and hold it (or give it back at once where poison is off
        or the layer is closed). Never raises: a failure warns and the block
        goes back."""
        b = self.backend
        try:
            cur_dev = b.get_device()
            if cur_dev != device:
                b.set_device(device)
            try:
                sptr = ent.handle
                if ent.ref() is None:  # the allocating stream is gone: wait for its work, use the null stream
                    self.synchronize(device)
                    sptr = 0
                fstream = b.current_stream(device).ptr
                info = (self, ptr, size, padded, device, origin, capture_origin(0), ent.handle, fstream, tid,
                        threading.current_thread().name)
                if self.redzone or (self.poison and not self.closed):
                    self.stream_order.mark_own_work(device, sptr)
                if self.redzone:
                    self.verifier().submit(device, ptr, size, padded, CANARY_BYTE, sptr, ("redzone",) + info)
                if self.poison and not self.closed:
                    b.memset_async(ptr, POISON_BYTE, padded, sptr)
                    self._held.append((ptr, padded, device, ent, info))
                    self.held_bytes += padded
                    while self._held and (
                        len(self._held) > self.limit_count or self.held_bytes > self.limit_bytes
                    ):
                        self._release_oldest()
                    return
            finally:
                if cur_dev != device:
                    b.set_device(cur_dev)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            quiet_warn(f"cupy_memstrat.checks: checking the free of 0x{ptr:x} failed: {exc!r}")
        self.give_back(ptr, device)

    def _release_oldest(self) -> None:
        ptr, padded, device, ent, info = self._held.popleft()
        self.held_bytes -= padded
        try:
            sptr = ent.handle
            if ent.ref() is None:
                self.synchronize(device)
                sptr = 0
            self.stream_order.mark_own_work(device, sptr)
            self.verifier().submit(device, ptr, 0, padded, POISON_BYTE, sptr, ("poison",) + info)
        except Exception as exc:  # noqa: BLE001
            quiet_warn(f"cupy_memstrat.checks: verifying the poison of 0x{ptr:x} failed: {exc!r}")
        self.give_back(ptr, device)

    def drain(self, device: int | None = None) -> None:
        """Queue the verification of every held block (of ``device``, or of
        every device) and give it back."""
        if device is None:
            while self._held:
                self._release_on_device(self._held[0][2])
            return
        keep = collections.deque()
        while self._held:
            item = self._held.popleft()
            if item[2] == device:
                self._held.appendleft(item)
                self._release_on_device(device)
            else:
                keep.append(item)
        self._held.extend(keep)

    def close(self) -> None:
        """Give every held block back; later frees are verified and given back at once."""
        self.closed = True
        self.drain()

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

    def gpu_finding(self, info: tuple, result: tuple) -> Finding:
        """The finding of a verification that found ``result`` (bytes
        changed, the first offset) in the block ``info`` describes."""
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
            free_thread=fthread, bad_bytes=n_bad, first_bad_offset=first,
        )
