"""Ordering for caches keyed by a stream's handle (RMM's pool resources,
PyTorch's caching allocator, CuPy's own pool), when CuPy destroys a stream.

Such a cache gives a block freed on stream handle ``H`` back to the next
allocation on ``H`` at once, with no event: the stream is taken to be the
same one. CUDA gives a destroyed stream's handle to the next stream created,
even while the destroyed stream's kernels still run, and does not order the
new stream after them (docs/streams.md). A block the
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

import threading
import weakref

from .. import backends as _backends

__all__ = ["DeadStreamGuard", "shared_guard"]

_registry: dict = {}  # id(key) -> (key, guard): caches of the process (CUDA), kept for good
_registry_lock = threading.Lock()


def shared_guard(key, backend, n_devices: int) -> "DeadStreamGuard":
    """The guard of the process-wide cache ``key`` (CuPy's pool, PyTorch's
    caching allocator, an RMM resource), made on first use, so that every
    strategy over that cache sees the deaths of the streams any of them
    watched: ``use()`` and ``using()`` make a new strategy each time, over
    the same cache. With a simulated backend the table is kept on the
    backend, and goes with it."""
    with _registry_lock:
        if isinstance(backend, _backends.RealBackend):
            table = _registry
        else:
            table = backend.__dict__.setdefault("_memstrat_dead_stream_guards", {})
        hit = table.get(id(key))
        if hit is None or hit[0] is not key:
            hit = (key, DeadStreamGuard(backend, n_devices))
            table[id(key)] = hit  # the key is kept with it: its id stays its own
        return hit[1]

# CuPy's legacy default stream (0), cudaStreamLegacy (1), cudaStreamPerThread (2): never destroyed
_BUILTIN_HANDLES = (0, 1, 2)


class DeadStreamGuard:
    """Watch the streams allocations are made on; after one dies, make the
    next allocation on its device wait for the device first.

    Args:
        backend: the CUDA seam (``device_synchronize(device)``,
            ``stream_owns_handle(stream)``).
        n_devices: devices to track.

    The weak reference's callback only counts the death (it runs in the
    stream's deallocation, possibly inside the garbage collector): the
    synchronisation itself happens in :meth:`before_allocation`, on the
    allocating thread. Deaths are counted (:attr:`deaths`) and a wait
    records the count it covered (:attr:`synced`) once it has returned, so
    a wait that raises is made again, and another thread that allocates
    while one waits (CuPy releases the GIL there) waits too.

    Not seen: the death of a stream CuPy does not own (an ``ExternalStream``
    or ``Stream.from_external`` wrapper: its owner destroys the handle), and
    of a stream that allocated before the guard watched it (under CuPy's
    pool alone, before a strategy was installed).
    """

    def __init__(self, backend, n_devices: int):
        self._backend = backend
        self._watched: list[dict[int, weakref.ref]] = [{} for _ in range(n_devices)]
        #: per device: watched streams that died, and how many of those deaths a wait covered
        self.deaths = [0] * n_devices
        self.synced = [0] * n_devices
        #: synchronisations made because a watched stream died (per device)
        self.n_syncs = [0] * n_devices

    @property
    def pending(self) -> list[bool]:
        """Per device: whether a watched stream died that no wait has covered yet."""
        return [d != s for d, s in zip(self.deaths, self.synced)]

    def before_allocation(self, stream, device: int) -> bool:
        """Call before each allocation on ``device`` with CuPy's current
        stream object there. Waits for the device if a watched stream of it
        died since; starts watching ``stream``. Returns whether the guard
        will see ``stream``'s death (watched, or a default stream, which is
        never destroyed): False for a wrapper of a stream owned elsewhere."""
        key = getattr(stream, "ptr", 0)
        watched = self._watched[device]
        owns = getattr(self._backend, "stream_owns_handle", None)
        r = None if key in _BUILTIN_HANDLES else watched.get(key)
        if r is not None and r() is not stream and (owns is None or owns(stream)):
            # A stream of our own at a handle watched for another: that one is destroyed, and its
            # callback has not run yet (CuPy destroys the handle in Stream.__del__, before weak
            # references are cleared). Replacing the entry would drop the weak reference and its
            # callback with it: the death is counted here instead.
            del watched[key]
            self.deaths[device] += 1
            r = None
        target = self.deaths[device]
        if target != self.synced[device]:
            self._backend.device_synchronize(device)  # if it raises, the next allocation waits again
            if self.synced[device] < target:
                self.synced[device] = target
            self.n_syncs[device] += 1
        if key in _BUILTIN_HANDLES:
            return True
        if r is not None and r() is stream:
            return True
        if owns is not None and not owns(stream):
            return False  # a wrapper of a stream someone else owns: its death destroys nothing
        deaths = self.deaths

        def gone(ref, device=device, key=key):
            if watched.get(key) is ref:
                del watched[key]
            deaths[device] += 1

        try:
            watched[key] = weakref.ref(stream, gone)
        except TypeError:  # a stream type without weak references
            return False
        return True
