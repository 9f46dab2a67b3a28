"""The ``async`` strategy: a stream-ordered pool on ``cudaMallocFromPoolAsync``."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace

from .. import backends as _backends
from ..options import Option, as_bool, as_size
from ..sizes import format_size, parse_size
from ..stats import Record, Stats, origin_capture
from .._userwarn import warn_at_user
from ._support import FOLD_AT, c_accounting
from .base import Strategy
from .stream_deaths import Quarantine, watch_object

__all__ = ["AsyncPoolStrategy", "PoolStats"]

_POOL_KINDS = ("own", "default", "current")
_DEFAULT_CACHE = 64 << 20
_CLASS = 512  # cache size classes: multiples of 512 bytes, as CuPy's own pools round
_KEEP = ("max", "keep", "inf", "unlimited")


def _as_pool(value, what: str) -> str:
    if isinstance(value, str) and value.strip().lower() in _POOL_KINDS:
        return value.strip().lower()
    raise ValueError(f"{what}: expected one of {', '.join(map(repr, _POOL_KINDS))}, got {value!r}")


def _as_threshold(value, what: str):
    """None (the default), ``"max"`` (keep everything), bytes, a size string, or ``"N%"``."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in _KEEP:
        return _backends.RELEASE_THRESHOLD_MAX
    if value == _backends.RELEASE_THRESHOLD_MAX and type(value) is int:
        return value
    return as_size(value, what)


def _as_max_size(value, what: str):
    """0 / None (no limit), bytes, a size string, or ``"N%"``."""
    if value is None:
        return 0
    return as_size(value, what)


@dataclass(frozen=True)
class PoolStats(Record):
    """What the CUDA pool behind an ``async`` strategy reports for one device
    (``cudaMemPoolGetAttribute``), plus the strategy's own pool events.

    All sizes in bytes. With ``pool="default"`` or ``"current"`` the pool is
    shared with whoever else allocates from it in the process, and its
    attributes count their memory too.

    Attributes:
        device: the device ordinal.
        pool: ``"own"``, ``"default"`` or ``"current"`` (the strategy's option).
        handle: the ``cudaMemPool_t`` handle (0 while no pool was needed yet).
        reserved_bytes / peak_reserved_bytes: device memory the pool holds
            (``cudaMemPoolAttrReservedMemCurrent`` / ``High``); grows in 32 MiB
            steps (docs/async.md).
        used_bytes / peak_used_bytes: memory in allocations handed out
            (``cudaMemPoolAttrUsedMemCurrent`` / ``High``), as the pool rounds it.
        release_threshold: bytes the pool keeps at a synchronisation
            (``cudaMemPoolAttrReleaseThreshold``; 2**64 - 1 keeps everything).
        max_size: the pool's size limit as asked for (0: none).
        cached_bytes: freed blocks the strategy keeps for reuse on the
            stream they were used on (option ``cache``), and those of dead
            streams waiting for a synchronisation; part of ``used_bytes``.
        n_oom_recoveries: allocations that first failed, then succeeded after
            a synchronize + trim.
        n_frees_after_stream_destroyed: blocks freed after the stream they
            were allocated on was destroyed, whose stream handle CUDA
            refused, or that were allocated on another thread's per-thread
            default stream (each such free synchronises the device first,
            see :class:`AsyncPoolStrategy`).
    """

    device: int
    pool: str
    handle: int
    reserved_bytes: int
    peak_reserved_bytes: int
    used_bytes: int
    peak_used_bytes: int
    release_threshold: int
    max_size: int
    cached_bytes: int
    n_oom_recoveries: int
    n_frees_after_stream_destroyed: int

    def __str__(self) -> str:
        thr = "keep all" if self.release_threshold == _backends.RELEASE_THRESHOLD_MAX else format_size(
            self.release_threshold
        )
        return (
            f"{self.pool} pool on device {self.device}: reserved {format_size(self.reserved_bytes)} "
            f"(peak {format_size(self.peak_reserved_bytes)}), used {format_size(self.used_bytes)} "
            f"(peak {format_size(self.peak_used_bytes)}, cached {format_size(self.cached_bytes)}), "
            f"release threshold {thr}"
        )


