"""The hot path of a strategy that caches freed blocks in per-stream *arenas* of free
lists by size (``managed``, ``expandable``): in C (``csrc/hotpath``'s classes mode) or
as the Python model of it.

An arena is ``(small, large)``: ``small[(size + 511) >> 9]`` is the free list of a
small size (up to ``small_max`` bytes; several entries may share one list), and
``large[(size + 511) & -512]`` the free list of a larger size, made by the strategy's
slow path. ``arenas[device][key]`` is the arena of the stream with CuPy's stream key
``key`` (:meth:`~cupy_memstrat.Strategy.stream_key`). An allocation pops a block from the
current stream's arena, or calls the strategy's ``miss(size, device, key)``; a free puts the
block back in the arena it was allocated from (``owner[ptr & ~(chunk_bytes - 1)]``, else
``arena_of(ptr, device)``), whatever stream is current, so that only later work on that
stream reuses it. A block freed with recorded streams (:func:`cupy_memstrat.record_stream`)
waits in the strategy's deferred frees instead.
"""

from __future__ import annotations

import threading

from ..stats import origin_capture
from ._support import FOLD_AT, c_accounting

__all__ = ["build_arena_hot_path"]


def build_arena_hot_path(strategy, *, arenas, owner, arena_of, chunk_bytes: int, small_max: int, miss,
                         large_hit=None, stream_source=None):
    """``(malloc, free, kind)`` for ``strategy``: the C hot path's classes mode when the
    extension is built (``kind`` ``"c"``), else its Python model (``"python"``).

    Args:
        arenas: per device, a dict stream key -> arena (the strategy's tables, read live).
        owner: dict ``ptr & ~(chunk_bytes - 1)`` -> the arena a block there goes back to.
        arena_of: ``arena_of(ptr, device)`` -> the arena, where ``owner`` has none.
        chunk_bytes: a power of two: the unit ``owner`` is keyed by.
        small_max: the largest size served from ``small`` (bytes).
        miss: ``miss(size, device, key) -> ptr``: the slow path; it recovers from out of
            memory itself (or raises :class:`~cupy_memstrat.OutOfMemoryError`).
        large_hit: ``large_hit(ptr, size, device, key)`` after a block was taken from
            ``large``, or None.
        stream_source: ``(capsule or None, stream_ptr)``, where ``stream_ptr(device)`` is
            the handle of the device's current stream (default: the backend's, see
            ``current_stream_ptr`` in :mod:`cupy_memstrat.backends`).
    """
    b = strategy.backend
    accounts = strategy.accounts
    track = strategy._track_origins
    deferred = strategy.deferred
    recorded, pending, poll, defer, watch = (deferred.recorded, deferred.pending, deferred.poll, deferred.defer,
                                             strategy._watch)
    unknown_free = strategy._unknown_free
    capsule, stream_ptr = stream_source or (b.current_stream_ptr_capsule(), b.current_stream_ptr)
    Accounting = c_accounting(track)
    if Accounting is not None:
        acc = strategy._new_accounting(
            Accounting, unknown_free, strategy.recovery.allocation_failed,
            arenas=arenas, owner=owner, arena_of=arena_of, chunk_bytes=chunk_bytes,
            stream_ptr=stream_ptr, capsule=capsule, small_max=small_max, miss=miss, large_hit=large_hit,
            recorded=recorded, defer=defer, pending=pending, poll=poll, watch=watch,
        )
        return acc.malloc, acc.free, "c"

    events, live, origins = accounts.events, accounts.live, accounts.origins
    capture = origin_capture(track)  # the first frame, or track_origins=N frames
    fold, get_ident, mask = accounts.fold, threading.get_ident, ~(chunk_bytes - 1)

    def malloc(size, device):
        if pending:  # blocks freed with record_stream() whose streams may be done
            poll()
        key = stream_ptr(device)
        if key == 2:  # cudaStreamPerThread: one stream per thread (cupy#5069)
            key = -get_ident()
        arena = arenas[device].get(key)
        ptr = 0
        if arena is not None:
            lst = arena[0][(size + 511) >> 9] if size <= small_max else arena[1].get((size + 511) & -512)
            if lst:
                try:
                    ptr = lst.pop()
                except IndexError:  # another thread took the last one
                    pass
                else:
                    if large_hit is not None and size > small_max:
                        large_hit(ptr, size, device, key)
        if not ptr:  # none free in this stream's arena: the slow path
            ptr = miss(size, device, key)
        ev = events[device]
        ev.append(size)  # the accounting rule (strategies/_support.py)
        if track:
            origins[ptr] = capture(1)
        live[device][ptr] = size
        if len(ev) > FOLD_AT:
            fold(device)
        return ptr

    def free(ptr, device, stacklevel=1):
        try:
            size = live[device].pop(ptr)
        except (KeyError, IndexError, TypeError):
            device, size = unknown_free(ptr, stacklevel)
            if size is None:
                return
        if track:
            origins.pop(ptr, None)
        events[device].append(-size)  # after the pop (the accounting rule, strategies/_support.py)
        if recorded and ptr in recorded:
            defer(ptr, size, device)  # other streams use it: cached once they are done
        else:
            # back to the arena of the stream it was allocated on, whatever stream is current
            arena = owner.get(ptr & mask) or arena_of(ptr, device)
            if size <= small_max:
                arena[0][(size + 511) >> 9].append(ptr)
            else:
                lst = arena[1].get((size + 511) & -512)
                if lst is None:
                    lst = arena[1].setdefault((size + 511) & -512, [])
                lst.append(ptr)
        if watch[0] is not None and not live[device]:
            watch[0]()

    return malloc, free, "python"
