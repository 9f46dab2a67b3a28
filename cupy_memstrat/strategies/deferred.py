"""Blocks other streams still use: :func:`cupy_memstrat.record_stream`'s tables and
the frees they defer, a part every strategy holds (``strategy.deferred``).

A block recorded on other streams is not given back at its free: an event is
recorded on each of those streams and the block waits in :attr:`DeferredFrees.pending`
until they are done, as PyTorch's caching allocator does for
``Tensor.record_stream`` (docs/streams.md). Where an event cannot be recorded (a
stream destroyed since, or another thread's per-thread default stream), the
devices are synchronised instead. The hot paths (C and Python) read
:attr:`DeferredFrees.recorded` and :attr:`DeferredFrees.pending` at every free and
allocation, and call :meth:`DeferredFrees.defer` and :meth:`DeferredFrees.poll`.
"""

from __future__ import annotations

import sys
import threading

from .. import backends as _backends
from .._userwarn import warn_at_user

__all__ = ["DeferredFrees", "check_stream"]


def check_stream(stream) -> None:
    """A stream object: a ``cupy.cuda.Stream`` or ``ExternalStream``, or a
    stream of the simulated GPU, whose ``.ptr`` is an int handle (``cudaStream_t``) from 0 to
    2**64 - 1.

    Raises:
        TypeError: not a stream object (a raw handle, None, a str, an array or a
            ``MemoryPointer``, whose ``.ptr`` is memory: recorded as a stream, a device pointer
            crashes the process at the free under ``pool`` and ``async``).
        ValueError: a handle outside that range.
    """
    cs = sys.modules.get("cupy.cuda.stream")  # CuPy 14: Stream and ExternalStream derive from _BaseStream
    cupy_streams = tuple(c for c in (getattr(cs, n, None) for n in ("Stream", "ExternalStream", "_BaseStream",
                                                                   "BaseStream")) if isinstance(c, type))
    if not (cupy_streams and isinstance(stream, cupy_streams)
            or getattr(type(stream), "simulated_stream", False) is True):
        # the value itself only where its repr is short and safe (an array's would copy it to the host)
        shown = f" {stream!r}" if stream is None or isinstance(stream, (bool, int, float, str, bytes)) else ""
        kind = type(stream)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"stream: expected a cupy.cuda.Stream (or ExternalStream), got {name}{shown}")
    handle = getattr(stream, "ptr", None)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"stream: expected a stream object whose .ptr is an int handle, got {stream!r} "
                        f"(.ptr = {handle!r})")
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"stream: {stream!r} has the handle {handle}, which is no cudaStream_t")


