"""The ``pool`` strategy's route ``"direct"``, a part it holds (``strategy.direct_route``).

CuPy gets the pool's own ``MemoryPointer``, as with CuPy's default allocator,
and the free is seen through a small object kept in the pool's memory object
(``PoolDirect`` of ``csrc/hotpath.c``), which accounts in the strategy's C hot
path. What the route owns besides:

* the held blocks: :func:`cupy_memstrat.record_stream` on an array keeps its
  memory object here, so that the array's death leaves the block out of
  CuPy's pool until the recorded streams' work is done (cupy#8068);
* the two callbacks ``PoolDirect`` makes: the pool ran out of memory
  (:meth:`DirectRoute.pool_failed`), and a block with recorded streams was freed
  (:meth:`DirectRoute.recorded_freed`).
"""

from __future__ import annotations

import importlib

from .. import backends as _backends
from .._userwarn import warn_at_user

__all__ = ["DirectRoute"]


class DirectRoute:
    """The direct route over ``pool_malloc`` for ``strategy`` (a ``pool`` strategy with the
    C hot path built), behind ``guard`` (its
    :class:`~cupy_memstrat.strategies.stream_deaths.DeadStreamGuard`).

    Args:
        strategy: the strategy whose accounts, deferred frees and recovery the route uses.
        pool_malloc: the pool's ``malloc(size) -> MemoryPointer``.
        oom_error: the exception ``pool_malloc`` raises when the pool has no memory.
        guard: the dead-stream guard, or None for none (its control in the tests).

    Raises:
        ImportError: the C extension is not built.
    """

    def __init__(self, strategy, pool_malloc, oom_error, guard):
        hotpath = importlib.import_module("cupy_memstrat._hotpath")
        self.strategy, self._pool_malloc, self._oom_error = strategy, pool_malloc, oom_error
        #: ptr -> CuPy's memory object of a block held for record_stream
        self.held: dict = {}
        accounting = strategy.hot_path_functions()[0].__self__  # the C hot path's tables
        args = (accounting, pool_malloc, oom_error, self.pool_failed, self.recorded_freed, self.held)
        if guard is not None:
            current_stream, before = strategy.backend.current_stream, guard.before_allocation

            def on_guard(device):  # PoolDirect calls it when the current stream changed or a watched one died
                return before(current_stream(device), device)

            args += (on_guard, guard.deaths, guard.synced, strategy.backend.current_stream_ptr_capsule())
        #: CuPy's allocator callable: ``allocator(size) -> MemoryPointer`` (the C ``PoolDirect``)
        self.allocator = hotpath.PoolDirect(*args)

    def hold(self, mem) -> None:
        """:func:`cupy_memstrat.record_stream` recorded a stream on the block of CuPy's memory
        object ``mem``: keep ``mem`` while the route is CuPy's allocator in this thread, so
        that the array's death leaves the block out of CuPy's pool. Once no one else refers
        to ``mem`` (:meth:`reap`, at every allocation and read of the statistics), the free is
        accounted and the block waits for the recorded streams as every strategy's does."""
        from cupy.cuda import get_allocator

        if get_allocator() is self.allocator:
            self.allocator.hold(mem)  # only a memory object the route handed out and counts now
        # (not CuPy's allocator in this thread: no allocation through it may come to reap; the
        # free then waits for the recorded streams as with Strategy.record_stream)

    def reap(self) -> None:
        """The held blocks whose arrays are gone are freed (accounted now, then deferred until
        their recorded streams' work is done). Never raises (it runs at allocations and in
        finalisers)."""
        if not self.held:
            return
        direct = self.allocator
        try:
            for ptr in direct.reap():
                direct.free_early(ptr)  # its recorded streams: recorded_freed defers the block
            for ptr in direct.stale():  # freed another way (PooledMemory.free() by hand): nothing to keep
                self.held.pop(ptr, None)
        except Exception as exc:  # noqa: BLE001
            self.strategy.backend.clear_last_error()
            warn_at_user(f"pool: freeing a block held for its recorded streams failed: {exc}", RuntimeWarning)

    def stop_holding(self) -> None:
        """No longer CuPy's allocator (the end of a :func:`cupy_memstrat.using` block, or
        :func:`cupy_memstrat.use` of another strategy), so no allocation through it may come
        to poll: the held blocks whose arrays are gone wait for their recorded streams here (a
        synchronisation) and go back to CuPy's pool, and the others are let go: their frees
        then wait for the recorded streams as those of a block recorded through
        :meth:`Strategy.record_stream` do. Never raises."""
        s = self.strategy
        if not self.held and not s.deferred.pending:
            return
        try:
            s.deferred.flush()  # blocks freed early go back after a synchronisation, never before
        except Exception as exc:  # noqa: BLE001 - use() has installed the next strategy already
            s.backend.clear_last_error()
            warn_at_user(f"pool: waiting for the streams of blocks held for record_stream failed: {exc}",
                         RuntimeWarning)
        self.held.clear()  # their arrays live: their frees wait for the recorded streams at the free

    def pool_failed(self, size, exc):
        """CuPy's pool raised its out-of-memory error for ``size`` bytes (after freeing its
        cache and collecting garbage): the recovery every strategy makes, retrying the pool;
        returns the pool's ``MemoryPointer``, or raises the strategy's
        :class:`~cupy_memstrat.OutOfMemoryError`."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        s = self.strategy
        pool_malloc, OOM, Error = self._pool_malloc, self._oom_error, s.backend.Error
        status = _backends.ERROR_MEMORY_ALLOCATION
        got = []

        def retry():
            try:
                mp = pool_malloc(size)
            except OOM:
                raise Error(status) from None
            got.append(mp)
            return mp.ptr

        s.recovery.recover(size, s.backend.get_device(), Error(status), retry)
        return got[-1]

    def recorded_freed(self, ptr: int, size: int, device: int, early: bool) -> None:
        """A block with recorded streams was freed. Freed early (held, its arrays gone): it
        waits in the deferred frees as every strategy's does. Otherwise (a block recorded
        through :meth:`Strategy.record_stream` with a pointer alone, or let go by
        :meth:`stop_holding`), CuPy's pool has it back already: wait for the recorded streams'
        work here (events recorded now, then a synchronisation). Never raises."""
        deferred = self.strategy.deferred
        # the pending entry keeps CuPy's memory object of a block freed early (dropped with the
        # entry, once the streams are done: the pool has the block then), or None: the pool has it
        if early:
            deferred.defer(ptr, size, device, self.held.pop(ptr, None))
            return
        deferred.defer(ptr, size, device, None)
        try:
            deferred.flush()
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            self.strategy.backend.clear_last_error()
            warn_at_user(f"pool: waiting for the streams recorded on 0x{ptr:x} failed: {exc}", RuntimeWarning)
