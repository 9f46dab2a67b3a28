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

import importlib
import threading
from dataclasses import replace

from .. import cuda as _cuda
from .._userwarn import warn_at_user
from ..options import Option
from ..stats import Stats
from .base import Strategy

__all__ = ["CuPyPoolStrategy"]

_ROUTES = ("wrap", "direct")


def _as_route(value, what: str) -> str:
    if isinstance(value, str) and value.strip().lower() in _ROUTES:
        return value.strip().lower()
    raise ValueError(f"{what}: expected one of {', '.join(map(repr, _ROUTES))}, got {value!r}")


class CuPyPoolStrategy(Strategy):
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

    With a backend other than CUDA (``cupy_memstrat.testing.FakeBackend``)
    there is no CuPy pool: it allocates with the backend's ``malloc`` / ``free``
    and caches nothing (``bytes_reserved`` equals ``bytes_in_use``).

    Options, besides the common ones:

    ``route`` (``"wrap"``, the default, or ``"direct"``): how CuPy's arrays
    get their blocks. ``"wrap"``: through CuPy's ``PythonFunctionAllocator``,
    each array's memory object ours, holding the pool's ``MemoryPointer``.
    ``"direct"`` (experimental; not yet measured on a GPU): CuPy gets the
    pool's own ``MemoryPointer``, as with CuPy's default allocator, and the
    free is seen through a small object kept in the pool's memory object
    (csrc/hotpath.c, ``PoolDirect``). It needs the C hot path and CUDA;
    elsewhere (the fake backend, ``track_origins``,
    ``CUPY_MEMSTRAT_HOT_PATH=python``) ``"wrap"`` runs. With ``"direct"``, a
    block freed with :func:`cupy_memstrat.record_stream`'d streams is already
    CuPy's again when its free is seen: the free then synchronises the
    devices concerned before it returns, and another thread that allocates on
    the block's stream meanwhile can get it before the recorded streams'
    work is done (docs/streams.md).
    """

    name = "pool"
    aliases = ("cupy",)
    block_granule = 512
    description = "CuPy's default MemoryPool, with per-allocation statistics (what CuPy does by default, measured)"
    reserved_is_in_use = False
    options = (
        Option("route", _as_route, "wrap", "wrap | direct (experimental): how CuPy's arrays get the pool's blocks"),
    )

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        n = self.backend.device_count()
        self._peak_reserved = [0] * n
        self._reserved_lock = threading.Lock()
        if not isinstance(self.backend, _cuda.RealBackend):
            self._pool = None
            self.reserved_is_in_use = True  # nothing cached: the backend's malloc/free
            self._allocate = self.backend.malloc
            self._deallocate = self.backend.free
            return
        import cupy
        from cupy.cuda.memory import OutOfMemoryError

        pool = cupy.get_default_memory_pool()
        self._pool = pool
        self._OutOfMemoryError = OutOfMemoryError
        self._Device = cupy.cuda.Device
        blocks: dict = {}  # ptr -> MemoryPointer: holds the pool's block
        self._blocks = blocks
        pool_malloc, Error, status = pool.malloc, self._Error, _cuda.ERROR_MEMORY_ALLOCATION

        def allocate(size):
            try:
                mp = pool_malloc(size)
            except OutOfMemoryError:  # the pool already freed its cache and retried
                raise Error(status) from None
            ptr = mp.ptr
            blocks[ptr] = mp
            return ptr

        self._allocate = allocate
        self._deallocate = blocks.pop  # dropping the MemoryPointer returns the block to the pool

    # -- route="direct" --------------------------------------------------------------
    def _cupy_route(self, malloc, free):
        """CuPy's allocator callable: the base's (route ``"wrap"``), or with
        ``route="direct"``, CUDA and the C hot path, the extension's
        ``PoolDirect`` over the pool and this strategy's tables."""
        acc = getattr(malloc, "__self__", None)
        if self.config["route"] != "direct" or self._pool is None or self.hot_path != "c" or acc is None:
            return super()._cupy_route(malloc, free)
        hotpath = importlib.import_module("cupy_memstrat._hotpath")  # built: the C hot path runs
        direct = hotpath.PoolDirect(acc, self._pool.malloc, self._OutOfMemoryError, self._direct_failed,
                                    self._recorded_freed)
        self._gc_safe = True  # CuPy's PooledMemory is not tracked by the garbage collector
        return direct, acc

    def _direct_failed(self, size, exc):
        """route="direct": CuPy's pool raised ``OutOfMemoryError`` for
        ``size`` bytes (after freeing its cache and collecting garbage):
        the recovery every strategy makes, retrying the pool; returns the
        pool's ``MemoryPointer``, or raises this strategy's out-of-memory
        error."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        pool_malloc, OOM, Error = self._pool.malloc, self._OutOfMemoryError, self._Error
        status = _cuda.ERROR_MEMORY_ALLOCATION
        got = []

        def retry():
            try:
                mp = pool_malloc(size)
            except OOM:
                raise Error(status) from None
            got.append(mp)
            return mp.ptr

        self._recover(size, self.backend.get_device(), Error(status), retry)
        return got[-1]

    def _recorded_freed(self, ptr: int, size: int, device: int) -> None:
        """route="direct": a block with recorded streams was freed, and CuPy's
        pool has it back already: wait for the recorded streams' work (events
        recorded now, then a synchronisation). Never raises."""
        self._defer(ptr, size, device)
        try:
            self._flush_pending()
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            self.backend.clear_last_error()
            warn_at_user(f"pool: waiting for the streams recorded on 0x{ptr:x} failed: {exc}", RuntimeWarning)

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        if self._pool is not None and self.config["route"] == "direct" and ptr not in self._blocks:
            return  # a block of CuPy's arrays: CuPy's pool has it back already
        super()._give_back_block(ptr, size, device)

    # -- the pool, per device ----------------------------------------------------
    def _pool_total(self, device: int) -> int:
        if self.backend.get_device() == device:
            return int(self._pool.total_bytes())
        if not self.backend.context_active(device):
            # No CUDA context there: the pool holds nothing on it, and making
            # the device current to ask would create one (seconds, and
            # hundreds of MiB of its memory, per process).
            return 0
        with self._Device(device):
            return int(self._pool.total_bytes())

    def stats(self, device: int | None = None) -> Stats:
        """As :meth:`Strategy.stats`; ``bytes_reserved`` is the CuPy pool's
        ``total_bytes()`` on the device (see the class docstring for
        ``peak_bytes_reserved``)."""
        st = super().stats(device)
        if self._pool is None:
            return st
        reserved = self._pool_total(st.device)
        with self._reserved_lock:
            peak = max(self._peak_reserved[st.device], reserved, st.peak_bytes_in_use)
            self._peak_reserved[st.device] = peak
        return replace(st, bytes_reserved=reserved, peak_bytes_reserved=peak)

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """As :meth:`Strategy.reset_peak`; the reserved peak restarts from the
        pool's present ``total_bytes()``."""
        d = self._device_or_current(device)
        super().reset_peak(d, reserved=reserved)
        if reserved and self._pool is not None:
            with self._reserved_lock:
                self._peak_reserved[d] = self._pool_total(d)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give the CuPy pool's cached (free) blocks back to CUDA
        (``free_all_blocks()``) and return the bytes released.

        CuPy's pool can only release all its free blocks: with ``keep_bytes``
        > 0 they are released only where the pool holds more than
        ``keep_bytes``. Blocks in use are never released. Without CUDA (fake
        backend) nothing is cached and this returns 0.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = self._trim_devices(keep_bytes, device)  # every value checked before anything is released
        self._flush_pending()  # blocks waiting for recorded streams go back to the pool first
        released = 0
        for d, keep in devices:
            if self._pool is None:
                continue
            before = self._pool_total(d)
            if before == 0 or (keep and before <= keep):
                continue
            with self._Device(d):
                self._pool.free_all_blocks()
            released += before - self._pool_total(d)
        return released
