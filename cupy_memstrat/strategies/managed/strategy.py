"""The ``managed`` strategy: its options, advice and prefetch policies, hot path,
statistics and trim, over the slab (:mod:`.slab`) and the oversubscription guard
(:mod:`.guard`)."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

from ... import backends as _backends
from ..._userwarn import warn_at_user
from ...errors import ManagedMemoryWarning
from ...options import Option, as_bool, as_size
from ...sizes import format_count, format_size, parse_size
from ...stats import Record
from .._layout import block, segment
from .._support import SIZE_T_LIMIT
from ..arenas import build_arena_hot_path
from ..base import Strategy
from ..stream_deaths import Quarantine, StreamWatch
from .guard import OversubscriptionGuard
from .slab import CHUNK_BYTES, CHUNK_MASK, CLASS_INDEX, SIZE_CLASSES, SMALL_MAX, Slab

__all__ = ["ManagedStrategy", "ManagedStats"]

_NONE = ("", "none", "off", "no", "false")


def _as_location(value, what: str):
    """``"device"``, ``"host"``, a device ordinal, or None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected 'device', 'host', a device ordinal or None, got {value!r}")
    if isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, (str, float))):
        value = operator.index(value)
        if value < 0:
            raise ValueError(f"{what}: expected a device ordinal >= 0, got {value}")
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _NONE:
            return None
        if v in ("device", "host"):
            return v
        if v.isascii() and v.isdigit():
            return int(v)
    raise ValueError(f"{what}: expected 'device', 'host', a device ordinal or None, got {value!r}")


