"""The ``pool`` strategy: CuPy's default ``MemoryPool``, with the statistics
every strategy keeps.

CuPy's own allocator (``cupy.get_default_memory_pool().malloc``) keeps no
per-allocation record that can be asked "what is live, and since when". This
strategy puts the shared accounting of :class:`~cupy_memstrat.Strategy` in
front of that very pool: each allocation takes a block from the pool and keeps
its ``MemoryPointer`` until CuPy frees the array; the block then goes back to
the pool, which caches it exactly as without this strategy. It is what the
pytest plugin measures through when no strategy is asked for.
"""

from __future__ import annotations

import contextlib

from .. import backends as _backends
from ..options import Option
from .foreign_reserve import ForeignReserve
from ._contract import ProvidedHooks
from .base import Strategy
from .pool_direct import DirectRoute
from .stream_deaths import shared_guard

__all__ = ["CuPyPoolStrategy", "route_status"]

_ROUTES = ("wrap", "direct")


def _as_route(value, what: str) -> str:
    if isinstance(value, str) and value.strip().lower() in _ROUTES:
        return value.strip().lower()
    raise ValueError(f"{what}: expected one of {', '.join(map(repr, _ROUTES))}, got {value!r}")


def _bad_block(pool, mp, ptr, twice: bool) -> TypeError | RuntimeError:
    """The error for a block that a pool's ``malloc`` handed out wrong (a ``memory_pool`` of
    the program's own; CuPy's never does)."""
    if twice:
        return RuntimeError(f"memory_pool: {pool!r} handed out 0x{ptr:x} again while it is still in use")
    return TypeError(f"memory_pool: {pool!r}.malloc returned {mp!r}, whose .ptr is {ptr!r}: expected a "
                     "cupy.cuda.MemoryPointer with an int pointer > 0")


def _pooled_memory_takes_attributes() -> bool:
    """Whether CuPy's ``PooledMemory`` has a ``__dict__`` (CuPy 14.2 does),
    where the direct route keeps its token."""
    from cupy.cuda import memory

    return getattr(getattr(memory, "PooledMemory", None), "__dictoffset__", 0) != 0


def route_status(hot_path: str, cuda: bool = True) -> dict:
    """The route a ``pool`` strategy made now with the default ``route``
    takes, for ``info``: ``{"route": "direct" | "wrap", "reason": str}``,
    given which hot path new strategies get (``"c"`` or ``"python"``,
    :func:`cupy_memstrat.hot_path_status`) and whether the backend is CUDA
    (``cuda=False``: the fake backend, which has no CuPy pool). Never raises:
    no CuPy is a reason too."""
    if not cuda:
        return {"route": "wrap", "reason": "the simulated GPU has no CuPy pool (on a CUDA device: direct, "
                                           "where CuPy's PooledMemory has a __dict__)"}
    if hot_path != "c":
        return {"route": "wrap", "reason": "the direct route needs the C hot path"}
    try:
        dict_ok = _pooled_memory_takes_attributes()
    except ImportError as exc:
        return {"route": "wrap", "reason": f"no CuPy ({exc})"}
    if not dict_ok:
        return {"route": "wrap", "reason": "this CuPy's PooledMemory has no __dict__ for the direct route's token"}
    return {"route": "direct", "reason": "CuPy gets its pool's own MemoryPointer"}


