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

import threading
from dataclasses import replace

from .. import cuda as _cuda
from ..stats import Stats
from .base import Strategy

__all__ = ["CuPyPoolStrategy"]


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

    Options: only the common ones (``track_origins``).
    """

    name = "pool"
    aliases = ("cupy",)
    block_granule = 512
    description = "CuPy's default MemoryPool, with per-allocation statistics (what CuPy does by default, measured)"
    reserved_is_in_use = False

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
