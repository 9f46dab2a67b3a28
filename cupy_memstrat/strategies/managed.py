"""The ``managed`` strategy: ``cudaMallocManaged`` memory in 2 MiB chunks."""

from __future__ import annotations

import bisect
import collections
import gc
import operator
import threading
import weakref
from dataclasses import dataclass

from .. import backends as _backends
from ..errors import ManagedMemoryWarning
from ..options import Option, as_bool, as_size
from ..sizes import format_count, format_size, parse_size
from ..stats import Record, origin_capture
from ._layout import block, segment
from .._userwarn import warn_at_user
from .stream_deaths import Quarantine, StreamWatch
from ._support import FOLD_AT, SIZE_T_LIMIT, c_accounting
from .base import Strategy

__all__ = ["ManagedStrategy", "ManagedStats", "CHUNK_BYTES"]

#: A chunk: the unit in which the strategy takes managed memory from CUDA,
#: the size of the driver's VA blocks (docs/claims.md: cudaMallocManaged returned
#: 2 MiB-aligned pointers; ranges off a 2 MiB boundary were ~35% slower).
CHUNK_BYTES = 2 << 20
_CHUNK_MASK = -CHUNK_BYTES
#: requests up to this size share chunks (sub-allocated by size class)
SMALL_MAX = 1 << 20