class CuPyPoolStrategy(ProvidedHooks, Strategy):
    """CuPy's default memory pool (``cupy.get_default_memory_pool()``), with
    per-allocation statistics and live-allocation tracking.

    Allocation: ``pool.malloc(size)``; the returned ``MemoryPointer`` is kept
    (pointer -> ``MemoryPointer``) so the block stays allocated. Free: the
    ``MemoryPointer`` is dropped and the pool caches the block, as it does for
    CuPy's own arrays. The pool is shared with anything else in the process
    that uses it (CuPy itself, when this strategy is not installed).

    Statistics: ``bytes_in_use`` / ``peak_bytes_in_use`` as requested by CuPy
    (the pool rounds each block up to 512 bytes); ``bytes_reserved`` is the
    pool's ``total_bytes()`` on the device (everything it holds from CUDA, in
    use or cached, including blocks handed out to others).
    ``peak_bytes_reserved`` is the highest reserved value seen when the
    statistics were read, and never below ``peak_bytes_in_use``: the pool
    reports no high-water mark, and asking it on every allocation would cost
    time on the hot path.

    :meth:`trim` calls the pool's ``free_all_blocks()``.

    Dead streams: CuPy's pool finds a stream's free blocks by the stream's
    handle, and CUDA gives a destroyed stream's handle to the next new stream
    while the destroyed one's kernels may still run, so under CuPy's pool
    alone that stream can get a block they still write (docs/streams.md).
    This strategy watches the streams it allocates on
    (:attr:`guard`, a
    :class:`~cupy_memstrat.strategies.stream_deaths.DeadStreamGuard`): after
    one dies, the next allocation waits for the device first
    (``cudaDeviceSynchronize``), once per destroyed stream that allocated.

    ``memory_pool`` (a keyword of the constructor, not an option of the spec):
    the pool to take blocks from instead of CuPy's default one, a
    ``cupy.cuda.MemoryPool`` of the program's own (``MemoryPool(malloc_managed)``)
    or an object with its interface (``malloc(size) -> MemoryPointer``, raising
    ``cupy.cuda.memory.OutOfMemoryError``; ``total_bytes()``;
    ``free_all_blocks()``). With a backend other than CUDA
    (``cupy_memstrat.testing.FakeBackend``) and no ``memory_pool`` there is no
    CuPy pool: it allocates with the backend's ``malloc`` / ``free`` and caches
    nothing (``bytes_reserved`` equals ``bytes_in_use``).

    Options, besides the common ones:

    ``route`` (``"direct"``, the default, or ``"wrap"``): how CuPy's arrays
    get their blocks. ``"direct"``: CuPy gets the pool's own
    ``MemoryPointer``, as with CuPy's default allocator, and the free is seen
    through a small object kept in the pool's memory object (csrc/hotpath.c,
    ``PoolDirect``); it takes less time per allocation than ``"wrap"``
    (docs/benchmarks.md). It needs the C hot path, CUDA, and CuPy's
    ``PooledMemory`` with a ``__dict__`` (CuPy 14.2 has one); elsewhere (the
    fake backend without a ``memory_pool``, ``CUPY_MEMSTRAT_HOT_PATH=python``)
    ``"wrap"`` runs (:attr:`route` says which one does). ``"wrap"``: through CuPy's ``PythonFunctionAllocator``,
    each array's memory object ours, holding the pool's ``MemoryPointer``.
    With ``"direct"``, :func:`cupy_memstrat.record_stream` keeps the
    recorded array's memory object, so that its block reaches CuPy's pool
    only once the recorded streams' work is done; its free is seen at the
    next allocation, read of the statistics, :meth:`trim` or :meth:`close`,
    and when the strategy stops being CuPy's allocator (:func:`use` of
    another, the end of :func:`using`) it lets such blocks go, as below.
    A block recorded through
    :meth:`Strategy.record_stream` (the pointer alone) is CuPy's again when
    its free is seen: that free synchronises the devices concerned before it
    returns, and another thread meanwhile can get the block on its stream
    (docs/streams.md).
    """

    name = "pool"
    aliases = ("cupy",)
    block_granule = 512
    description = "CuPy's default MemoryPool, with per-allocation statistics (what CuPy does by default, measured)"
    reserved_is_in_use = False
    options = (
        Option("route", _as_route, "direct", "direct | wrap: how CuPy's arrays get the pool's blocks (direct: "
               "the pool's own objects; wrap: through a PythonFunctionAllocator)"),
    )

    def __init__(self, *, backend=None, memory_pool=None, **options):
        if memory_pool is not None:
            lacks = [m for m in ("malloc", "total_bytes", "free_all_blocks")
                     if not callable(getattr(memory_pool, m, None))]
            if lacks:
                raise TypeError(f"memory_pool: expected a cupy.cuda.MemoryPool (or an object with its malloc, "
                                f"total_bytes and free_all_blocks), got {type(memory_pool).__name__} "
                                f"{memory_pool!r}, which lacks {', '.join(lacks)}")
        super().__init__(backend=backend, **options)
        n = self.backend.device_count()
        #: what CuPy's pool holds, read as bytes_reserved (:class:`~.foreign_reserve.ForeignReserve`)
        self.foreign = ForeignReserve(n, self._foreign_reserved)
        #: route="direct": the part that runs it (:class:`~cupy_memstrat.strategies.pool_direct.DirectRoute`),
        #: once CuPy's allocator is made; None on the route "wrap"
        self.direct_route = None
        real = isinstance(self.backend, _backends.RealBackend)
        if memory_pool is None and real:
            import cupy

            memory_pool = cupy.get_default_memory_pool()
        #: CuPy's pool finds a stream's free blocks by the stream's handle, which CUDA gives a new
        #: stream while a destroyed one's kernels may still run: after a stream that allocated
        #: dies, the next allocation waits for the device (docs/streams.md). One guard for every
        #: pool strategy over the same CuPy pool (over the same fake backend), since they share it.
        self.guard = shared_guard(memory_pool if memory_pool is not None else "pool", self.backend, n)
        current_stream, get_device, before = self.backend.current_stream, self.backend.get_device, \
            self.guard.before_allocation

        def guarded(take):  # each route's allocation, behind the guard
            def allocate(size):
                d = get_device()
                before(current_stream(d), d)  # before CuPy's pool hands out a block cached under a dead handle
                return take(size)

            return allocate

        if memory_pool is None:
            self._pool = None
            self.reserved_is_in_use = True  # nothing cached: the backend's malloc/free
            self._provide_hooks(guarded(self.backend.malloc), self.backend.free)
            return
        import cupy
        from cupy.cuda.memory import OutOfMemoryError

        self._pool = memory_pool
        self._OutOfMemoryError = OutOfMemoryError
        self._Device = cupy.cuda.Device
        blocks: dict = {}  # ptr -> MemoryPointer: holds the pool's block
        self._blocks = blocks
        pool_malloc, Error, status = memory_pool.malloc, self._Error, _backends.ERROR_MEMORY_ALLOCATION

        def take(size):
            try:
                mp = pool_malloc(size)
            except OutOfMemoryError:  # the pool already freed its cache and retried
                raise Error(status) from None
            ptr = getattr(mp, "ptr", None)
            if type(ptr) is not int or ptr <= 0:
                raise _bad_block(memory_pool, mp, ptr, twice=False)
            if blocks.setdefault(ptr, mp) is not mp:  # one dict operation: kept, or another block there
                raise _bad_block(memory_pool, mp, ptr, twice=True)
            return ptr

        self._provide_hooks(guarded(take), blocks.pop)  # dropping the MemoryPointer returns the block

    @property
    def route(self) -> str:
        """The route CuPy's arrays take through this strategy: ``"direct"``
        or ``"wrap"``, which can differ from the ``route`` option (see the
        class docstring for when ``"direct"`` falls back). Asking makes the
        CuPy allocator if :func:`cupy_memstrat.use` has not yet (no memory is
        allocated)."""
        if self._pool is not None and self._cupy_malloc is None:
            self._make_cupy_malloc()
        return "direct" if self.direct_route is not None else "wrap"

    def cupy_allocator(self):
        """As :meth:`Strategy.cupy_allocator`; over a pool (CuPy's, or the ``memory_pool``
        given), on the route ``"direct"``, the route's own callable
        (:attr:`direct_route`)."""
        if self._pool is None:
            return super().cupy_allocator()
        if self._cupy_malloc is None:
            self._make_cupy_malloc()
        return self._cupy_malloc

    # -- route="direct" --------------------------------------------------------------
    def _cupy_route(self, malloc, free):
        """CuPy's allocator callable: the base's (route ``"wrap"``), or with
        ``route="direct"``, a pool and the C hot path, the route's ``PoolDirect``
        over the pool and this strategy's tables."""
        acc = getattr(malloc, "__self__", None)
        if (self.config["route"] != "direct" or self._pool is None or self.hot_path != "c" or acc is None
                or not _pooled_memory_takes_attributes()):
            return super()._cupy_route(malloc, free)
        self.direct_route = DirectRoute(self, self._pool.malloc, self._OutOfMemoryError, self.guard)
        self._gc_safe = True  # CuPy's PooledMemory is not tracked by the garbage collector
        return self.direct_route.allocator, acc

    def hold_recorded(self, mem) -> None:
        """:func:`cupy_memstrat.record_stream` recorded a stream on the block of CuPy's memory
        object ``mem``: on the route ``"direct"``, the route holds it (:meth:`DirectRoute.hold
        <cupy_memstrat.strategies.pool_direct.DirectRoute.hold>`)."""
        if self.direct_route is not None:
            self.direct_route.hold(mem)

    def _settle(self) -> None:
        if self.direct_route is not None:
            self.direct_route.reap()

    def uninstalled(self) -> None:
        """As :meth:`Strategy.uninstalled`: on the route ``"direct"``, the held blocks are let go
        (:meth:`DirectRoute.stop_holding <cupy_memstrat.strategies.pool_direct.DirectRoute.stop_holding>`)."""
        if self.direct_route is not None:
            self.direct_route.stop_holding()

    def close_when_empty(self) -> None:
        """As :meth:`Strategy.close_when_empty`, the held blocks let go first (:meth:`uninstalled`)."""
        self.uninstalled()
        super().close_when_empty()

    def raw_malloc(self, size: int, device: int | None = None) -> int:
        if self.direct_route is not None and self.direct_route.held:
            self.direct_route.reap()  # as the direct route's allocations do
        return super().raw_malloc(size, device)

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        if self._pool is not None and self.config["route"] == "direct" and ptr not in self._blocks:
            return  # a block of CuPy's arrays: the pool's already, or once _give_back_pending drops it
        super()._give_back_block(ptr, size, device)

    def _give_back_pending(self, entry: list) -> None:
        if len(entry) > 4:
            return  # a block of CuPy's arrays (direct route): its memory object, if any, goes with the entry
        super()._give_back_pending(entry)

    def close(self) -> None:
        """As :meth:`Strategy.close`; held blocks whose arrays still live
        are let go (their frees then wait for the recorded streams as the
        free of a block recorded through :meth:`Strategy.record_stream` does)."""
        super().close()
        self.uninstalled()

    # -- the pool, per device ----------------------------------------------------
    def _pool_total(self, device: int) -> int:
        if self.backend.get_device() == device:
            return int(self._pool.total_bytes())
        if not self.backend.context_active(device):
            # No CUDA context there: the pool holds nothing on it, and making
            # the device current to ask would create one (seconds, and
            # hundreds of MiB of its memory, per process).
            return 0
        with self._Device(device):  # not the current device: made current for the question
            return int(self._pool.total_bytes())

    def _on(self, device: int):
        """A context making ``device`` current (nothing to do when it is)."""
        return contextlib.nullcontext() if self.backend.get_device() == device else self._Device(device)

    def _foreign_reserved(self, device: int) -> int | None:
        return None if self._pool is None else self._pool_total(device)

    def stats(self, device: int | None = None):
        """As :meth:`Strategy.stats`; ``bytes_reserved`` is what the other allocator holds on
        the device (the class docstring says which), and ``peak_bytes_reserved`` the highest
        of those reads and of the peak in use."""
        return self.foreign.adjust(super().stats(device))

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """As :meth:`Strategy.reset_peak`; the reserved peak restarts from what the other
        allocator holds now."""
        d = self._device_or_current(device)
        super().reset_peak(d, reserved=reserved)
        if reserved:
            self.foreign.restart_peak(d)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give the CuPy pool's cached (free) blocks back to CUDA
        (``free_all_blocks()``) and return the bytes released.

        CuPy's pool can only release all its free blocks: with ``keep_bytes``
        > 0 they are released only where the pool holds more than
        ``keep_bytes``. Blocks in use are never released. Without CUDA (fake
        backend) nothing is cached: this returns the bytes of blocks that
        waited for :func:`cupy_memstrat.record_stream`'d streams, given back
        after a synchronisation, else 0.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = self._trim_devices(keep_bytes, device)  # every value checked before anything is released
        waiting = self.deferred.waiting_bytes() if self._pool is None else 0
        self.deferred.flush()  # blocks waiting for recorded streams go back to the pool first
        # without CuPy's pool (the fake backend) they went back to the backend: released now
        released = waiting - self.deferred.waiting_bytes() if self._pool is None else 0
        for d, keep in devices:
            if self._pool is None:
                continue
            before = self._pool_total(d)
            if before == 0 or (keep and before <= keep):
                continue
            with self._on(d):
                self._pool.free_all_blocks()
            released += before - self._pool_total(d)
        return released
