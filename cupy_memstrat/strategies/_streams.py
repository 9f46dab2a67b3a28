"""``record_stream`` for :class:`~cupy_memstrat.strategies.base.Strategy`:
blocks other streams still use, given back once the work queued on those
streams at the free is done (docs/streams.md).

An internal module of :mod:`cupy_memstrat.strategies`: :class:`_StreamsMixin`
is one of the classes ``Strategy`` is composed of (its tables, ``_recorded``,
``_pending`` and ``_poll_lock``, are set in ``Strategy.__init__``; the hot
path calls ``_defer`` and ``_poll_pending``). :func:`check_stream` is public
as ``cupy_memstrat.strategies.base.check_stream``.
"""

from __future__ import annotations

import sys
import threading

from .. import backends as _backends
from .._userwarn import warn_at_user

__all__ = ["check_stream"]


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


class _StreamsMixin:
    """``Strategy``'s stream keys, ``record_stream`` and deferred frees (no state of its own)."""

    def stream_key(self, device: int | None = None) -> int:
        """CuPy's identifier of the current stream of ``device`` (default:
        the current device): the stream's handle, or, for the per-thread
        default stream (handle ``cudaStreamPerThread`` in every thread),
        minus the calling thread's ident, as CuPy's pool keys its arenas
        (``_get_stream_identifier`` in cupy/cuda/memory.pyx, cupy#5069).

        A strategy that caches freed blocks keys its cache by it: remember
        the key at ``allocate``, put the block back under that key at
        ``deallocate``, and hand it out again only to an allocation under
        the same key (docs/streams.md); the built-in ``managed`` does so.
        """
        d = self.backend.get_device() if device is None else self._device_or_current(device)
        h = self.backend.current_stream_ptr(d)
        return -threading.get_ident() if h == _backends.STREAM_PER_THREAD else h

    # -- record_stream: blocks other streams still use ----------------------------------
    def record_stream(self, ptr: int, stream) -> bool:
        """Mark the live block at ``ptr`` (the start of an allocation of this
        strategy) as used by ``stream`` too, as PyTorch's
        ``Tensor.record_stream``: when the block is freed, no stream, its own
        included, gets it again until the work queued on ``stream`` at the
        free is done (an event recorded there at the free).

        :func:`cupy_memstrat.record_stream` validates its arguments and calls
        this on the strategy that owns the array.

        Args:
            ptr: the allocation's pointer (``array.data.mem.ptr``).
            stream: a ``cupy.cuda.Stream`` (or ``ExternalStream``); it is
                kept alive until the block is freed.

        Returns:
            bool: True if recorded; False if this strategy's frees already
            wait for every stream (``device``: ``cudaFree`` synchronises the
            device), so there is nothing to record.

        Raises:
            ValueError: ``ptr`` is not a live allocation of this strategy.
        """
        check_stream(stream)
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise TypeError(f"ptr: expected an int pointer, got {type(ptr).__name__} {ptr!r}")
        d = self.accounts.device_of(ptr)
        if d is None:
            raise ValueError(f"{self.name}: {ptr:#x} is not the start of a live allocation of this strategy")
        sdev = getattr(stream, "device_id", -1)
        if isinstance(sdev, int) and not isinstance(sdev, bool) and sdev >= 0 and sdev != d:
            raise ValueError(f"stream: {stream!r} is on device {sdev}, but the block at {ptr:#x} is on device {d}")
        if self.backend.stream_destroyed(stream.ptr):
            raise ValueError(f"stream: {stream!r} (handle {stream.ptr:#x}) was destroyed")
        if self.free_waits_for_all_streams:
            return False
        handle = stream.ptr
        tid = threading.get_ident() if handle == _backends.STREAM_PER_THREAD else None
        dev = getattr(stream, "device_id", d)
        recs = self._recorded.setdefault(ptr, [])
        if not any(r[1] == handle and r[3] == tid and r[2] == dev for r in recs):
            recs.append((stream, handle, d if dev is None or dev < 0 else dev, tid))
        return True

    def _defer(self, ptr: int, size: int, device: int, *keep) -> list | None:
        """A block with recorded streams was freed (the hot path's free): an
        event on each recorded stream, and the block waits in ``_pending``
        until they are done. Where an event cannot be recorded (a stream
        destroyed since, or another thread's per-thread default stream), the
        device is synchronised instead and the block is given back at once.
        ``keep``: what the entry also holds for :meth:`_give_back_pending`
        (``pool``'s direct route: CuPy's memory object of the block). Returns
        the pending entry (``[events, ptr, size, device, *keep]``), or None if
        the block was given back at once. Never raises (CuPy frees from
        finalisers)."""
        b = self.backend
        recs = self._recorded.pop(ptr, ())
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
                warn_at_user(f"{self.name}: synchronising before freeing 0x{ptr:x} failed: {exc}", RuntimeWarning)
            self._give_back_pending([events, ptr, size, device, *keep])
            return None
        entry = [events, ptr, size, device, *keep]
        self._pending.append(entry)
        return entry

    def _destroy_events(self, events) -> None:
        b = self.backend
        for _dev, ev in events:
            try:
                b.event_destroy(ev)
            except Exception:  # noqa: BLE001
                b.clear_last_error()

    def _poll_pending(self, wait=None) -> None:
        """Give back the pending blocks (freed with recorded streams) whose
        events are done, oldest first, stopping at the first that is not
        (PyTorch's caching allocator does the same). ``wait``: ids of entries
        to give back without asking their events (the caller synchronised the
        devices after they were queued)."""
        if not self._poll_lock.acquire(blocking=False):
            return  # another thread is at it (or this one, re-entered from a finaliser)
        try:
            pend, b = self._pending, self.backend
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
                self._give_back_pending(entry)
        finally:
            self._poll_lock.release()

    def _flush_pending(self) -> None:
        """Synchronise the devices with pending blocks and give back those
        that were pending before the synchronisation (trim, out-of-memory
        recovery, close); one another thread defers meanwhile waits for its
        own events."""
        if not self._pending:
            return
        before = list(self._pending)
        devices = {p[3] for p in before} | {d for p in before for d, _ in p[0]}
        for d in sorted(devices):
            self.backend.device_synchronize(d)
        self._poll_pending(wait={id(p) for p in before})

    def _give_back_pending(self, entry: list) -> None:
        """A pending entry of :meth:`_defer` whose recorded streams are done
        (or were synchronised): its block goes back (:meth:`_give_back_block`).
        Must not raise."""
        self._give_back_block(entry[1], entry[2], entry[3])

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """What a free does after the accounting: give the block to the
        strategy's cache or back to CUDA (here: ``deallocate``). Caching
        strategies override it. Must not raise."""
        try:
            self._hooks()[1](ptr)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            self.backend.clear_last_error()
            warn_at_user(f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
                         RuntimeWarning)
