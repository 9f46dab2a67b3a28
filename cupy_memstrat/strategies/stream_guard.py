"""Ordering for caches keyed by a stream's handle (RMM's pool resources,
PyTorch's caching allocator, CuPy's own pool), when CuPy destroys a stream.

Such a cache gives a block freed on stream handle ``H`` back to the next
allocation on ``H`` at once, with no event: the stream is taken to be the
same one. CUDA gives a destroyed stream's handle to the next stream created,
even while the destroyed stream's kernels still run, and does not order the
new stream after them (measured on the H200: docs/streams.md). A block the
old stream's kernel still writes would then go to the new stream.

:class:`DeadStreamGuard` closes that window for allocations made through a
strategy: it watches each ``cupy.cuda.Stream`` (that owns its handle) an
allocation is made on, and when one dies, the next allocation on that
device first waits for the device (``cudaDeviceSynchronize``), so the dead
stream's work is done before any block cached under its handle is handed
out again. One synchronisation per destroyed stream that allocated, none on
the hot path otherwise.
"""

from __future__ import annotations

import weakref

__all__ = ["DeadStreamGuard"]

# CuPy's legacy default stream (0), cudaStreamLegacy (1), cudaStreamPerThread (2): never destroyed
_BUILTIN_HANDLES = (0, 1, 2)


class DeadStreamGuard:
    """Watch the streams allocations are made on; after one dies, make the
    next allocation on its device wait for the device first.

    Args:
        backend: the CUDA seam (``device_synchronize(device)``,
            ``stream_owns_handle(stream)``).
        n_devices: devices to track.

    The weak reference's callback only sets a flag (it runs in the stream's
    deallocation, possibly inside the garbage collector): the synchronisation
    itself happens in :meth:`before_allocation`, on the allocating thread.
    """

    def __init__(self, backend, n_devices: int):
        self._backend = backend
        self._watched: list[dict[int, weakref.ref]] = [{} for _ in range(n_devices)]
        self.pending = [False] * n_devices
        #: synchronisations made because a watched stream died (per device)
        self.n_syncs = [0] * n_devices

    def before_allocation(self, stream, device: int) -> None:
        """Call before each allocation on ``device`` with CuPy's current
        stream object there. Waits for the device if a watched stream of it
        died since; starts watching ``stream``."""
        if self.pending[device]:
            self.pending[device] = False
            self._backend.device_synchronize(device)
            self.n_syncs[device] += 1
        key = getattr(stream, "ptr", 0)
        if key in _BUILTIN_HANDLES:
            return
        watched = self._watched[device]
        r = watched.get(key)
        if r is not None and r() is stream:
            return
        owns = getattr(self._backend, "stream_owns_handle", None)
        if owns is not None and not owns(stream):
            return  # a wrapper of a stream someone else owns: its death destroys nothing
        pending = self.pending

        def gone(ref, device=device, key=key):
            if watched.get(key) is ref:
                del watched[key]
            pending[device] = True

        try:
            watched[key] = weakref.ref(stream, gone)
        except TypeError:  # a stream type without weak references
            pass
