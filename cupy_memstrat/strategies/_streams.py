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
        self.deferred.record(ptr, stream, d)
        return True

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