def _size_classes() -> tuple[int, ...]:
    # 512 B steps up to 2 KiB, then four classes per doubling (waste <= 25%),
    # all multiples of 512 B: slots stay 512-byte aligned, as CuPy's own pool's.
    classes = [512, 1024, 1536, 2048]
    k = 2048
    while k < SMALL_MAX:
        classes += [k + k // 4, k + k // 2, k + 3 * k // 4, 2 * k]
        k *= 2
    return tuple(classes)


SIZE_CLASSES = _size_classes()
# (size + 511) >> 9  ->  index of the smallest class that holds size
_CLASS_INDEX = tuple(
    bisect.bisect_left(SIZE_CLASSES, max(i << 9, 1)) for i in range((SMALL_MAX >> 9) + 1)
)

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
        self._headroom = []
        for d in range(n):
            props = b.device_properties(d)
            h, total = cfg["headroom"], props["total_memory"]
            h = min(1 << 30, total // 20) if h is None else parse_size(h, total=total, what="managed: option headroom")
            if h >= total:
                raise ValueError(
                    f"managed: option headroom={cfg['headroom']!r} ({format_size(h)}) leaves nothing of device "
                    f"{d}'s memory ({format_size(total)}): expected less than that"
                )
            self._headroom.append(h)
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
        # Stream-ordered caches: per device, one arena per stream key (CuPy's
        # _get_stream_identifier: the stream's handle, or minus the thread's
        # ident for the per-thread default stream). An arena holds free slots
        # of shared chunks by class index and free large blocks by run bytes:
        # _lists[d][key] = (class lists, {run bytes: list}). The hot path's
        # view of the same lists: _arenas[d][key] = (list per 512 B up to
        # SMALL_MAX -> its class's list, {size rounded to 512 B: its run's
        # list}, filled on first use). A chunk (or run of chunks) belongs to
        # the arena it was made for, for good: _owner[chunk base] is that
        # arena's hot-path view, and a freed block goes back there (chunks
        # are 2 MiB-aligned, so a slot's base is ptr & _CHUNK_MASK).
        self._lists: list[dict[int, tuple[list, dict]]] = [{} for _ in range(n)]
        self._arenas: list[dict[int, tuple[list, dict]]] = [{} for _ in range(n)]
        self._owner: dict[int, tuple[list, dict]] = {}
        # Destroyed streams' arenas (see _reclaim): a weak reference to the
        # cupy.cuda.Stream behind each stream key (handles > 2). Its callback
        # runs in the deallocation that destroys the stream (right after
        # Stream.__del__ when the last reference goes; docs/streams.md, limits),
        # before the program can make a new stream, and takes the arena out of
        # _lists/_arenas at once: CUDA may give a new stream the
        # dead one's handle while the dead one's work still runs, and the new
        # stream's work is not ordered after it (docs/streams.md), so no
        # stream may find the arena by that handle any more. It queues
        # (device, lists, arena) on _died; _reclaim moves them to
        # _dead[d][id(lists)] = [lists, arena, free bytes at the last
        # reclaim (-1: none yet)]. Frees of the dead stream's live blocks still
        # go to its arena (_owner). Chunks taken back wait, owned by no arena,
        # in _spare_small[d] (whole shared chunks, any class) and
        # _spare_large[d] (run bytes -> runs) for any stream.
        self._died: list[tuple[int, tuple, tuple]] = []
        lists_of, arenas_of, died, me = self._lists, self._arenas, self._died, weakref.ref(self)

        def stream_died(device, key):
            # In the stream's deallocation (from the collector, or right after
            # Stream.__del__ on the last reference's drop), before the program can
            # make another stream: dict and list operations only (no lock, nothing CUDA).
            # me: not the strategy itself, which the watch must not keep alive.
            mine, view = lists_of[device].pop(key, None), arenas_of[device].pop(key, None)
            strategy = me()
            if strategy is not None:
                strategy._forget_last_owner()  # the C hot path's cached arena of this handle
            if mine is not None:
                died.append((device, mine, view))

        self._stream_watch = StreamWatch(self.backend, n, stream_died)
        self._dead: list[dict[int, list]] = [{} for _ in range(n)]
        self._spare_small: list[list[int]] = [[] for _ in range(n)]
        self._empty_arenas: list[list[tuple]] = [[] for _ in range(n)]  # forgotten arenas' tables, empty
        self._spare_large: list[dict[int, list[int]]] = [{} for _ in range(n)]
        # free blocks taken from destroyed streams' arenas, spare once a synchronisation waited for them
        self._reclaiming = Quarantine(self.backend, n)
        self._n_reclaims = [0] * n
        self._reclaimed = [0] * n
        # the chunks (base -> (bytes, class index or -1)); shared chunks' bases, sorted
        self._chunks: list[dict[int, tuple[int, int]]] = [{} for _ in range(n)]
        self._small_bases: list[list[int]] = [[] for _ in range(n)]
        self._reserved = [0] * n  # managed bytes held, per device (guard)
        self._used0: list[int | None] = [None] * n  # device memory used at the first chunk
        self._n_refused = [0] * n
        self._chunk_lock = threading.RLock()

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
    def _guard(self, nbytes: int, size: int, device: int) -> None:
        """Refuse ``nbytes`` of new chunks that the device could not hold;
        before refusing, give memory back in CuPy's order: this strategy's
        cache and the others' (:meth:`_give_back`), then the same after
        ``gc.collect()`` twice (arrays held only by reference cycles)."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if self.config["oversubscribe"]:
            return
        b = self.backend
        for attempt in (0, 1, 2):
            free, total = b.mem_get_info(device)
            used = total - free
            if self._used0[device] is None or used < self._used0[device]:
                self._used0[device] = used  # someone gave memory back: a lower baseline
            mine = self._reserved[device]
            resident = min(mine, max(0, used - self._used0[device]))
            need = nbytes + mine - resident
            room = free - self._headroom[device]
            if need <= room:
                if attempt:
                    self.accounts.count_recovery(device)
                return
            if attempt == 2 or nbytes > total - self._headroom[device]:
                break  # (more than the whole device could hold: nothing given back can help)
            if attempt == 1:
                gc.collect()
                gc.collect()
            self.recovery.give_back(device)
        self._n_refused[device] += 1
        self.accounts.count_failed(device)
        self.recovery.raise_out_of_memory(
            size,
            device,
            reason="oversubscription_guard",
            detail=(
                f": refused by the oversubscription guard: {format_size(nbytes)} of new managed chunks "
                f"plus {format_size(mine - resident)} of this strategy's chunks not yet resident need "
                f"{format_size(need)}, more than the device's {format_size(free)} free less "
                f"{format_size(self._headroom[device])} headroom (after giving cached memory back and "
                "collecting garbage); pass oversubscribe=True to allow oversubscription (pages then "
                "move in and out of the device)"
            ),
        )

    def _new_chunks(self, nbytes: int, size: int, device: int, ci: int) -> int:
        """``cudaMallocManaged`` of ``nbytes`` (a multiple of 2 MiB) after the
        guard; on a CUDA out-of-memory, recover in CuPy's order and retry
        (:meth:`Strategy._recover`)."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        b = self.backend
        with self._chunk_lock:
            self._guard(nbytes, size, device)
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
            self._chunks[device][ptr] = (nbytes, ci)
            if ci >= 0:
                bisect.insort(self._small_bases[device], ptr)
            self._reserved[device] += nbytes
            self.record_reserved(device, nbytes)
            h = self.history
            if h is not None:
                h.segment("segment_alloc", ptr, nbytes, device)
            return ptr

    def _arena(self, device: int, key: int) -> tuple[list, dict]:
        """The lists of stream ``key``'s arena on ``device``, made on first use."""
        lists = self._lists[device].get(key)
        if lists is None:
            with self._chunk_lock:
                lists = self._lists[device].get(key)
                if lists is None:
                    recycled = self._empty_arenas[device]
                    if recycled:  # a destroyed stream's arena, forgotten empty: no new tables
                        lists, view = recycled.pop()
                    else:
                        small = [[] for _ in SIZE_CLASSES]
                        lists = (small, {})
                        view = ([small[ci] for ci in _CLASS_INDEX], {})
                    self._lists[device][key] = lists
                    self._arenas[device][key] = view
        return lists

    def _refill(self, ci: int, size: int, device: int, key: int) -> int:
        """A shared chunk for class ``ci``, a spare one (:meth:`_reclaim`)
        or a new one: one slot for this request, the rest onto the class's
        free list in stream ``key``'s arena."""
        cls = SIZE_CLASSES[ci]
        base = self._spare_chunk(device, ci)
        new = not base
        if new:
            base = self._new_chunks(CHUNK_BYTES, size, device, ci)
        lst = self._arena(device, key)[0][ci]
        self._owner[base] = self._arenas[device][key]
        n = CHUNK_BYTES // cls
        lst.extend(range(base + (n - 1) * cls, base, -cls))  # lowest address popped first
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

    def _arena_free_bytes(self, lists: tuple[list, dict]) -> int:
        small, large = lists
        return sum(SIZE_CLASSES[ci] * len(lst) for ci, lst in enumerate(small) if lst) + sum(
            n * len(lst) for n, lst in list(large.items())
        )

    def _spare_chunk(self, device: int, ci: int) -> int:
        """A spare whole chunk for shared class ``ci`` (0 if none, after
        reclaiming destroyed streams' arenas)."""
        spare = self._spare_small[device]
        if not spare and (self._died or self._dead[device]):
            self._reclaim(device)
        with self._chunk_lock:
            if not spare:
                return 0
            base = spare.pop()
            self._chunks[device][base] = (CHUNK_BYTES, ci)
            return base

    def _spare_run(self, device: int, nbytes: int) -> int:
        """A spare run of ``nbytes`` (0 if none, after reclaiming)."""
        lst = self._spare_large[device].get(nbytes)
        if not lst and (self._died or self._dead[device]):
            self._reclaim(device)
            lst = self._spare_large[device].get(nbytes)
        try:
            return lst.pop() if lst else 0
        except IndexError:  # another thread took the last one
            return 0

    def _reclaim(self, device: int) -> None:
        """Take back the free chunks of destroyed streams' arenas on
        ``device``, before new chunks are made: a program that makes streams
        and drops them would otherwise keep every dead stream's cache, and
        fault on each new chunk (``bench workloads``, multi-stream; docs/managed.md).

        Every free block of those arenas is first taken out of circulation,
        then one ``cudaDeviceSynchronize`` waits for every queued work (the
        dead streams' included), so no work still uses what was taken. Whole
        free shared chunks and free large runs become spare, owned by no
        arena, for any stream; slots of chunks still partly in use go back.
        An arena is reclaimed again only once frees have added to it, and
        forgotten once it owns no chunk."""
        died = self._died
        while died:
            try:
                d, lists, view = died.pop()
            except IndexError:  # another thread took the last one
                break
            self._dead[d][id(lists)] = [lists, view, -1]
        dead = self._dead[device]
        if not dead:
            return
        with self._chunk_lock:
            todo = []
            for entry in list(dead.values()):
                free = self._arena_free_bytes(entry[0])
                if free > 0 and free > entry[2]:
                    todo.append((entry[0], entry[1]))
            if todo:
                self._take_back(device, todo)
            owned = {id(v) for v in list(self._owner.values())}
            for k, entry in list(dead.items()):
                if id(entry[1]) not in owned:  # owns nothing: forget it, its tables made again of use
                    dead.pop(k, None)
                    small, large = entry[0]
                    if len(self._empty_arenas[device]) < 64 and not any(small) and not any(large.values()):
                        self._empty_arenas[device].append((entry[0], entry[1]))
                else:
                    entry[2] = self._arena_free_bytes(entry[0])

    def _take_back(self, device: int, arenas: list[tuple[tuple[list, dict], tuple]]) -> None:
        """Out of destroyed streams' arenas (``(lists, hot-path view)`` pairs;
        no stream allocates from them any more, frees may still append): every
        free large run, and every shared chunk whose slots are all free; then
        one device synchronisation, and they are spare. Nothing to take: no
        synchronisation."""
        bases, chunks, owner = self._small_bases[device], self._chunks[device], self._owner
        mask = _CHUNK_MASK

        def base_of(ptr: int) -> int:
            base = ptr & mask
            return base if base in chunks else bases[bisect.bisect_right(bases, ptr) - 1]

        # the shared chunks each arena owns, per class index
        mine: dict[int, dict[int, list[int]]] = {id(view): {} for _, view in arenas}
        for base, view in list(owner.items()):
            per_class = mine.get(id(view))
            if per_class is not None:
                ci = chunks[base][1] if base in chunks else -1
                if ci >= 0:
                    per_class.setdefault(ci, []).append(base)
        whole: list[int] = []
        runs: list[tuple[int, int]] = []
        for (small, large), view in arenas:
            for ci, owned in mine[id(view)].items():
                lst, per = small[ci], CHUNK_BYTES // SIZE_CLASSES[ci]
                taken = lst[:]  # only appends can happen meanwhile (frees), at the end
                if len(taken) < per:
                    continue  # fewer free slots than one chunk holds: none is wholly free
                if len(taken) == per * len(owned):  # every slot free: every chunk (the usual case)
                    full = set(owned)
                else:
                    counts = collections.Counter(map(mask.__rand__, taken))  # counted in C
                    if any(b not in chunks for b in counts):  # a chunk CUDA did not align to 2 MiB
                        counts = collections.Counter(map(base_of, taken))
                    full = {b for b, n in counts.items() if n == per}
                if full:
                    del lst[: len(taken)]
                    if len(full) < len(owned):  # the slots of partly used chunks stay
                        lst.extend(p for p in taken if base_of(p) not in full)
                    whole.extend(full)
            for nbytes, lst in list(large.items()):
                while lst:
                    try:
                        runs.append((nbytes, lst.pop()))
                    except IndexError:
                        break
        q = self._reclaiming
        for nbytes, ptr in runs:
            q.add(device, (ptr, True), nbytes)
        for base in whole:
            q.add(device, (base, False), CHUNK_BYTES)
        spare_small, spare_large = self._spare_small[device], self._spare_large[device]

        def spare(item, nbytes):  # after the synchronisation: the dead streams' queued work is done
            ptr, run = item
            owner.pop(ptr, None)
            if run:
                spare_large.setdefault(nbytes, []).append(ptr)
            else:
                spare_small.append(ptr)

        reclaimed = q.release(device, spare)  # nothing taken: no synchronisation
        if not reclaimed:
            return
        self._forget_last_owner()
        self._n_reclaims[device] += 1
        self._reclaimed[device] += reclaimed

    def _forget_last_owner(self) -> None:
        # the C hot path caches the last chunk's owner and the last stream's arena
        forget = getattr(self._hot_free, "__self__", None)
        if forget is not None and hasattr(forget, "forget"):
            forget.forget()

    def _release(self, device: int, keep: int) -> int:
        """Give cached chunks of ``device`` back to CUDA until at most
        ``keep`` bytes stay cached; returns the bytes released. Blocks of
        every stream's arena count: ``cudaFree`` synchronises the device, so
        no stream's work still uses a freed chunk."""
        released = 0
        with self._chunk_lock:
            for entry in list(self._dead[device].values()):
                entry[2] = -1  # free bytes change here: the next reclaim looks at every dead arena again
            chunks = self._chunks[device]
            cached = self._cached_bytes(device)
            for nbytes, lst in sorted(self._spare_large[device].items(), reverse=True):
                while cached > keep and lst:
                    self._free_chunk(lst.pop(), device)
                    cached -= nbytes
                    released += nbytes
            spare = self._spare_small[device]
            while cached > keep and spare:
                self._free_chunk(spare.pop(), device)
                cached -= CHUNK_BYTES
                released += CHUNK_BYTES
            arenas = self._every_arena(device)
            # large blocks first (whole blocks, biggest first)
            runs = sorted({n for _, large in arenas for n in list(large)}, reverse=True)
            for nbytes in runs:
                for _, large in arenas:
                    lst = large.get(nbytes)
                    while cached > keep and lst:
                        try:
                            ptr = lst.pop()
                        except IndexError:
                            break
                        self._free_chunk(ptr, device)
                        cached -= nbytes
                        released += nbytes
            if cached > keep:
                # shared chunks whose every slot is free, in whichever arenas
                slots: dict[int, list[tuple[list, int]]] = {}
                bases = self._small_bases[device]
                for small, _ in arenas:
                    for lst in small:
                        taken = []
                        while True:
                            try:
                                taken.append(lst.pop())
                            except IndexError:
                                break
                        for ptr in taken:
                            base = bases[bisect.bisect_right(bases, ptr) - 1]
                            slots.setdefault(base, []).append((lst, ptr))
                for base, held in slots.items():
                    ci = chunks[base][1]
                    if cached > keep and len(held) == CHUNK_BYTES // SIZE_CLASSES[ci]:
                        self._free_chunk(base, device)
                        cached -= CHUNK_BYTES - CHUNK_BYTES % SIZE_CLASSES[ci]
                        released += CHUNK_BYTES
                    else:
                        for lst, ptr in sorted(held, key=lambda h: -h[1]):
                            lst.append(ptr)
        return released

    def _every_arena(self, device: int) -> list[tuple[list, dict]]:
        """The lists of every arena on ``device``: live streams' and destroyed
        streams' not yet forgotten (queued or in ``_dead``)."""
        out = list(self._lists[device].values())
        out += [lists for d, lists, _ in list(self._died) if d == device]
        out += [entry[0] for entry in list(self._dead[device].values())]
        return out

    def _free_chunk(self, ptr: int, device: int) -> None:
        nbytes, ci = self._chunks[device].pop(ptr)
        self._owner.pop(ptr, None)
        self._forget_last_owner()
        if ci >= 0:
            bases = self._small_bases[device]
            del bases[bisect.bisect_left(bases, ptr)]
        self._reserved[device] -= nbytes
        self.record_reserved(device, -nbytes)
        h = self.history
        if h is not None:
            h.segment("segment_free", ptr, nbytes, device)
        try:
            self.backend.free(ptr)
        except self._Error as exc:
            self.backend.clear_last_error()
            warn_at_user(f"managed: cudaFree of chunk 0x{ptr:x} on device {device} failed: {exc}", RuntimeWarning)

    def _cached_bytes(self, device: int) -> int:
        total = CHUNK_BYTES * len(self._spare_small[device])
        total += sum(n * len(lst) for n, lst in list(self._spare_large[device].items()))
        for small, large in self._every_arena(device):
            total += sum(SIZE_CLASSES[ci] * len(lst) for ci, lst in enumerate(small))
            total += sum(n * len(lst) for n, lst in list(large.items()))
        return total

    # -- the hot path ---------------------------------------------------------------
    def _miss(self, size: int, device: int, key: int) -> int:
        """The slow path of an allocation: no free block of ``size``'s class
        (or run of chunks) in stream ``key``'s arena on ``device``. A large
        size seen for the first time there is indexed under its 512-byte
        rounding, and may find a block freed by another size of the same run."""
        if key > 2:
            self._watch_stream(device, key)
        small, large = self._arena(device, key)
        if size <= SMALL_MAX:
            ci = _CLASS_INDEX[(size + 511) >> 9]
            try:
                return small[ci].pop()  # another thread freed one
            except IndexError:
                return self._refill(ci, size, device, key)
        n = (size + CHUNK_BYTES - 1) & _CHUNK_MASK
        if n >= SIZE_T_LIMIT:
            raise ValueError(
                f"size: {size} bytes rounds up to {n} bytes of 2 MiB chunks, which does not fit in size_t"
            )
        lst = large.get(n)
        if lst is None:
            lst = large.setdefault(n, [])
        self._arenas[device][key][1][(size + 511) & -512] = lst
        prefetch = self.config["prefetch"]
        try:
            ptr = lst.pop()
        except IndexError:
            ptr = self._spare_run(device, n)
            if ptr:  # a destroyed stream's, synchronised: as cached
                self._owner[ptr] = self._arenas[device][key]
                prefetch = prefetch if prefetch == "on_alloc" else None
            else:
                ptr = self._new_chunks(n, size, device, -1)
                self._owner[ptr] = self._arenas[device][key]
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
        # The base class's closures with the stream-ordered chunk cache
        # inlined (it needs the device and the stream, which a plain
        # allocate(size) hook does not get). Same accounting as the base:
        # events append before the live insert. A cached allocation finds
        # its arena by stream key, then its free list by the size in 512-byte
        # units: a list for small sizes, a dict (filled on first use) above.
        accounts = self.accounts
        events, live, origins, track = accounts.events, accounts.live, accounts.origins, self._track_origins
        capture = origin_capture(track)  # the first frame, or track_origins=N frames
        arenas, owner, arena_of = self._arenas, self._owner, self._arena_of
        miss, fold, unknown_free = self._miss, accounts.fold, self._unknown_free
        deferred = self.deferred
        recorded, pending, poll, defer, watch = (deferred.recorded, deferred.pending, deferred.poll, deferred.defer,
                                                 self._watch)
        prefetch_to = self._prefetch_to if self.config["prefetch"] == "on_alloc" else None
        capsule, stream_ptr = self._stream_source()
        Accounting = c_accounting(track)
        if Accounting is not None:  # the same steps in C (csrc/hotpath.c, "classes" mode)
            acc = self._new_accounting(
                Accounting, unknown_free, self.recovery.allocation_failed,
                arenas=arenas, owner=owner, arena_of=arena_of, chunk_bytes=CHUNK_BYTES,
                stream_ptr=stream_ptr, capsule=capsule,
                small_max=SMALL_MAX, miss=miss,
                large_hit=self._large_hit if prefetch_to is not None else None,
                recorded=recorded, defer=defer, pending=pending, poll=poll, watch=watch,
            )
            self._hot_malloc, self._hot_free, self.hot_path = acc.malloc, acc.free, "c"
            return acc.malloc, acc.free
        get_ident = threading.get_ident

        def malloc(size, device):
            if pending:  # blocks freed with record_stream() whose streams may be done
                poll()
            key = stream_ptr(device)
            if key == 2:  # cudaStreamPerThread: one stream per thread (cupy#5069)
                key = -get_ident()
            arena = arenas[device].get(key)
            ptr = 0
            if arena is not None:
                if size <= SMALL_MAX:
                    lst = arena[0][(size + 511) >> 9]
                    if lst:
                        try:
                            ptr = lst.pop()
                        except IndexError:  # another thread took the last one
                            pass
                else:
                    lst = arena[1].get((size + 511) & -512)
                    if lst:
                        try:
                            ptr = lst.pop()
                        except IndexError:
                            pass
                        else:
                            if prefetch_to is not None:
                                n = (size + CHUNK_BYTES - 1) & _CHUNK_MASK
                                prefetch_to(ptr, n, device, size, lambda: lst.append(ptr))
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
                arena = owner.get(ptr & _CHUNK_MASK) or arena_of(ptr, device)
                if size <= SMALL_MAX:
                    arena[0][(size + 511) >> 9].append(ptr)
                else:
                    arena[1][(size + 511) & -512].append(ptr)  # indexed when it was allocated
            if watch[0] is not None and not live[device]:
                watch[0]()

        self._hot_malloc, self._hot_free, self.hot_path = malloc, free, "python"
        return malloc, free

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """A block whose recorded streams are done goes to its arena."""
        try:
            arena = self._owner.get(ptr & _CHUNK_MASK) or self._arena_of(ptr, device)
            if size <= SMALL_MAX:
                arena[0][(size + 511) >> 9].append(ptr)
            else:
                arena[1][(size + 511) & -512].append(ptr)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            warn_at_user(f"managed: caching 0x{ptr:x} ({size} bytes) on device {device} failed: {exc!r}",
                         RuntimeWarning)

    def _arena_of(self, ptr: int, device: int) -> tuple[list, dict]:
        """The arena a live block goes back to, when its chunk's base is not
        ``ptr & _CHUNK_MASK`` (CUDA gave a chunk that is not 2 MiB-aligned)."""
        if ptr in self._owner:
            return self._owner[ptr]
        bases = self._small_bases[device]
        i = bisect.bisect_right(bases, ptr) - 1
        if i >= 0 and bases[i] in self._owner:
            return self._owner[bases[i]]
        raise RuntimeError(f"managed: 0x{ptr:x} lies in no chunk of this strategy on device {device}")

    def _large_hit(self, ptr: int, size: int, device: int, key: int) -> None:
        """The C hot path, ``prefetch="on_alloc"``: prefetch a cached large
        block taken for ``size`` from stream ``key``'s arena (as the Python
        hot path does inline)."""
        lst = self._arenas[device][key][1][(size + 511) & -512]
        self._prefetch_to(ptr, (size + CHUNK_BYTES - 1) & _CHUNK_MASK, device, size, lambda: lst.append(ptr))

    # -- statistics and control -----------------------------------------------------
    segment_kind = "chunks"

    def memory_segments(self, device: int | None = None) -> list[dict]:
        """As :meth:`Strategy.memory_segments`, the segments being this
        strategy's chunks: a shared chunk's blocks are its size-class slots
        (live ones active, runs of free ones merged), a large block's run of
        chunks is one segment with one block."""
        devices = range(len(self._chunks)) if device is None else [self._device_or_current(device)]
        origins = self.accounts.origins
        out = []
        for d in devices:
            live = self.accounts.live[d]
            for base, (nbytes, ci) in sorted(list(self._chunks[d].items())):
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
            n_chunks=self._reserved[d] // CHUNK_BYTES,
            reserved_bytes=self._reserved[d],
            cached_bytes=self._cached_bytes(d),
            n_guard_refusals=self._n_refused[d],
            n_reclaims=self._n_reclaims[d],
            reclaimed_bytes=self._reclaimed[d],
        )

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
        devices = range(len(self._chunks)) if device is None else [self._device_or_current(device)]
        keeps = []
        for d in devices:  # every value checked before anything is released
            total = self.backend.device_properties(d)["total_memory"] if isinstance(keep_bytes, str) else None
            keeps.append(parse_size(keep_bytes, total=total, what="keep_bytes"))
        self.deferred.flush()  # blocks waiting for recorded streams are cache too
        return sum(self._release(d, keep) for d, keep in zip(devices, keeps))

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
            for d, chunks in enumerate(self._chunks):
                for ptr in list(chunks):
                    self._free_chunk(ptr, d)
        except Exception:  # noqa: BLE001 - interpreter shutdown, CUDA gone
            pass
