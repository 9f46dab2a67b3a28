"""Destroyed streams, for every cache keyed by a stream: one CUDA fact, handled here.

CUDA gives a destroyed stream's handle to the next stream created, even while
the destroyed stream's work still runs, and does not order the new stream after
that work (docs/streams.md). A cache that finds a stream's free blocks by its
handle would hand a block the old stream's kernel still writes to the new
stream. Every strategy that caches per stream therefore needs two things, both
here:

* :class:`StreamWatch`: notice that a stream CuPy owns has died, from a weak
  reference to the ``cupy.cuda.Stream`` object (its callback runs in the
  deallocation that destroys the handle, before the program can make another
  stream; where it has not run yet when a new stream shows up at the same
  handle, the new stream's arrival reports the old one's death). A wrapper of a
  stream owned elsewhere (``cupy.cuda.ExternalStream``) is not watched by
  handle: its death destroys nothing.
* :class:`Quarantine`: blocks that a dead stream's work may still use, kept out
  of circulation until one device synchronisation has waited for that work.

The strategies decide what a death means to their cache: ``managed`` takes the
dead stream's arena out of reach at once and reclaims its free chunks through a
quarantine; ``async`` quarantines the blocks the dead stream cached; the
adapters over other allocators' caches (CuPy's pool, PyTorch's, RMM's) wait for
the device before the next allocation (:class:`DeadStreamGuard`).
"""

from __future__ import annotations

import threading
import weakref

from .. import backends as _backends

__all__ = ["BUILTIN_HANDLES", "DeadStreamGuard", "Quarantine", "StreamWatch", "shared_guard", "watch_object"]

#: CuPy's legacy default stream (0), cudaStreamLegacy (1), cudaStreamPerThread (2): never destroyed
BUILTIN_HANDLES = (0, 1, 2)


class StreamWatch:
    """The streams of each device watched by handle, and a report of each one's death.

    Args:
        backend: the strategy's backend; its ``stream_owns_handle(stream)``, where
            it has one, tells a stream CuPy owns from a wrapper of someone else's.
        n_devices: devices to watch.
        on_death: ``on_death(device, handle)``, called once per watched stream that
            dies. It may run inside the garbage collector, in the stream's
            deallocation: it must do dict and list operations only (no lock,
            nothing CUDA).
    """

    def __init__(self, backend, n_devices: int, on_death):
        owns = getattr(backend, "stream_owns_handle", None)
        self._owns = owns
        self._on_death = on_death
        #: per device: handle -> weak reference to the watched stream
        self.watched: list[dict[int, weakref.ref]] = [{} for _ in range(n_devices)]

    def watch(self, device: int, stream) -> bool:
        """Watch ``stream`` (CuPy's stream object, current on ``device``). Returns whether its
        death will be reported: True for a default stream (never destroyed) and for one
        watched now or before; False for a wrapper of a stream owned elsewhere, or a stream
        type without weak references."""
        key = getattr(stream, "ptr", 0)
        if key in BUILTIN_HANDLES:
            return True
        watched = self.watched[device]
        r = watched.get(key)
        if r is not None:
            if r() is stream:
                return True
            if self._owns is None or self._owns(stream):
                # A stream of our own at a handle watched for another: that one is destroyed, and
                # its callback has not run yet (CuPy destroys the handle in Stream.__del__, before
                # weak references are cleared). Its death is reported now, and not again later.
                del watched[key]
                self._on_death(device, key)
        if self._owns is not None and not self._owns(stream):
            return False  # a wrapper of a stream someone else owns: its death destroys nothing
        on_death = self._on_death

        def gone(ref, device=device, key=key):
            if watched.get(key) is ref:
                del watched[key]
                on_death(device, key)

        try:
            watched[key] = weakref.ref(stream, gone)
        except TypeError:  # a stream type without weak references
            return False
        return True

    def is_watched(self, device: int, handle: int) -> bool:
        """Whether a live stream is watched at ``handle`` on ``device``."""
        r = self.watched[device].get(handle)
        return r is not None and r() is not None


def watch_object(stream, on_death) -> weakref.ref:
    """A weak reference to ``stream`` whose callback calls ``on_death(ref)`` when the stream
    object dies: for a cache kept per stream *object* (``async``'s, whose keys are these
    references: they compare equal to a plain reference while the stream lives). It may run
    inside the garbage collector: ``on_death`` does dict and list operations only.

    Raises:
        TypeError: the stream type has no weak references.
    """
    return weakref.ref(stream, on_death)


class Quarantine:
    """Blocks a dead stream's work may still use, per device, out of circulation until one
    device synchronisation waits for that work (:meth:`release`).

    Args:
        backend: the strategy's backend (``device_synchronize``, ``clear_last_error``).
        n_devices: devices.
    """

    def __init__(self, backend, n_devices: int):
        self._backend = backend
        self._items: list[list[tuple[object, int]]] = [[] for _ in range(n_devices)]
        #: per device: bytes held
        self.bytes = [0] * n_devices

    def add(self, device: int, item, nbytes: int) -> None:
        """Hold ``item`` (a block, as the strategy names it) of ``nbytes`` bytes on ``device``:
        list operations only."""
        self._items[device].append((item, nbytes))
        self.bytes[device] += nbytes

    def release(self, device: int, give) -> int:
        """One synchronisation of ``device``, then ``give(item, nbytes)`` for each block held
        there; returns the bytes given. Nothing held: no synchronisation.

        Raises:
            the backend's ``Error``: the synchronisation failed (nothing is given; the
            blocks stay held).
        """
        q = self._items[device]
        if not q:
            return 0
        b = self._backend
        b.clear_last_error()
        b.device_synchronize(device)  # the dead streams' queued work is done
        released = 0
        while q:
            try:
                item, nbytes = q.pop()
            except IndexError:  # another thread took the last one
                break
            self.bytes[device] -= nbytes
            give(item, nbytes)
            released += nbytes
        return released


# -- the adapters over other allocators' caches: wait for the device after a death ---------
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
        #: per device: watched streams that died, and how many of those deaths a wait covered
        self.deaths = [0] * n_devices
        self.synced = [0] * n_devices
        #: synchronisations made because a watched stream died (per device)
        self.n_syncs = [0] * n_devices
        deaths = self.deaths

        def died(device, handle):  # in the stream's deallocation: a list update only
            deaths[device] += 1

        self._watch = StreamWatch(backend, n_devices, died)

    @property
    def pending(self) -> list[bool]:
        """Per device: whether a watched stream died that no wait has covered yet."""
        return [d != s for d, s in zip(self.deaths, self.synced)]

    def before_allocation(self, stream, device: int) -> bool:
        """Call before each allocation on ``device`` with CuPy's current
        stream object there. Starts watching ``stream``; waits for the device
        if a watched stream of it died since. Returns whether the guard
        will see ``stream``'s death (watched, or a default stream, which is
        never destroyed): False for a wrapper of a stream owned elsewhere."""
        seen = self._watch.watch(device, stream)
        target = self.deaths[device]
        if target != self.synced[device]:
            self._backend.device_synchronize(device)  # if it raises, the next allocation waits again
            if self.synced[device] < target:
                self.synced[device] = target
            self.n_syncs[device] += 1
        return seen
