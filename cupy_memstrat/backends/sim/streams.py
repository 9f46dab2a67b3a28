"""The fake's streams: CuPy's current stream per thread and device, stream
handles reused after a destroy as CUDA reuses them
(:class:`cupy_memstrat.backends.StreamBackend`)."""

from __future__ import annotations

import threading

from .. import codes as _codes
from ..protocols import Backend



class FakeStream:
    """A simulated CUDA stream, standing in for ``cupy.cuda.Stream``: ``ptr``
    (the handle), ``device_id``; ``with s:`` makes it the current stream of
    its device in this thread; destroyed by :meth:`destroy` or when it dies."""

    owns_handle = True  # destroys its handle when it dies (cupy.cuda.Stream)
    simulated_stream = True  # what check_stream takes in place of CuPy's BaseStream

    def __init__(self, backend: Backend, device: int, ptr: int, non_blocking: bool = False):
        self._backend = backend
        self.device_id = device
        self.ptr = ptr
        self.non_blocking = non_blocking
        self._destroyed = False

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """``cudaStreamDestroy`` (the default streams, handles 0-2, cannot be destroyed)."""
        b = self._backend
        if self.ptr > 2 and self.ptr not in b._destroyed_streams and not self._destroyed:
            self._destroyed = True
            b._destroyed_streams.add(self.ptr)
            b._destroyed_order.append(self.ptr)

    def synchronize(self) -> None:
        self._backend.stream_synchronize(self.ptr)

    def __enter__(self):
        self._backend._stream_stack(self.device_id).append(self)
        return self

    def __exit__(self, *exc):
        self._backend._stream_stack(self.device_id).pop()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"<FakeStream 0x{self.ptr:x} on device {self.device_id}>"


class _FakeExternalStream(FakeStream):
    """:meth:`FakeBackend.external_stream`: a stream someone else owns."""

    owns_handle = False

    def destroy(self) -> None:
        pass