def _as_accessed_by(value, what: str) -> tuple:
    """None, or one or more of ``"device"``, ``"host"``, ordinals (a list, or a
    string joined with ``+``: ``"host+1"``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split("+") if v]
        if len(items) == 1 and items[0].lower() in _NONE:
            return ()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = [value]
    out = []
    for item in items:
        loc = _as_location(item, what)
        if loc is not None and loc not in out:
            out.append(loc)
    return tuple(out)


def _as_prefetch(value, what: str):
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _NONE):
        return None
    if isinstance(value, str) and value.strip().lower() in ("on_alloc", "on_new"):
        return value.strip().lower()
    raise ValueError(f"{what}: expected 'on_alloc', 'on_new' or None, got {value!r}")


@dataclass(frozen=True)
class ManagedStats(Record):
    """The chunks behind a ``managed`` strategy on one device (sizes in bytes).

    Attributes:
        device: the device ordinal the chunks were made on.
        chunk_bytes: the chunk size, 2 MiB.
        n_chunks: chunks reserved (a large block of k chunks counts k).
        reserved_bytes: managed memory held from CUDA (``n_chunks * chunk_bytes``).
        cached_bytes: reserved but not in use: free slots of shared chunks and
            free large blocks, kept for reuse until :meth:`ManagedStrategy.trim`.
        n_guard_refusals: allocations the oversubscription guard refused.
        n_reclaims: device synchronisations that took free chunks back from
            the caches of destroyed streams, for any stream to reuse.
        reclaimed_bytes: bytes of chunks taken back that way, in all.
    """

    device: int
    chunk_bytes: int
    n_chunks: int
    reserved_bytes: int
    cached_bytes: int
    n_guard_refusals: int
    n_reclaims: int = 0
    reclaimed_bytes: int = 0

    def __str__(self) -> str:
        return (
            f"managed on device {self.device}: {self.n_chunks} chunks of {format_size(self.chunk_bytes)} "
            f"({format_size(self.reserved_bytes)} reserved, {format_size(self.cached_bytes)} cached), "
            f"{format_count(self.n_guard_refusals, 'guard refusal')}, "
            f"{format_size(self.reclaimed_bytes)} reclaimed from destroyed streams in "
            f"{format_count(self.n_reclaims, 'synchronisation')}"
        )


class ManagedStrategy(Strategy):
    """Managed memory (``cudaMallocManaged``) served in 2 MiB chunks, with
    advice and prefetch policies and an oversubscription guard.

    Chunks: CUDA is asked for managed memory in whole 2 MiB chunks, the
    size of the driver's VA blocks, so advice and prefetch apply to whole
    blocks. A request above 1 MiB takes its own run of chunks (rounded up to a
    multiple of 2 MiB). Smaller requests are sub-allocated from shared chunks
    by size class (multiples of 512 B, at most 25% apart), so a thousand small
    arrays take a few chunks, not a thousand. Freed memory is cached per
    device for reuse (no CUDA call); :meth:`trim` (or
    :func:`cupy_memstrat.trim`) returns unused chunks to CUDA. ``Stats``:
    in use counts bytes as requested; reserved counts whole chunks.

    Note that chunking alone does not reduce page faults (docs/managed.md: many
    small allocations fault as much as one allocation of their total size);
    advice and prefetch do.

    Options (besides ``track_origins``):
        preferred_location: ``"device"`` (the device current when the chunk
            is made), ``"host"``, a device ordinal, or ``None`` (default):
            ``cudaMemAdviseSetPreferredLocation`` on each new chunk. Alone it
            does not avoid page faults (docs/claims.md); with prefetch it keeps
            pages where they were sent.
        accessed_by: devices (``"device"``, ordinals) and/or ``"host"`` that
            get a mapping to each chunk (``cudaMemAdviseSetAccessedBy``): a
            list, or in a spec string joined with ``+`` (``"host+1"``).
        read_mostly: ``cudaMemAdviseSetReadMostly`` on each chunk (default
            False). Harmful for data the GPU writes: it warns
            (:class:`~cupy_memstrat.ManagedMemoryWarning`); see
            docs/managed.md for the measured cost.
        prefetch: ``"on_alloc"``: on allocation, prefetch to the current
            device on CuPy's current stream (``cudaMemPrefetchAsync``): every
            large allocation, cached or new, and each shared chunk when it is
            made (its slots are then already on the device), as RMM's
            ``prefetch_resource_adaptor`` does. ``"on_new"``: only memory new
            from ``cudaMallocManaged`` (new chunks and new large blocks), not a
            block the cache hands back, which stays where its last user left
            it: each prefetch of resident memory costs tens of microseconds,
            and ``on_alloc`` makes allocation-heavy programs slower than
            ``on_new`` (docs/benchmarks.md, ``bench workloads``). ``None``
            (default): no prefetch.
            Refused (``ValueError``) on a device without
            ``concurrentManagedAccess``. If CUDA refuses a prefetch (a
            destroyed stream), the allocation raises ``RuntimeError`` naming
            it, and the memory stays cached.
        headroom: device memory the guard keeps free: bytes, a size string
            or ``"N%"`` of the device (default: 1 GiB or 5% of the device,
            whichever is smaller).
        oversubscribe: allow managed memory beyond the device's free memory
            (default False). Oversubscribed managed memory pages in and out
            of the device; on a shared GPU it can stall everyone.

    Oversubscription guard: before making a chunk, the strategy checks that
    the device can hold it together with this strategy's chunks that are not
    resident yet, within ``cudaMemGetInfo``'s free memory less ``headroom``.
    Growth of the device's used memory since the strategy's first chunk (or
    since the lowest use seen after it) is taken as its chunks becoming
    resident, at most all of them. That is an estimate: CUDA does not say which
    managed pages are resident. Memory another process or library takes
    after the first chunk looks like residency and makes the guard more
    lenient, by at most the strategy's chunks that are not resident. A
    refused request first gives cached chunks back (when that could make
    the room), then raises
    ``cupy.cuda.memory.OutOfMemoryError`` (``reason="oversubscription_guard"``)
    naming the guard, the request and the device's free memory.

    Raises (at creation, so at ``use()``):
        ValueError: a bad option value (the message names it), or a device
            ordinal in ``preferred_location`` / ``accessed_by`` that does
            not exist.

    Warns:
        ManagedMemoryWarning: ``read_mostly=True``; or a device whose
            ``concurrentManagedAccess`` is 0 (Windows, WSL2, Jetson), where
            the host must not touch managed memory while a kernel runs.
    """

    own_hot_path = True  # no allocate/deallocate hooks (the strategy contract, docs/strategies.md)

    name = "managed"
    aliases = ("malloc_managed",)
    block_granule = 512
    description = "managed memory (cudaMallocManaged) in 2 MiB chunks, advice and prefetch policies, guard"
    reserved_is_in_use = False
    options = (
        Option(
            "preferred_location",
            _as_location,
            None,
            "device | host | ordinal | none: cudaMemAdviseSetPreferredLocation on each chunk",
        ),
        Option("accessed_by", _as_accessed_by, (), "device/host/ordinals joined with +: cudaMemAdviseSetAccessedBy"),
        Option("read_mostly", as_bool, False, "cudaMemAdviseSetReadMostly on each chunk (harmful if the GPU writes)"),
        Option("prefetch", _as_prefetch, None,
               "on_alloc | on_new | none: prefetch to the current device on every allocation / on new memory only"),
        Option(
            "headroom",
            lambda v, what: None if v is None else as_size(v, what),
            None,
            "device memory the oversubscription guard keeps free (size or N%); default min(1GiB, 5%)",
        ),
        Option("oversubscribe", as_bool, False, "allow managed memory beyond the device's free memory"),
    )

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        b, cfg = self.backend, self.config
        n = b.device_count()
        for what in ("preferred_location", "accessed_by"):
            locs = cfg[what] if what == "accessed_by" else (cfg[what],)
            for loc in locs:
                if isinstance(loc, int) and not 0 <= loc < n:
                    raise ValueError(f"managed: option {what}: device {loc} does not exist (0 <= device < {n})")
        headroom = []
        for d in range(n):
            props = b.device_properties(d)
            h, total = cfg["headroom"], props["total_memory"]
            h = min(1 << 30, total // 20) if h is None else parse_size(h, total=total, what="managed: option headroom")
            if h >= total:
                raise ValueError(
                    f"managed: option headroom={cfg['headroom']!r} ({format_size(h)}) leaves nothing of device "
                    f"{d}'s memory ({format_size(total)}): expected less than that"
                )
            headroom.append(h)
            if not props.get("concurrent_managed_access", 1):
                if cfg["prefetch"] is not None:
                    raise ValueError(
                        f"managed: option prefetch={cfg['prefetch']!r} needs concurrentManagedAccess, and device {d} "
                        f"({props.get('name')}) has none (Windows, WSL2, Jetson): CUDA cannot prefetch "
                        "managed memory to it"
                    )
                warn_at_user(
                    f"managed: device {d} ({props.get('name')}) has concurrentManagedAccess = 0 "
                    "(Windows, WSL2, Jetson): the host must not touch managed memory while any kernel "
                    "runs on it, or the process crashes; synchronize before host access",
                    ManagedMemoryWarning,
                )
        if cfg["read_mostly"]:
            warn_at_user(
                "managed: read_mostly=True duplicates pages on each processor that reads them, and every "
                "write invalidates all copies: for data the GPU writes it is harmful (a GPU pass writing a "
                "1 GiB read-mostly buffer takes seconds, against about a millisecond without the advice; "
                "docs/managed.md). Use it only for data that nobody writes",
                ManagedMemoryWarning,
            )
        #: the chunks and the per-stream arenas they are cut into (:class:`~.slab.Slab`)
        self.slab = slab = Slab(n)
        me = weakref.ref(self)  # not the strategy itself, which the watch must not keep alive

        def stream_died(device, key):
            # In the stream's deallocation (from the collector, or right after Stream.__del__ on
            # the last reference's drop), before the program can make another stream: dict and
            # list operations only (no lock, nothing CUDA).
            if slab.stream_died(device, key):
                strategy = me()
                if strategy is not None:
                    strategy._forget_last_owner()  # the C hot path's cached arena of this handle

        self._stream_watch = StreamWatch(self.backend, n, stream_died)
        # free blocks taken from destroyed streams' arenas, spare once a synchronisation waited for them
        self._reclaiming = Quarantine(self.backend, n)
        #: the oversubscription guard (:class:`~.guard.OversubscriptionGuard`)
        self.guard = OversubscriptionGuard(self, headroom, not cfg["oversubscribe"])

    # -- policies ---------------------------------------------------------------
    def _location(self, loc, device: int) -> int:
        return _backends.HOST if loc == "host" else (device if loc == "device" else loc)

    def _apply_policies(self, ptr: int, nbytes: int, device: int) -> None:
        """The advice options on a new chunk (or run of chunks), once. (The
        ``prefetch`` option is applied per allocation by the caller.)"""
        b, cfg = self.backend, self.config
        if cfg["preferred_location"] is not None:
            b.mem_advise(ptr, nbytes, _backends.ADVISE_SET_PREFERRED_LOCATION,
                         self._location(cfg["preferred_location"], device))
        for loc in cfg["accessed_by"]:
            b.mem_advise(ptr, nbytes, _backends.ADVISE_SET_ACCESSED_BY, self._location(loc, device))
        if cfg["read_mostly"]:
            b.mem_advise(ptr, nbytes, _backends.ADVISE_SET_READ_MOSTLY, device)

    def _prefetch_to(self, ptr: int, nbytes: int, device: int, size: int, undo) -> None:
        """``prefetch="on_alloc"`` / ``"on_new"``: ``cudaMemPrefetchAsync`` of a
        new chunk or a large block to ``device`` on CuPy's current stream. If CUDA refuses
        (e.g. a destroyed stream), ``undo()`` puts the memory back in the
        cache, so nothing is lost, and the allocation fails with a
        RuntimeError naming the prefetch."""
        b = self.backend
        stream = b.current_stream(device)
        try:
            b.mem_prefetch(ptr, nbytes, device, stream.ptr)
        except self._Error as exc:
            b.clear_last_error()
            undo()
            self.accounts.count_failed(device)
            name = _backends.error_name(getattr(exc, "status", None))
            raise RuntimeError(
                f"managed: prefetch={self.config['prefetch']!r} of {format_size(nbytes)} at 0x{ptr:x} to device "
                f"{device} on stream 0x{stream.ptr:x} failed ({name}); the allocation of {size} bytes was not made "
                "and the memory stays cached"
            ) from exc

    # -- chunks -----------------------------------------------------------------
    def _new_chunks(self, nbytes: int, size: int, device: int, ci: int) -> int:
        """``cudaMallocManaged`` of ``nbytes`` (a multiple of 2 MiB) after the
        guard; on a CUDA out-of-memory, recover in CuPy's order and retry
        (:meth:`Strategy._recover`)."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        b = self.backend
        with self.slab.lock:
            self.guard.check(nbytes, size, device)
            try:
                ptr = b.malloc_managed(nbytes)
            except self._Error as exc:
                ptr = self.recovery.recover(size, device, exc, lambda: b.malloc_managed(nbytes))
            try:
                self._apply_policies(ptr, nbytes, device)
            except Exception:
                b.free(ptr)
                b.clear_last_error()
                raise
            self.slab.add_chunk(device, ptr, nbytes, ci)
            self.guard.reserved[device] += nbytes
            self.record_reserved(device, nbytes)
            h = self.history
            if h is not None:
                h.segment("segment_alloc", ptr, nbytes, device)
            return ptr

    def _refill(self, ci: int, size: int, device: int, key: int) -> int:
        """A shared chunk for class ``ci``, a spare one (:meth:`_reclaim`)
        or a new one: one slot for this request, the rest onto the class's
        free list in stream ``key``'s arena."""
        base = self._spare_chunk(device, ci)
        new = not base
        if new:
            base = self._new_chunks(CHUNK_BYTES, size, device, ci)
        lst = self.slab.carve(device, key, base, ci)
        if self.config["prefetch"] == "on_alloc" or (new and self.config["prefetch"] is not None):
            self._prefetch_to(base, CHUNK_BYTES, device, size, lambda: lst.append(base))
        return base

    # -- destroyed streams' chunks ---------------------------------------------------
    def _watch_stream(self, device: int, key: int) -> None:
        """Watch the ``cupy.cuda.Stream`` behind stream key ``key`` (a handle > 2)
        on ``device`` (:class:`~cupy_memstrat.strategies.stream_deaths.StreamWatch`),
        so that its arena is taken out of reach when it dies and its free chunks
        reclaimed. A wrapper (``cupy.cuda.ExternalStream``) of a stream someone
        else owns is not watched: its death destroys nothing, and a program may
        wrap the same live stream anew at every step; the arena stays under the
        handle, as CuPy's pool keys it. Called on the slow path."""
        if self._stream_watch.is_watched(device, key):
            return
        stream = self.backend.current_stream(device)
        if getattr(stream, "ptr", None) == key:
            self._stream_watch.watch(device, stream)

    def _spare_chunk(self, device: int, ci: int) -> int:
        """A spare whole chunk for shared class ``ci`` (0 if none, after
        reclaiming destroyed streams' arenas)."""
        if not self.slab.spare_small[device] and self.slab.has_dead(device):
            self._reclaim(device)
        return self.slab.take_spare_chunk(device, ci)

    def _spare_run(self, device: int, nbytes: int) -> int:
        """A spare run of ``nbytes`` (0 if none, after reclaiming)."""
        if not self.slab.spare_large[device].get(nbytes) and self.slab.has_dead(device):
            self._reclaim(device)
        return self.slab.take_spare_run(device, nbytes)

    def _reclaim(self, device: int) -> None:
        """Take back the free chunks of destroyed streams' arenas on ``device``, before new
        chunks are made (:meth:`Slab.reclaim <.slab.Slab.reclaim>`): a program that makes
        streams and drops them would otherwise keep every dead stream's cache, and fault on
        each new chunk (``bench workloads``, multi-stream; docs/managed.md)."""
        if self.slab.reclaim(device, self._reclaiming):
            self._forget_last_owner()

    def _forget_last_owner(self) -> None:
        # the C hot path caches the last chunk's owner and the last stream's arena
        forget = getattr(self._hot_free, "__self__", None)
        if forget is not None and hasattr(forget, "forget"):
            forget.forget()

    def _free_chunk(self, ptr: int, device: int) -> None:
        """``cudaFree`` of the chunk (or run) at ``ptr``, out of the slab first."""
        nbytes = self.slab.remove_chunk(device, ptr)
        self._forget_last_owner()
        self.guard.reserved[device] -= nbytes
        self.record_reserved(device, -nbytes)
        h = self.history
        if h is not None:
            h.segment("segment_free", ptr, nbytes, device)
        try:
            self.backend.free(ptr)
        except self._Error as exc:
            self.backend.clear_last_error()
            warn_at_user(f"managed: cudaFree of chunk 0x{ptr:x} on device {device} failed: {exc}", RuntimeWarning)

    # -- the hot path ---------------------------------------------------------------
    def _miss(self, size: int, device: int, key: int) -> int:
        """The slow path of an allocation: no free block of ``size``'s class
        (or run of chunks) in stream ``key``'s arena on ``device``. A large
        size seen for the first time there is indexed under its 512-byte
        rounding, and may find a block freed by another size of the same run."""
        if key > 2:
            self._watch_stream(device, key)
        small, large = self.slab.arena(device, key)
        if size <= SMALL_MAX:
            ci = CLASS_INDEX[(size + 511) >> 9]
            try:
                return small[ci].pop()  # another thread freed one
            except IndexError:
                return self._refill(ci, size, device, key)
        n = (size + CHUNK_BYTES - 1) & CHUNK_MASK
        if n >= SIZE_T_LIMIT:
            raise ValueError(
                f"size: {size} bytes rounds up to {n} bytes of 2 MiB chunks, which does not fit in size_t"
            )
        lst = large.get(n)
        if lst is None:
            lst = large.setdefault(n, [])
        self.slab.arenas[device][key][1][(size + 511) & -512] = lst
        prefetch = self.config["prefetch"]
        try:
            ptr = lst.pop()
        except IndexError:
            ptr = self._spare_run(device, n)
            if ptr:  # a destroyed stream's, synchronised: as cached
                self.slab.own_run(device, key, ptr)
                prefetch = prefetch if prefetch == "on_alloc" else None
            else:
                ptr = self._new_chunks(n, size, device, -1)
                self.slab.own_run(device, key, ptr)
        else:
            prefetch = prefetch if prefetch == "on_alloc" else None  # on_new: a cached block is not
        if prefetch is not None:
            self._prefetch_to(ptr, n, device, size, lambda: lst.append(ptr))
        return ptr

    def _stream_source(self):
        """``(capsule or None, callable)`` giving the hot path the handle of
        the current stream of a device (see ``current_stream_ptr`` in
        :mod:`cupy_memstrat.backends`)."""
        b = self.backend
        return b.current_stream_ptr_capsule(), b.current_stream_ptr

    def _build_hot_path(self):
        # The stream-ordered chunk cache needs the device and the stream, which a plain
        # allocate(size) hook does not get: per-stream arenas (strategies/arenas.py). A
        # cached allocation finds its arena by stream key, then its free list by the size
        # in 512-byte units: a list for small sizes, a dict (filled on first use) above.
        slab = self.slab
        large_hit = self._large_hit if self.config["prefetch"] == "on_alloc" else None
        self._hot_malloc, self._hot_free, self.hot_path = build_arena_hot_path(
            self, arenas=slab.arenas, owner=slab.owner, arena_of=slab.arena_of, chunk_bytes=CHUNK_BYTES,
            small_max=SMALL_MAX, miss=self._miss, large_hit=large_hit, stream_source=self._stream_source())
        return self._hot_malloc, self._hot_free

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """A block whose recorded streams are done goes to its arena."""
        try:
            self.slab.give_back(ptr, size, device)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            warn_at_user(f"managed: caching 0x{ptr:x} ({size} bytes) on device {device} failed: {exc!r}",
                         RuntimeWarning)

    def _large_hit(self, ptr: int, size: int, device: int, key: int) -> None:
        """The C hot path, ``prefetch="on_alloc"``: prefetch a cached large
        block taken for ``size`` from stream ``key``'s arena (as the Python
        hot path does inline)."""
        lst = self.slab.arenas[device][key][1][(size + 511) & -512]
        self._prefetch_to(ptr, (size + CHUNK_BYTES - 1) & CHUNK_MASK, device, size, lambda: lst.append(ptr))

    # -- statistics and control -----------------------------------------------------
    segment_kind = "chunks"

    def memory_segments(self, device: int | None = None) -> list[dict]:
        """As :meth:`Strategy.memory_segments`, the segments being this
        strategy's chunks: a shared chunk's blocks are its size-class slots
        (live ones active, runs of free ones merged), a large block's run of
        chunks is one segment with one block."""
        devices = range(len(self.slab.chunks)) if device is None else [self._device_or_current(device)]
        origins = self.accounts.origins
        out = []
        for d in devices:
            live = self.accounts.live[d]
            for base, (nbytes, ci) in sorted(list(self.slab.chunks[d].items())):
                if ci < 0:
                    size = live.get(base)
                    blocks = [block(base, nbytes, size or 0, size is not None, origins.get(base))]
                    out.append(segment(d, base, nbytes, blocks))
                    continue
                cls = SIZE_CLASSES[ci]
                blocks, free_at = [], None
                for addr in range(base, base + (nbytes // cls) * cls, cls):
                    size = live.get(addr)
                    if size is None:
                        if free_at is None:
                            free_at = addr
                        continue
                    if free_at is not None:
                        blocks.append(block(free_at, addr - free_at, 0, False))
                        free_at = None
                    blocks.append(block(addr, cls, size, True, origins.get(addr)))
                end = base + nbytes
                last = base + (nbytes // cls) * cls
                if free_at is not None or last < end:
                    start = free_at if free_at is not None else last
                    blocks.append(block(start, end - start, 0, False))
                out.append(segment(d, base, nbytes, blocks))
        return out

    def managed_stats(self, device: int | None = None) -> ManagedStats:
        """The chunks on ``device`` (default: current); see :class:`ManagedStats`.

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        d = self._device_or_current(device)
        return ManagedStats(
            device=d,
            chunk_bytes=CHUNK_BYTES,
            n_chunks=self.guard.reserved[d] // CHUNK_BYTES,
            reserved_bytes=self.guard.reserved[d],
            cached_bytes=self.slab.cached_bytes(d),
            n_guard_refusals=self.guard.n_refused[d],
            n_reclaims=self.slab.n_reclaims[d],
            reclaimed_bytes=self.slab.reclaimed[d],
        )

    def largest_free_block(self, device: int) -> int:
        """Bytes of the largest request the chunks already made serve (:meth:`Slab.largest_free
        <.slab.Slab.largest_free>`): a free run, a spare chunk, or a free slot.

        Raises:
            TypeError, ValueError: a bad ``device``.
        """
        return self.slab.largest_free(self._device_or_current(device))

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give cached chunks back to CUDA (``cudaFree``): free large blocks,
        then shared chunks whose every slot is free. Memory in use is never
        released; a shared chunk with one live slot stays.

        Args:
            keep_bytes: keep at most about this much cached: bytes, a size
                string or ``"N%"`` of device memory (default 0).
            device: one device, or ``None`` (default) for every device.

        Returns:
            int: bytes of managed memory released.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = range(len(self.slab.chunks)) if device is None else [self._device_or_current(device)]
        keeps = []
        for d in devices:  # every value checked before anything is released
            total = self.backend.device_properties(d)["total_memory"] if isinstance(keep_bytes, str) else None
            keeps.append(parse_size(keep_bytes, total=total, what="keep_bytes"))
        self.deferred.flush()  # blocks waiting for recorded streams are cache too
        return sum(self.slab.release(d, keep, lambda ptr, d=d: self._free_chunk(ptr, d))
                   for d, keep in zip(devices, keeps))

    def close(self) -> None:
        """As :meth:`Strategy.close`; also gives every cached chunk back.
        Chunks with live allocations stay until they are freed and a later
        :meth:`trim`, or until the strategy is garbage-collected."""
        super().close()
        self.trim()

    def __del__(self):
        # Unreachable: no array of ours is alive (CuPy's memory objects keep
        # the hot path, and so the strategy, alive). Give every chunk back.
        try:
            for d, chunks in enumerate(self.slab.chunks):
                for ptr in list(chunks):
                    self._free_chunk(ptr, d)
        except Exception:  # noqa: BLE001 - interpreter shutdown, CUDA gone
            pass