class DeferredFrees:
    """The recorded streams of live blocks, and the freed blocks waiting for them.

    Args:
        backend: the strategy's backend (events, synchronisation).
        name: ``name()`` is the strategy's name, for warnings.
        give_back: ``give_back(entry)``: what the strategy does with a block
            whose recorded streams are done (an entry ``[events, ptr, size,
            device, *keep]``); must not raise.
        settle: called before each poll and flush (``pool``'s route
            ``"direct"`` first accounts the blocks it holds), or None.
    """

    def __init__(self, backend, name, give_back, settle=None):
        self.backend, self._name = backend, name
        self._give_back, self._settle = give_back, settle
        #: live ptr -> [(stream object, handle, device, thread ident or None)]
        self.recorded: dict[int, list] = {}
        #: freed blocks waiting for their recorded streams, oldest first: [events, ptr, size, device, *keep]
        self.pending: list[list] = []
        #: held while a poll gives blocks back (a second poll meanwhile returns at once)
        self.lock = threading.Lock()

    def record(self, ptr: int, stream, device: int) -> None:
        """``stream`` uses the live block at ``ptr`` (on ``device``) too; kept alive until the
        block is freed. The caller has checked both (:meth:`Strategy.record_stream`)."""
        handle = stream.ptr
        tid = threading.get_ident() if handle == _backends.STREAM_PER_THREAD else None
        dev = getattr(stream, "device_id", device)
        recs = self.recorded.setdefault(ptr, [])
        if not any(r[1] == handle and r[3] == tid and r[2] == dev for r in recs):
            recs.append((stream, handle, device if dev is None or dev < 0 else dev, tid))

    def waiting_bytes(self, device: int | None = None) -> int:
        """Bytes of freed blocks waiting for their recorded streams, on ``device`` or every device."""
        return sum(p[2] for p in list(self.pending) if device is None or p[3] == device)

    def defer(self, ptr: int, size: int, device: int, *keep) -> list | None:
        """A block with recorded streams was freed (the hot path's free): an
        event on each recorded stream, and the block waits in :attr:`pending`
        until they are done. Where an event cannot be recorded (a stream
        destroyed since, or another thread's per-thread default stream), the
        device is synchronised instead and the block is given back at once.
        ``keep``: what the entry also holds for the strategy's give-back
        (``pool``'s direct route: CuPy's memory object of the block). Returns
        the pending entry (``[events, ptr, size, device, *keep]``), or None if
        the block was given back at once. Never raises (CuPy frees from
        finalisers)."""
        b = self.backend
        recs = self.recorded.pop(ptr, ())
        events = []
        sync = False
        try:
            me = threading.get_ident()
            for _stream, handle, dev, tid in recs:
                if tid is not None and tid != me:
                    sync = True  # that thread's cudaStreamPerThread cannot be named from here
                    break
                cur = b.get_device()
                try:
                    if cur != dev:
                        b.set_device(dev)
                    ev = b.event_create()
                    try:
                        b.event_record(ev, handle)
                    except Exception:
                        b.event_destroy(ev)
                        raise
                    events.append((dev, ev))
                finally:
                    if cur != dev:
                        b.set_device(cur)
        except Exception:  # noqa: BLE001 - a destroyed stream: wait for everything instead
            b.clear_last_error()
            sync = True
        if sync:
            self._destroy_events(events)
            try:
                for dev in sorted({r[2] for r in recs} | {device}):
                    b.device_synchronize(dev)
            except Exception as exc:  # noqa: BLE001
                b.clear_last_error()
                warn_at_user(f"{self._name()}: synchronising before freeing 0x{ptr:x} failed: {exc}", RuntimeWarning)
            self._give_back([events, ptr, size, device, *keep])
            return None
        entry = [events, ptr, size, device, *keep]
        self.pending.append(entry)
        return entry

    def _destroy_events(self, events) -> None:
        b = self.backend
        for _dev, ev in events:
            try:
                b.event_destroy(ev)
            except Exception:  # noqa: BLE001
                b.clear_last_error()

    def poll(self, wait=None) -> None:
        """Give back the pending blocks (freed with recorded streams) whose
        events are done, oldest first, stopping at the first that is not
        (PyTorch's caching allocator does the same). ``wait``: ids of entries
        to give back without asking their events (the caller synchronised the
        devices after they were queued)."""
        if self._settle is not None:
            self._settle()
        if not self.lock.acquire(blocking=False):
            return  # another thread is at it (or this one, re-entered from a finaliser)
        try:
            pend, b = self.pending, self.backend
            while pend:
                events = pend[0][0]
                if not wait or id(pend[0]) not in wait:
                    done = True
                    for dev, ev in events:
                        cur = b.get_device()
                        if cur != dev:
                            b.set_device(dev)
                        try:
                            done = b.event_done(ev)
                        finally:
                            if cur != dev:
                                b.set_device(cur)
                        if not done:
                            break
                    if not done:
                        return
                entry = pend.pop(0)
                self._destroy_events(events)
                self._give_back(entry)
        finally:
            self.lock.release()

    def flush(self) -> None:
        """Synchronise the devices with pending blocks and give back those
        that were pending before the synchronisation (trim, out-of-memory
        recovery, close); one another thread defers meanwhile waits for its
        own events."""
        if self._settle is not None:
            self._settle()
        if not self.pending:
            return
        before = list(self.pending)
        devices = {p[3] for p in before} | {d for p in before for d, _ in p[0]}
        for d in sorted(devices):
            self.backend.device_synchronize(d)
        self.poll(wait={id(p) for p in before})