class AsyncPoolStrategy(Strategy):
    """Stream-ordered allocation from a CUDA memory pool (``cudaMallocFromPoolAsync``).

    Each allocation is made on CuPy's current stream of the current device
    and freed with ``cudaFreeAsync`` on that same stream, so a block returns
    to the pool in stream order and the pool can hand it out again at once to
    later work on that stream. Memory freed on one stream is reused by another
    only once CUDA knows the free happened before (a synchronisation, or
    event dependencies): no data race through the allocator.

    By default each device gets a pool of its own, created with
    ``cudaMemPoolCreate`` on first use. Installing the strategy does not
    change the device's default or current pool (``cudaDeviceSetMemPool``),
    so other libraries in the process keep theirs; CuPy's own
    ``MemoryAsyncPool`` does change it (``cudaDeviceSetMemPool`` in its constructor).

    Options (besides ``track_origins``):
        pool: ``"own"`` (default) a dedicated pool per device;
            ``"default"`` the device's default pool
            (``cudaDeviceGetDefaultMemPool``); ``"current"`` the device's
            current pool when the strategy first allocates there
            (``cudaDeviceGetMemPool``). The last two share the pool with the
            rest of the process: its statistics and trims then cover everyone.
        release_threshold: memory the pool keeps reserved at a
            synchronisation: bytes, a size string (``"4GiB"``), ``"N%"`` of the
            device's memory, or ``"max"`` to keep everything. Default: ``"max"``
            for an own pool (memory stays in the pool until :meth:`trim`);
            shared pools keep their setting unless one is given. At threshold
            0 every synchronisation hands idle memory back to CUDA: a
            64 MiB alloc/free/synchronize loop runs tens of times slower than
            with the memory kept (``bench async``, docs/async.md).
        peer_access: ``True`` (default) gives every device that can access
            this one's memory (``cudaDeviceCanAccessPeer``) read-write access
            to an own pool (``cudaMemPoolSetAccess``), so arrays work across
            devices as cudaMalloc memory does once CuPy enables peer access:
            pool memory ignores ``cudaDeviceEnablePeerAccess``. Without it a
            kernel on another device that reads such an array hits an illegal
            address (CuPy's multi-GPU tests do so).
        max_size: the most device memory an own pool may reserve: bytes, a
            size string or ``"N%"``; default 0, no limit. CUDA reserves pool
            memory in 32 MiB steps and the limit acts as rounded up to
            32 MiB (``bench async``, docs/async.md).

        cache: freed blocks are kept per stream (the legacy default stream,
            and each ``cupy.cuda.Stream`` of its own) and per size class of
            512 bytes, for the next allocation of that class on that same
            stream, which then makes no CUDA call at all (CuPy's own
            ``MemoryPool`` and PyTorch's caching allocator do the same per
            stream); a block never goes to another stream's cache, so reuse
            stays in stream order. At most this many bytes per size class and
            stream; larger blocks are not kept. Default ``"64MiB"`` when the
            pool keeps its memory (the default), 0 (off) when a
            ``release_threshold`` is given, so that memory then goes back at
            synchronisations as CUDA's threshold says. Cached blocks count as
            reserved, not in use; :meth:`trim`, :meth:`close` and
            out-of-memory recovery give them back. The per-thread default
            stream's blocks are not cached. When a stream dies with blocks in
            its cache, work it queued may still use them: they wait until one
            device synchronisation gives them all back, once they exceed this
            many bytes on the device, or at the next trim, close or
            out-of-memory recovery (counted in
            ``n_frees_after_stream_destroyed``).

    Frees: a block is freed on the stream it was allocated on, whatever
    stream is current. If that stream was destroyed in the meantime (the
    ``cupy.cuda.Stream`` object died), its handle is not used: the device is
    synchronised, so all work the stream had queued is finished, and the
    block is freed on the device's null stream; these frees are counted in
    :meth:`pool_stats` (``n_frees_after_stream_destroyed``). The same goes
    for a block allocated on the per-thread default stream
    (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) and freed by another thread:
    its handle (``cudaStreamPerThread``) would name the freeing thread's
    stream. A stream wrapped with ``cupy.cuda.ExternalStream`` must outlive
    the memory allocated on it, as CUDA requires. Blocks marked with
    :func:`cupy_memstrat.record_stream` are freed only once the work queued
    on the recorded streams at the free is done (docs/streams.md).

    Out of memory: a failed allocation recovers in CuPy's order: it gives the
    cached blocks back, synchronises the device, trims the pool to 0 and the
    caches of the other strategies that hold memory on the device
    (:meth:`Strategy.trim`) and CuPy's default pool's free blocks, and
    retries; then runs ``gc.collect()`` twice, gives back again and retries
    (``Stats.n_oom_recoveries`` counts successes); if that fails too it raises
    ``cupy.cuda.memory.OutOfMemoryError`` naming the request, the bytes in
    use and reserved. CUDA's sticky last error is cleared and existing
    allocations are untouched.

    Raises (at creation, so at ``use()``):
        ValueError: a bad option: an unknown ``pool``; a ``release_threshold``
            or ``max_size`` that is negative, unparsable or above the device's
            memory; ``max_size`` with a shared pool.
        RuntimeError: a device without memory-pool support
            (``cudaDevAttrMemoryPoolsSupported`` = 0).
    """

    own_hot_path = True  # no allocate/deallocate hooks (the strategy contract, docs/strategies.md)

    name = "async"
    aliases = ("malloc_async",)
    block_granule = 512
    has_c_hot_path = True  # csrc/hotpath.c's ordered mode
    description = "stream-ordered pool (cudaMallocFromPoolAsync), own pool per device, release threshold and trim"
    reserved_is_in_use = False
    options = (
        Option("pool", _as_pool, "own", "own | default | current: which cudaMemPool_t to allocate from"),
        Option(
            "release_threshold",
            _as_threshold,
            None,
            "bytes kept reserved at a synchronisation (size, N%, or max); default: keep all (own pool)",
        ),
        Option("max_size", _as_max_size, 0, "most bytes an own pool may reserve (size or N%); 0: no limit"),
        Option(
            "peer_access",
            as_bool,
            True,
            "give every peer-capable device read-write access to an own pool (cudaMemPoolSetAccess)",
        ),
        Option(
            "cache",
            _as_threshold,
            None,
            "bytes of freed blocks of one size kept per stream for reuse on that stream without a CUDA "
            "call (size or N%); default 64MiB when the pool keeps its memory, else 0",
        ),
    )

    @classmethod
    def parse_options(cls, options: dict) -> dict:
        config = super().parse_options(options)
        if config["pool"] != "own" and "max_size" in options:
            raise ValueError(
                f"async: option max_size={options['max_size']!r} applies only to pool='own'; a "
                f"{config['pool']} pool is shared with the rest of the process and keeps its own limit"
            )
        return config

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        cfg, b = self.config, self.backend
        n = b.device_count()
        thr, max_size = cfg["release_threshold"], cfg["max_size"]
        if thr is None and cfg["pool"] == "own":
            thr = _backends.RELEASE_THRESHOLD_MAX
        cache = cfg["cache"]
        if cache is None:
            cache = _DEFAULT_CACHE if thr == _backends.RELEASE_THRESHOLD_MAX else 0
        self._threshold: list[int | None] = []
        self._max_size: list[int] = []
        self._cache_limit: list[int] = []
        for d in range(n):
            props = b.device_properties(d)
            if not props.get("memory_pools_supported", 1):
                raise RuntimeError(
                    f"async: device {d} ({props.get('name')}) does not support stream-ordered memory pools "
                    "(cudaDevAttrMemoryPoolsSupported = 0); use the 'device' strategy"
                )
            total = props["total_memory"]
            self._threshold.append(_resolve(thr, total, d, "release_threshold", allow_max=True))
            self._max_size.append(_resolve(max_size, total, d, "max_size"))
            self._cache_limit.append(_resolve(cache, total, d, "cache", allow_max=True))
        self._pools = [0] * n  # cudaMemPool_t per device, made on first use
        self._owned = [False] * n
        self._pool_lock = threading.RLock()  # close() may run from a finaliser (using() letting go)
        # ptr -> weakref to the allocating stream, or None: allocated on the
        # legacy default stream in its size class, for the cache
        self._stream_of: dict[int, object] = {}
        self._cache: list[dict[int, list[int]]] = [{} for _ in range(n)]  # per device: class -> ptrs
        # per device: a weak reference to a Stream (one with a callback, found by the plain
        # reference stream_of holds: they compare equal while the stream lives) -> class -> ptrs
        self._stream_caches: list[dict] = [{} for _ in range(n)]
        self._dead: list = []  # (device, key) of streams that died with a cache: their blocks wait
        # blocks dead streams cached: freed after a synchronisation waited for their work
        self._quarantine = Quarantine(b, n)
        self._n_recoveries = [0] * n
        self._n_orphan_frees = [0] * n
        self._peak_reserved = [0] * n  # the pools' ReservedMemHigh, as last read

    # -- pools ------------------------------------------------------------------
    def _ensure_pool(self, device: int) -> int:
        with self._pool_lock:
            pool = self._pools[device]
            if pool:
                return pool
            kind, b = self.config["pool"], self.backend
            if kind == "own":
                pool = b.pool_create(device, self._max_size[device])
                if self.config["peer_access"]:
                    peers = [
                        p for p in range(b.device_count()) if p != device and b.device_can_access_peer(p, device)
                    ]
                    if peers:
                        b.pool_set_access(pool, peers)
            elif kind == "default":
                pool = b.device_default_pool(device)
            else:
                pool = b.device_current_pool(device)
            if self._threshold[device] is not None:
                b.pool_set_attribute(pool, _backends.POOL_ATTR_RELEASE_THRESHOLD, self._threshold[device])
            self._owned[device] = kind == "own"
            self._pools[device] = pool
            return pool

    def _recover_pool(self, size: int, device: int, sptr: int, pool: int, exc: BaseException,
                      alloc_size: int = 0) -> int:
        """A pool allocation failed: recover in CuPy's order
        (:meth:`Strategy._recover`: this strategy's trim, which gives the
        cached blocks back, synchronises the device and trims the pool to 0,
        and every other strategy's; then the same after ``gc.collect()``
        twice) and retry, or raise."""
        b = self.backend
        ptr = self.recovery.recover(
            size, device, exc, lambda: b.malloc_from_pool_async(alloc_size or size, pool, sptr),
            detail=lambda: self._oom_detail(size, device),
        )
        with self.accounts.lock:
            self._n_recoveries[device] += 1
        return ptr

    def _release_cached(self, device: int) -> int:
        """Free every cached block of ``device`` into the pool, each on the
        stream it was used on (the default stream's; a live stream's own); the
        blocks of streams that died are freed after one device
        synchronisation. Returns the bytes."""
        released = 0
        for cls, lst in list(self._cache[device].items()):
            while True:
                try:
                    ptr = lst.pop()
                except IndexError:
                    break
                self._free_off_path(ptr, cls, device, 0)
                released += cls
        for key, cache in list(self._stream_caches[device].items()):
            stream = key()
            for cls, lst in list(cache.items()):
                while True:
                    try:
                        ptr = lst.pop()
                    except IndexError:
                        break
                    if stream is not None:
                        try:
                            self.backend.free_async(ptr, stream.ptr)  # a handle > 2 names its own device
                            released += cls
                            continue
                        except Exception:  # noqa: BLE001 - CUDA refused the handle (destroyed)
                            self.backend.clear_last_error()
                    self._quarantine.add(device, ptr, cls)  # freed after a synchronisation
            if stream is None:
                self._stream_caches[device].pop(key, None)
        self._reap(force=True)
        return released + self._release_quarantine(device)

    def _new_stream_cache(self, device: int, stream) -> dict:
        """The cache of a non-default stream, made at its first cached free:
        class -> ptrs, kept under a weak reference whose callback queues the
        cache for :meth:`_reap` when the stream dies."""
        dead = self._dead

        def died(key, dead=dead, device=device):  # from the collector: a list append only
            dead.append((device, key))

        cache: dict[int, list[int]] = {}
        self._stream_caches[device][watch_object(stream, died)] = cache
        return cache

    def _reap(self, force: bool = False) -> None:
        """Streams that died with blocks cached: their blocks may still be in
        use by work the stream had queued, so they wait (quarantined) until
        one device synchronisation frees them all, when they exceed the
        device's cache limit, or at once with ``force`` (trim, close,
        out-of-memory recovery)."""
        dead = self._dead
        while dead:
            try:
                device, key = dead.pop()
            except IndexError:  # another thread took the last one
                break
            cache = self._stream_caches[device].pop(key, None) or {}
            for cls, lst in list(cache.items()):
                for ptr in lst:
                    self._quarantine.add(device, ptr, cls)
        for device, held in enumerate(self._quarantine.bytes):
            if held and (force or held > self._cache_limit[device]):
                self._release_quarantine(device)

    def _release_quarantine(self, device: int) -> int:
        """One device synchronisation, then the quarantined blocks go back to
        the pool on the null stream; returns the bytes."""
        def give(ptr, cls):
            with self.accounts.lock:
                self._n_orphan_frees[device] += 1
            self._free_off_path(ptr, cls, device, 0)

        return self._quarantine.release(device, give)

    def _oom_detail(self, size: int, device: int) -> str:
        detail = " (after synchronizing the device and trimming the pool)"
        limit = self._max_size[device]
        if limit:
            detail += f"; this pool's max_size is {format_size(limit)}"
        return detail

    # -- the hot path ----------------------------------------------------------------
    def _build_hot_path(self):
        # The allocation needs the current stream, which a plain allocate(size)
        # hook does not get: the C hot path's ordered mode (csrc/hotpath.c)
        # does the same as the Python closures below, in the same order, and
        # makes its CUDA calls through the backend's functions passed to it.
        # The Python closures are the base class's with the pool inlined (an
        # extra Python frame per call is measurable next to a
        # cudaMallocFromPoolAsync + cudaFreeAsync pair: bench async, docs/async.md).
        b = self.backend
        Accounting = c_accounting(self._track_origins)
        if Accounting is not None:
            acc = self._new_accounting(
                Accounting, self._unknown_free, self.recovery.recover,
                capsule=b.current_stream_ptr_capsule(), recorded=self.deferred.recorded, defer=self.deferred.defer,
                pending=self.deferred.pending, poll=self.deferred.poll, watch=self._watch,
                pool_malloc=b.malloc_from_pool_async, free_async=b.free_async, pools=self._pools,
                ensure_pool=self._ensure_pool, current_stream=b.current_stream, get_device=b.get_device,
                caches=self._cache, cache_limits=self._cache_limit, stream_of=self._stream_of,
                free_off_path=self._free_off_path, recover_pool=self._recover_pool,
                stream_caches=self._stream_caches, new_stream_cache=self._new_stream_cache, dead=self._dead,
                reap=self._reap,
            )
            self._give_back_fn = acc.give_back
            self._hot_malloc, self._hot_free, self.hot_path = acc.malloc, acc.free, "c"
            return acc.malloc, acc.free
        current_stream, pool_malloc, free_async = b.current_stream, b.malloc_from_pool_async, b.free_async
        get_device, Error = b.get_device, self._Error
        accounts = self.accounts
        events, live, stream_of, pools = accounts.events, accounts.live, self._stream_of, self._pools
        origins, track = accounts.origins, self._track_origins
        capture = origin_capture(track)  # the first frame, or track_origins=N frames
        ensure_pool, recover, unknown_free = self._ensure_pool, self._recover_pool, self._unknown_free
        fold = accounts.fold
        free_off_path, ref, get_ident = self._free_off_path, weakref.ref, threading.get_ident
        deferred = self.deferred
        recorded, pending, poll, defer, watch = (deferred.recorded, deferred.pending, deferred.poll, deferred.defer,
                                                 self._watch)

        caches, limits = self._cache, self._cache_limit
        scaches, new_stream_cache, dead, reap = self._stream_caches, self._new_stream_cache, self._dead, self._reap

        def malloc(size, device):
            if pending:  # blocks freed with record_stream() whose streams may be done
                poll()
            if dead:  # streams that died with blocks cached
                reap()
            stream = current_stream(device)
            sptr = stream.ptr
            if sptr > 2 and size <= limits[device]:
                # a stream of its own: its size class, from that stream's cache if it can
                r = ref(stream)
                cls = (size + 511) & -512
                ptr = 0
                sc = scaches[device].get(r)
                if sc:
                    lst = sc.get(cls)
                    if lst:
                        try:
                            ptr = lst.pop()
                        except IndexError:
                            pass
                if not ptr:
                    pool = pools[device] or ensure_pool(device)
                    try:
                        ptr = pool_malloc(cls, pool, sptr)
                    except Error as exc:
                        ptr = recover(size, device, sptr, pool, exc, cls)
            elif sptr == 0 and size <= limits[device]:
                # the legacy default stream: its size class, from the cache if it can
                cls = (size + 511) & -512
                ptr = 0
                lst = caches[device].get(cls)
                if lst:
                    try:
                        ptr = lst.pop()
                    except IndexError:  # another thread took the last one
                        pass
                if not ptr:  # a miss: the pool (made on first use) is needed
                    pool = pools[device] or ensure_pool(device)
                    try:
                        ptr = pool_malloc(cls, pool, 0)
                    except Error as exc:
                        ptr = recover(size, device, 0, pool, exc, cls)
                r = None
            else:
                pool = pools[device] or ensure_pool(device)
                try:
                    ptr = pool_malloc(size, pool, sptr)
                except Error as exc:
                    ptr = recover(size, device, sptr, pool, exc)
                # cudaStreamPerThread (2) is another stream in each thread: remember the thread
                r = ref(stream) if sptr != 2 else get_ident()
            ev = events[device]
            ev.append(size)  # the accounting rule (strategies/_support.py)
            if track:
                origins[ptr] = capture(1)
            live[device][ptr] = size
            stream_of[ptr] = r
            if len(ev) > FOLD_AT:
                fold(device)
            return ptr

        def give_back(ptr, size, device, stacklevel=1):
            # the block returns to the pool in the order of the stream it was allocated on
            r = stream_of.pop(ptr)
            if r is None:  # a default-stream block of a size class: cache it if there is room
                cls = (size + 511) & -512
                cache = caches[device]
                lst = cache.get(cls)
                if lst is None:
                    lst = cache.setdefault(cls, [])
                if (len(lst) + 1) * cls <= limits[device]:
                    lst.append(ptr)
                    return
                sptr = 0
            elif r.__class__ is int:  # the per-thread default stream of thread r
                if r != get_ident():  # another thread's stream cannot be named from here
                    free_off_path(ptr, size, device, None, stacklevel)
                    return
                sptr = 2
            else:
                stream = r()
                if stream is None:  # destroyed
                    free_off_path(ptr, size, device, None, stacklevel)
                    return
                sptr = stream.ptr
                if sptr > 2 and size <= limits[device]:  # its stream's cache, if there is room
                    cls = (size + 511) & -512
                    sc = scaches[device].get(r)
                    if sc is None:
                        sc = new_stream_cache(device, stream)
                    lst = sc.get(cls)
                    if lst is None:
                        lst = sc.setdefault(cls, [])
                    if (len(lst) + 1) * cls <= limits[device]:
                        lst.append(ptr)
                        return
            # handles 0-2 name the *current* device's default stream
            if sptr > 2 or get_device() == device:
                try:
                    free_async(ptr, sptr)
                    return
                except Exception:  # noqa: BLE001 - CUDA refused the handle:
                    sptr = None  # treat it as destroyed
            free_off_path(ptr, size, device, sptr, stacklevel)

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
                defer(ptr, size, device)  # other streams use it: freed once they are done
            else:
                give_back(ptr, size, device, stacklevel + 1)
            if watch[0] is not None and not live[device]:
                watch[0]()

        self._give_back_fn = give_back
        self._hot_malloc, self._hot_free, self.hot_path = malloc, free, "python"
        return malloc, free

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """A block whose recorded streams are done: freed on its allocation stream (or cached)."""
        try:
            self._give_back_fn(ptr, size, device, 2)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            self.backend.clear_last_error()
            warn_at_user(f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
                         RuntimeWarning)

    def _free_off_path(self, ptr: int, size: int, device: int, stream: int | None, stacklevel: int = 1) -> None:
        """Frees the hot path does not do: on another device's default
        stream, or (``stream`` None) after the stream was destroyed or CUDA
        refused its handle. ``stream`` is a raw handle."""
        b = self.backend
        b.clear_last_error()
        cur = b.get_device()
        try:
            if cur != device:
                b.set_device(device)
            try:
                if stream is None:
                    # The stream's handle is gone; its queued work may still use
                    # the block. Wait for all of it, then free on the null stream.
                    b.device_synchronize(device)
                    with self.accounts.lock:
                        self._n_orphan_frees[device] += 1
                    b.free_async(ptr, 0)
                else:
                    b.free_async(ptr, stream)
            finally:
                if cur != device:
                    b.set_device(cur)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            b.clear_last_error()
            warn_at_user(
                f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
                RuntimeWarning,
            )

    # -- statistics and control ---------------------------------------------------------
    def _pool_attr(self, device: int, attr: int) -> int:
        pool = self._pools[device]
        return int(self.backend.pool_get_attribute(pool, attr)) if pool else 0

    def stats(self, device: int | None = None) -> Stats:
        """As :meth:`Strategy.stats`; ``bytes_reserved`` / ``peak_bytes_reserved``
        are the pool's (``cudaMemPoolAttrReservedMemCurrent`` / ``High``)."""
        st = super().stats(device)
        d = st.device
        peak = max(self._peak_reserved[d], self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_HIGH))
        self._peak_reserved[d] = peak  # kept when the pool is destroyed (close)
        return replace(st, bytes_reserved=self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_CURRENT),
                       peak_bytes_reserved=peak)

    def pool_stats(self, device: int | None = None) -> PoolStats:
        """The pool's own attributes on ``device`` (default: current); see :class:`PoolStats`.

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        d = self._device_or_current(device)
        pool = self._pools[d]
        thr = self._pool_attr(d, _backends.POOL_ATTR_RELEASE_THRESHOLD) if pool else self._threshold[d] or 0
        return PoolStats(
            device=d,
            pool=self.config["pool"],
            handle=pool,
            reserved_bytes=self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_CURRENT),
            peak_reserved_bytes=self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_HIGH),
            used_bytes=self._pool_attr(d, _backends.POOL_ATTR_USED_MEM_CURRENT),
            peak_used_bytes=self._pool_attr(d, _backends.POOL_ATTR_USED_MEM_HIGH),
            release_threshold=thr,
            max_size=self._max_size[d],
            cached_bytes=sum(cls * len(lst) for cls, lst in list(self._cache[d].items()))
            + sum(cls * len(lst) for c in list(self._stream_caches[d].values()) for cls, lst in list(c.items()))
            + self._quarantine.bytes[d],
            n_oom_recoveries=self._n_recoveries[d],
            n_frees_after_stream_destroyed=self._n_orphan_frees[d],
        )

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """Reset this strategy's peaks and, with ``reserved``, the pool's
        high-water marks (reserved and used) on ``device`` (default: current)
        to present values."""
        d = self._device_or_current(device)
        super().reset_peak(d, reserved=reserved)
        if not reserved:
            return
        pool = self._pools[d]
        self._peak_reserved[d] = 0
        if pool:
            self.backend.pool_set_attribute(pool, _backends.POOL_ATTR_RESERVED_MEM_HIGH, 0)
            self.backend.pool_set_attribute(pool, _backends.POOL_ATTR_USED_MEM_HIGH, 0)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give idle pool memory back to CUDA (``cudaMemPoolTrimTo``).

        The device is synchronised first, so blocks whose frees are still
        queued on streams count as idle. Memory in use is never released.

        Args:
            keep_bytes: the pool keeps at least this much reserved: bytes, a
                size string or ``"N%"`` of device memory (default 0).
            device: one device, or ``None`` (default) for every device this
                strategy has a pool on.

        Returns:
            int: bytes of device memory released.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = range(len(self._pools)) if device is None else [self._device_or_current(device)]
        keeps = []
        for d in devices:  # every value checked before anything is released
            total = self.backend.device_properties(d)["total_memory"] if isinstance(keep_bytes, str) else None
            keeps.append(parse_size(keep_bytes, total=total, what="keep_bytes"))
        self.deferred.flush()  # blocks waiting for recorded streams are idle memory too
        released = 0
        for d, keep in zip(devices, keeps):
            pool = self._pools[d]
            if not pool:
                continue
            before = self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_CURRENT)
            self._release_cached(d)
            self.backend.device_synchronize(d)
            self.backend.pool_trim_to(pool, keep)
            released += before - self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_CURRENT)
        return released

    def close(self) -> None:
        """As :meth:`Strategy.close`; also turns the cache off, gives the
        cached blocks back, and destroys each own pool that has no live
        allocation. A pool that still has some is destroyed when the last of
        them is freed (those frees still work and are counted), not handed to
        ``cudaMemPoolDestroy`` while in use: a process that does so is
        suspected of dying later with SIGFPE inside ``cudaMallocFromPoolAsync``
        (docs/streams.md)."""
        super().close()
        waiting = False
        with self._pool_lock:
            for d, pool in enumerate(self._pools):
                self._cache_limit[d] = 0
                self._release_cached(d)
                if pool and self._owned[d]:
                    if self.accounts.live[d]:
                        waiting = True  # destroyed by the close() its last free calls
                        continue
                    self._peak_reserved[d] = max(self._peak_reserved[d],
                                                 self._pool_attr(d, _backends.POOL_ATTR_RESERVED_MEM_HIGH))
                    self.backend.device_synchronize(d)
                    self.backend.pool_destroy(pool)
                    self._pools[d] = 0
                    self._owned[d] = False
        if waiting:
            self._watch[0] = self._check_empty


def _resolve(value, total: int, device: int, what: str, allow_max: bool = False):
    """A parsed size option for one device: a percentage resolved against
    ``total``; anything above the device's memory refused."""
    if value is None:
        return None
    if allow_max and value == _backends.RELEASE_THRESHOLD_MAX:
        return value
    if isinstance(value, str):  # "N%"
        value = parse_size(value, total=total, what=f"async: option {what}")
    if value > total:
        raise ValueError(
            f"async: option {what}={value} bytes ({format_size(value)}) is above device {device}'s "
            f"memory ({format_size(total)})" + ("; use 'max' to keep all freed memory" if allow_max else "")
        )
    return value