class _StreamMixin:
    """Streams: handles, the per-thread stacks of current streams and the
    destroyed handles given back to new streams."""

    def _init_streams(self, devices: int, per_thread_default_stream: bool) -> None:
        self._null_streams = [FakeStream(self, d, 0) for d in range(devices)]
        # CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: CuPy's default stream is then
        # cudaStreamPerThread, handle 2 in every thread, one stream per thread
        self.per_thread_default_stream = bool(per_thread_default_stream)
        self._ptds = [FakeStream(self, d, _codes.STREAM_PER_THREAD) for d in range(devices)]
        self._destroyed_streams: set[int] = set()
        self._destroyed_order: list[int] = []  # handles a new stream may get back (see stream())
        self._n_ghosts = 0
        self._stream_device: dict[int, int] = {}
        self._stream_flags: dict[int, int] = {}
        self._next_handle = 0x1000

    # -- streams --------------------------------------------------------------
    def stream(self, device: int | None = None, non_blocking: bool = False) -> FakeStream:
        """A new stream on ``device`` (default: the current device);
        ``non_blocking``: created with ``cudaStreamNonBlocking`` (no implicit
        ordering with the legacy default stream)."""
        device = self.get_device() if device is None else device
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        with self._lock:
            handle = self._reusable_handle(device)
            if not handle:
                self._next_handle += 0x100
                handle = self._next_handle
            self._stream_device[handle] = device
            self._stream_flags[handle] = 1 if non_blocking else 0
            return FakeStream(self, device, handle, non_blocking)

    def _reusable_handle(self, device: int) -> int:
        # CUDA may give a new stream the handle of a destroyed one at once,
        # while the destroyed stream's queued work still runs, and the new
        # stream's work is not ordered after it (docs/streams.md).
        # The fake always does so, latest destroyed first; the old work stays
        # queued under a key of its own until a synchronisation or finish()
        # completes it.
        for handle in reversed(self._destroyed_order):
            if self._stream_device.get(handle) == device:
                self._destroyed_order.remove(handle)
                self._destroyed_streams.discard(handle)
                done = self._completed.pop(handle, 0)
                left = self._submitted.pop(handle, 0) - done
                ghost = None
                if left > 0:
                    self._n_ghosts += 1
                    ghost = (device, "destroyed", self._n_ghosts)
                    self._submitted[ghost] = left
                for ev, rec in list(self._events.items()):  # events recorded on the old stream stay its own
                    if rec is not None and rec[0] == handle:
                        self._events[ev] = None if ghost is None or rec[1] <= done else (ghost, rec[1] - done)
                return handle
        return 0

    def busy_destroyed_streams(self, device: int | None = None) -> int:
        """How many destroyed streams still have queued work (their handles
        given to new streams or not): a block of theirs handed to another
        stream now could still be written by that work."""
        with self._lock:
            n = 0
            for key, sub in self._submitted.items():
                if self._completed.get(key, 0) >= sub:
                    continue
                if isinstance(key, tuple):
                    n += len(key) == 3 and key[1] == "destroyed" and (device is None or key[0] == device)
                elif key in self._destroyed_streams and (device is None or self._stream_device.get(key) == device):
                    n += 1
            return n

    def _work_key(self, stream: int):
        if stream == _codes.STREAM_PER_THREAD:  # one stream per thread behind the one handle
            return (self.get_device(), 2, threading.get_ident())
        return (self.get_device(), 0) if stream <= 2 else stream

    def stream_destroyed(self, stream: int) -> bool:
        """Whether ``stream`` was destroyed (real CUDA cannot say safely)."""
        return stream in self._destroyed_streams

    def _stream_stack(self, device: int) -> list:
        stacks = getattr(self._local, "streams", None)
        if stacks is None:
            stacks = self._local.streams = [[] for _ in self._capacity]
        return stacks[device]

    def null_stream(self, device: int | None = None) -> FakeStream:
        """The legacy default stream of ``device`` (``cupy.cuda.Stream.null``);
        ``with fake.null_stream():`` makes it current, as code that hard-codes
        it does."""
        return self._null_streams[self.get_device() if device is None else device]

    def current_stream(self, device: int = -1) -> FakeStream:
        """The calling thread's current stream on ``device`` (CuPy's
        ``get_current_stream``): the innermost ``with`` stream, else the null stream."""
        if device == -1:
            device = self.get_device()
        stack = self._stream_stack(device)
        if stack:
            return stack[-1]
        return (self._ptds if self.per_thread_default_stream else self._null_streams)[device]

    def current_stream_ptr(self, device: int) -> int:
        """The handle of the calling thread's current stream on ``device``."""
        return self.current_stream(device).ptr

    def external_stream(self, stream) -> "FakeStream":
        """A wrapper of ``stream`` (an object with ``.ptr``) that does not own
        it, as ``cupy.cuda.ExternalStream`` wraps a stream someone else made:
        ``with`` makes it current; it destroys nothing when it dies."""
        return _FakeExternalStream(self, stream.device_id, stream.ptr, getattr(stream, "non_blocking", False))

    def stream_owns_handle(self, stream) -> bool:
        """Whether ``stream`` destroys its handle when it dies."""
        return bool(getattr(stream, "owns_handle", True))

    def current_stream_ptr_capsule(self):
        """None: the fake has no C function for :meth:`current_stream_ptr`."""
        return None

    def _stream_key(self, stream: int):
        if stream in self._destroyed_streams:
            self._fail(_codes.ERROR_INVALID_RESOURCE_HANDLE)
        # handles 0-2 (legacy / per-thread default) mean the current device's;
        # cudaStreamPerThread (2) is the calling thread's own stream
        return self._work_key(stream)

    def stream_synchronize(self, stream: int) -> None:
        """``cudaStreamSynchronize``: orders the frees queued on ``stream``
        and applies the release thresholds of its device's pools."""
        with self._lock:
            key = self._stream_key(stream)
            self._synchronized(key[0] if isinstance(key, tuple) else self._stream_device[key], key)
            self._completed[key] = self._submitted.get(key, 0)
