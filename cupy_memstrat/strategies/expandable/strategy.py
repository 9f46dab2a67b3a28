"""The ``expandable`` strategy: one reserved range of virtual addresses per device, physical
memory mapped into it page by page as it grows, blocks cut from it so that a freed block
always joins its free neighbours."""

from __future__ import annotations

import itertools
import threading
import weakref

from ... import backends as _backends
from ...options import Option, as_bool
from ...sizes import format_size, parse_size
from ..arenas import build_arena_hot_path
from ..base import Strategy
from ..stream_deaths import StreamWatch
from .space import Space

__all__ = ["ExpandableStrategy"]

_ROUND = 512  # blocks are multiples of 512 B, as CuPy's pools round
_ADDRESS_FACTOR = 2  # addresses reserved per device: twice its memory


def _as_threshold(value, what: str):
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "keep all")):
        return None
    if isinstance(value, str) and value.strip().endswith("%"):
        parse_size(value, total=100, what=what)
        return value.strip()
    n = parse_size(value, what=what)
    if n < 0:
        raise ValueError(f"{what}: expected a size >= 0 or None (keep all), got {value!r}")
    return n


def _as_max_size(value, what: str):
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().endswith("%"):
        if parse_size(value, total=1 << 40, what=what) == 0:
            raise ValueError(f"{what}: expected a percentage above 0%, got {value!r} (0 or None: no limit)")
        return value.strip()
    n = parse_size(value, what=what)
    if n < 0:
        raise ValueError(f"{what}: expected a size >= 0 (0: no limit), got {value!r}")
    if n == 0 and value not in (0, "0") and any(c in "123456789" for c in str(value)):
        raise ValueError(f"{what}: {value!r} rounds to 0 bytes; expected 0 (no limit) or a size of at least "
                         "one page (2 MiB)")
    return n


class ExpandableStrategy(Strategy):
    """One growing range of virtual addresses per device (CUDA's virtual memory management),
    physical memory mapped into it in pages of the allocation granularity (2 MiB on the H100,
    measured: docs/results/h100/vmm-facts.json), blocks cut from the range.

    * **Reserve, then map.** On a device's first allocation the strategy reserves twice the
      device's memory of addresses (``cuMemAddressReserve``; no memory is used). A block is
      cut from the smallest free range of addresses that holds it; the pages it touches that
      have no memory yet get a page each (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``).
    * **No fragmentation between blocks.** A freed block joins its free neighbours, and the
      pages under it stay mapped for the next block there. A request larger than every hole
      extends the used part of the range instead: memory reserved is memory in use plus
      pages that are partly used or wait for a synchronisation.
    * **Streams.** A freed block is reused at once by allocations on the stream it was
      allocated on (CuPy's stream key: :meth:`~cupy_memstrat.Strategy.stream_key`); other
      streams get it only after a device synchronisation the strategy makes itself, at
      :meth:`trim` and when memory runs out. :func:`cupy_memstrat.record_stream` holds a
      block back until the recorded streams are done.
    * **Trim** unmaps and releases every mapped page that no block touches, anywhere in the
      range (``cuMemUnmap``, ``cuMemRelease``), after a device synchronisation; live data
      never moves.
    * **Out of memory** (the device's physical memory, ``max_size``, or, in a range cut into
      many holes, the addresses): the strategy trims, collects garbage and retries in CuPy's
      order, then raises :class:`~cupy_memstrat.OutOfMemoryError` saying which ran out.

    Options (besides ``track_origins`` and ``oom_snapshot``):
        max_size: most bytes of physical memory mapped per device (a size or ``"N%"`` of the
            device's memory); 0 or None: no limit but the device's.
        release_threshold: most bytes mapped and unused per device (a size or ``"N%"``), as
            the release threshold of CUDA's stream-ordered pools: with more unused, the next
            allocation on the device that no kept block serves trims down to it (a device
            synchronisation). It keeps at most the threshold plus one page, besides the unused
            parts of pages live blocks touch and the kept blocks. None (the default): keep everything until
            :meth:`trim` or an out-of-memory error, as CuPy's pool does.
        remap: grow by moving mapped pages no block uses before mapping new memory (default
            True).

    Costs, measured on an H100: mapping a 2 MiB page costs about what a ``cudaMalloc`` of
    2 MiB costs (38 us against 40 us), so growing by 1 GiB takes about 20 ms once; blocks
    reused from mapped pages cost no CUDA call.

    Raises:
        ValueError: a bad option, before anything is reserved.
        NoDeviceError, CuPyNotInstalledError: as every strategy.
    """

    name = "expandable"
    aliases = ("vmm",)
    description = ("one growing virtual address range per device, memory mapped in 2 MiB pages: freed blocks "
                   "join their neighbours, no fragmentation between blocks")
    reserved_is_in_use = False
    block_granule = _ROUND
    own_hot_path = True  # no allocate/deallocate hooks (the strategy contract, docs/strategies.md)
    options = (
        Option("max_size", _as_max_size, 0,
               "most bytes of memory mapped per device (size or N%); 0: no limit but the device's"),
        Option("release_threshold", _as_threshold, None,
               "most bytes mapped and unused per device (size or N%) before the next allocation trims (a "
               "device synchronisation); None: keep all until trim()"),
        Option("remap", as_bool, True,
               "grow by moving mapped pages no block uses (after a device synchronisation) before mapping new "
               "memory; False: map new memory, keep the free pages until a trim"),
    )

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        missing = _backends.missing(self.backend, _backends.VmmBackend)
        if missing:
            raise TypeError(f"expandable: the backend lacks CUDA's virtual memory management ({', '.join(missing)})")
        n = self.accounts.n_devices
        self._check_sizes(n)
        self._spaces: list[Space | None] = [None] * n
        self._limits: list[int | None] = [None] * n
        self._thresholds: list[int | None] = [None] * n  # release_threshold in bytes, per device
        #: unused bytes above which the next allocation that no kept block serves trims, per device
        self._trim_at: list[int | None] = [None] * n
        #: per device: stream key -> its arena of freed blocks, kept whole for the stream's next
        #: request of the same size (strategies/arenas.py; ``small_max`` 0: one list for
        #: 0-byte requests, then a list per size in 512 B units)
        self._arenas: list[dict[int, tuple[list, dict]]] = [{} for _ in range(n)]
        self._owner: dict[int, tuple[list, dict]] = {}  # block start -> the arena it goes back to
        self._blocks: dict[int, tuple[int, int, int]] = {}  # ptr -> (bytes, device, stream key), kept ones too
        #: destroyed streams not yet seen to, per device: (stream key, its arena or None); and
        #: those seen to: (the tag their free ranges have, their arena), until a synchronisation
        #: has waited for their work and no live block of theirs is left
        self._died: list[list[tuple]] = [[] for _ in range(n)]
        self._dead: list[list[tuple]] = [[] for _ in range(n)]
        self._dead_tags = itertools.count()
        me = weakref.ref(self)  # not the strategy itself, which the watch must not keep alive

        def stream_died(device, key):
            # In the stream's deallocation, before the program can make another stream (which
            # CUDA may give the same handle): dict and list operations only (no lock, nothing CUDA).
            strategy = me()
            if strategy is not None:
                strategy._died[device].append((key, strategy._arenas[device].pop(key, None)))
                strategy._forget_last_owner()  # the C hot path's cached arena of this handle

        self._stream_watch = StreamWatch(self.backend, n, stream_died)
        self._why: list[str | None] = [None] * n  # what ran out at the last failed allocation
        self._lock = threading.RLock()
        #: pages moved to where the range grew, per device (option ``remap``)
        self.n_pages_moved = [0] * n

    def _check_sizes(self, n: int) -> None:
        """Refuse a max_size or release_threshold above a device's memory, and a max_size
        below one page, before anything is reserved."""
        b = self.backend
        for d in range(n):
            total = b.device_properties(d)["total_memory"]
            sizes = {}
            for what in ("max_size", "release_threshold"):
                v = self.config[what]
                v = parse_size(v, total=total, what=f"expandable: {what}") if isinstance(v, str) else v
                if v and v > total:
                    raise ValueError(f"expandable: option {what}={v} bytes ({format_size(v)}) is above device {d}'s "
                                     f"memory ({format_size(total)})")
                sizes[what] = v
            if self.config["max_size"]:  # ("N%" of a small device may come to less than a page, or 0)
                page = b.vmm_granularity(d)
                if sizes["max_size"] < page:
                    raise ValueError(f"expandable: option max_size={format_size(sizes['max_size'])} is below one "
                                     f"page ({format_size(page)}, device {d}'s allocation granularity): no block "
                                     "would fit")

    # -- the space of a device ------------------------------------------------------------
    def _space(self, device: int) -> Space:
        space = self._spaces[device]
        if space is None:
            b = self.backend
            total = b.device_properties(device)["total_memory"]
            page = b.vmm_granularity(device)
            size = -(-total * _ADDRESS_FACTOR // page) * page
            base = b.vmm_reserve(size)
            space = self._spaces[device] = Space(base, size, page)
            limit = self.config["max_size"]
            self._limits[device] = (parse_size(limit, total=total, what="expandable: max_size")
                                    if isinstance(limit, str) else limit) or None
            thr = self.config["release_threshold"]
            self._thresholds[device] = self._trim_at[device] = (
                parse_size(thr, total=total, what="expandable: release_threshold") if isinstance(thr, str) else thr)
        return space

    # -- the hot path -------------------------------------------------------------------
    def _build_hot_path(self):
        # A freed block is kept whole in the arena of the stream it was allocated on
        # (strategies/arenas.py): the stream's next request of its size takes it with no
        # search and no CUDA call, in C where the extension is built; the rest is _miss.
        self._hot_malloc, self._hot_free, self.hot_path = build_arena_hot_path(
            self, arenas=self._arenas, owner=self._owner, arena_of=self._arena_of, chunk_bytes=_ROUND,
            small_max=0, miss=self._miss)
        return self._hot_malloc, self._hot_free

    def _arena(self, device: int, key: int) -> tuple[list, dict]:
        arena = self._arenas[device].get(key)
        if arena is None:
            arena = self._arenas[device].setdefault(key, ([[]], {}))
        return arena

    def _arena_of(self, ptr: int, device: int) -> tuple[list, dict]:
        _nbytes, d, key = self._blocks[ptr]
        return self._arena(d, key)

    def _miss(self, size: int, device: int, key: int) -> int:
        """The slow path of an allocation: no block of ``size`` kept for stream ``key``.
        Recovers from out of memory in CuPy's order, or raises
        :class:`~cupy_memstrat.OutOfMemoryError` saying what ran out."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if key > 2 and not self._stream_watch.is_watched(device, key):
            # a stream CuPy made: when it dies, its blocks wait for a synchronisation
            stream = self.backend.current_stream(device)
            if getattr(stream, "ptr", None) == key:
                self._stream_watch.watch(device, stream)
        try:
            return self._carve(size, device, key)
        except self._Error as exc:
            return self.recovery.recover(size, device, exc, lambda: self._carve(size, device, key),
                                         detail=lambda: f" ({self._why[device]})" if self._why[device] else "")

    def _carve(self, size: int, device: int, key: int) -> int:
        """A block of ``size`` bytes (rounded up to 512) cut from the device's range for
        stream ``key``.

        Raises:
            backend.Error: ``cudaErrorMemoryAllocation`` when the device's memory,
                ``max_size`` or the free addresses do not suffice.
        """
        b = self.backend
        nbytes = -(-size // _ROUND) * _ROUND or _ROUND  # a 0-byte request gets a block of its own too
        with self._lock:
            space = self._space(device)
            if self._died[device]:
                self._see_to_dead_streams(device, space)
            at = self._trim_at[device]
            if at is not None and self._unused_bytes(device) > at:  # more unused than release_threshold
                self._trim_to_threshold(device)
            start = space.take(nbytes, key)
            if (start is None or space.unmapped_pages(start, nbytes)) and self._kept_bytes(device):
                # before the range grows: the kept blocks join their free neighbours, and the
                # request is looked for again
                if start is not None:
                    space.give(start, nbytes, key)
                self._release_kept(device)
                start = space.take(nbytes, key)
            if start is None:
                self._why[device] = (f"no free range of {format_size(nbytes)} in the {format_size(space.size)} of "
                                     "addresses reserved")
                raise b.Error(_backends.ERROR_MEMORY_ALLOCATION)
            try:
                self._map_pages(space, device, start, nbytes)
            except BaseException:
                space.give(start, nbytes, key)
                raise
            self._blocks[start] = (nbytes, device, key)
            self._owner[start] = self._arena(device, key)
            self._forget_last_owner()  # the C hot path's cached owner of this address, if it had one
        return start

    def _map_pages(self, space: Space, device: int, start: int, nbytes: int) -> None:
        pages = space.unmapped_pages(start, nbytes)
        if not pages:
            return
        b, page = self.backend, space.page
        limit = self._limits[device]
        moved = self._move_free_pages(space, device, pages) if self.config["remap"] else []
        pages = pages[len(moved):]
        if not pages:
            return
        if limit is not None and space.mapped_bytes + len(pages) * page > limit:
            self._why[device] = (f"max_size {format_size(limit)} reached: {format_size(space.mapped_bytes)} mapped, "
                                 f"{format_size(len(pages) * page)} more needed")
            raise b.Error(_backends.ERROR_MEMORY_ALLOCATION)
        if len(pages) > 64 and len(pages) * page > b.mem_get_info(device)[0]:
            # a large growth the device cannot hold: refused before thousands of pages are made and undone
            self._why[device] = self._no_memory(device, nbytes)
            raise b.Error(_backends.ERROR_MEMORY_ALLOCATION)
        done = []
        try:
            for p in pages:
                h = b.vmm_create(device, page)
                try:
                    b.vmm_map(p, page, h)
                except BaseException:
                    b.vmm_release(h)
                    raise
                done.append((p, h))
            self._set_access(device, [p for p, _ in done], page)
        except BaseException as exc:
            for p, h in done:  # nothing half made stays behind
                b.vmm_unmap(p, page)
                b.vmm_release(h)
            if getattr(exc, "status", None) == _backends.ERROR_MEMORY_ALLOCATION:
                self._why[device] = self._no_memory(device, nbytes)
            raise
        for p, h in done:
            space.map(p, h)
        self.record_reserved(device, len(done) * page)

    def _move_free_pages(self, space: Space, device: int, pages: list[int]) -> list[int]:
        """Move mapped pages no block touches to ``pages`` (the highest first), as many as
        there are, so that the range grows without taking more memory from CUDA. Their
        memory may still be read by work queued before its blocks were freed, and an unmap
        does not wait for it: the device is synchronised first. Returns the pages mapped."""
        free = space.free_pages()
        if not free:
            return []
        b, page = self.backend, space.page
        b.device_synchronize(device)
        space.settle()
        self._drop_dead(device)
        out = []
        for old, new in zip(reversed(free), pages):
            h = space.unmap(old)
            b.vmm_unmap(old, page)
            try:
                b.vmm_map(new, page, h)
            except BaseException:
                b.vmm_release(h)
                self.record_reserved(device, -page)
                raise
            space.map(new, h)
            out.append(new)
        self._set_access(device, out, page)
        self.n_pages_moved[device] += len(out)
        return out

    def _no_memory(self, device: int, nbytes: int) -> str:
        total = self.backend.device_properties(device)["total_memory"]
        if nbytes > total:
            return f"the request is larger than the device's memory ({format_size(total)})"
        return "the device's memory is used up"

    def _set_access(self, device: int, pages: list[int], page: int) -> None:
        for run_start, run_len in _runs(pages, page):
            self.backend.vmm_set_access(run_start, run_len, device)

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """A block freed with recorded streams, once they are done: kept for its stream."""
        arena = self._owner[ptr]
        lst = arena[0][0] if size == 0 else arena[1].setdefault((size + 511) & -512, [])
        lst.append(ptr)

    def _forget_last_owner(self) -> None:
        forget = getattr(self._hot_free, "__self__", None)
        if forget is not None and hasattr(forget, "forget"):
            forget.forget()

    def _see_to_dead_streams(self, device: int, space: Space) -> None:
        """Destroyed streams' free ranges and kept blocks become no stream's until a
        synchronisation (under the lock): CUDA may give a destroyed stream's handle to a new
        stream while the destroyed one's work still runs, and does not order the new stream
        after it."""
        died = self._died[device]
        while died:
            key, arena = died.pop()
            tag = ("destroyed stream", key, next(self._dead_tags))
            space.retag(key, tag)
            if arena is not None:
                self._dead[device].append((tag, arena))

    def _drop_dead(self, device: int) -> None:
        """After a synchronisation: forget the destroyed streams' arenas that keep no block and
        that no live block goes back to (under the lock)."""
        if self._dead[device]:
            owners = {id(a) for a in self._owner.values()}
            self._dead[device] = [(t, a) for t, a in self._dead[device]
                                  if id(a) in owners or a[0][0] or any(a[1].values())]

    def _kept_bytes(self, device: int) -> int:
        """Bytes of the blocks kept in the arenas of ``device``, destroyed streams' included."""
        n = 0
        for small, large in [*self._arenas[device].values(), *(a for _t, a in self._dead[device])]:
            n += len(small[0]) * _ROUND
            for nbytes, lst in list(large.items()):
                n += len(lst) * nbytes
        return n

    def _unused_bytes(self, device: int) -> int:
        """Bytes mapped on ``device`` that no live block uses (kept blocks count as unused)."""
        space = self._spaces[device]
        return space.mapped_bytes - space.used_bytes + self._kept_bytes(device)

    def _trim_to_threshold(self, device: int) -> None:
        """Trim ``device`` down to its release threshold; the next trim is asked for only once
        the unused bytes pass what this one could not release, plus one page."""
        thr = self._thresholds[device]
        self.trim(keep_bytes=thr, device=device)
        space = self._spaces[device]
        with self._lock:
            self._trim_at[device] = max(thr, self._unused_bytes(device)) + space.page

    def _release_kept(self, device: int) -> None:
        """Give the kept blocks of ``device`` to its address space (under the lock)."""
        space = self._spaces[device]
        if self._died[device]:
            self._see_to_dead_streams(device, space)
        arenas = [*self._arenas[device].items(), *self._dead[device]]  # (stream key or tag, arena)
        for key, (small, large) in arenas:
            for lst in (small[0], *list(large.values())):
                while lst:
                    try:
                        ptr = lst.pop()
                    except IndexError:
                        break
                    nbytes = self._blocks.pop(ptr)[0]
                    del self._owner[ptr]
                    space.give(ptr, nbytes, key)

    # -- off the hot path ---------------------------------------------------------------
    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Unmap and release every mapped page no block touches, anywhere in the range, after
        synchronising the device (so that every free is ordered), down to ``keep_bytes``
        mapped and unused. Live blocks never move.

        Returns:
            int: bytes given back to CUDA.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        targets = self._trim_devices(keep_bytes, device)
        self.deferred.flush()
        released = 0
        b = self.backend
        for d, keep in targets:
            with self._lock:
                space = self._spaces[d]
                if space is None:
                    continue
                self._release_kept(d)
                b.device_synchronize(d)
                space.settle()
                self._drop_dead(d)
                free = space.free_pages()
                spare = len(free) * space.page - keep
                out = free[len(free) - max(0, spare) // space.page:] if spare > 0 else []
                for p in out:  # the highest first stay last: release from the top of the range
                    h = space.unmap(p)
                    b.vmm_unmap(p, space.page)
                    b.vmm_release(h)
                if out:
                    n = len(out) * space.page
                    self.record_reserved(d, -n)
                    released += n
        return released

    def largest_free_block(self, device: int) -> int | None:
        """The largest free range of addresses that is mapped throughout: what the strategy
        serves without mapping more (exact).

        Raises:
            TypeError, ValueError: a bad ``device``.
        """
        device = self._device_or_current(device)
        space = self._spaces[device]
        if space is None:
            return 0
        with self._lock:
            self._release_kept(device)
            return space.largest_free_mapped()

    def close(self) -> None:
        super().close()
        b = self.backend
        with self._lock:
            for d, space in enumerate(self._spaces):
                if space is None:
                    continue
                self._release_kept(d)
                if self._blocks_on(d):
                    continue
                released = 0
                try:
                    b.device_synchronize(d)
                    for p in list(space.mapped):
                        b.vmm_unmap(p, space.page)
                        b.vmm_release(space.unmap(p))
                        released += space.page
                    b.vmm_free_address(space.base, space.size)
                except Exception:  # noqa: BLE001 - closing must not raise; CUDA frees it at exit
                    b.clear_last_error()
                    continue
                finally:
                    if released:
                        self.record_reserved(d, -released)
                self._spaces[d] = None
                self._trim_at[d] = self._thresholds[d] = None  # set again with a new range

    def _blocks_on(self, device: int) -> bool:
        return any(d == device for _n, d, _k in self._blocks.values())


def _runs(pages: list[int], page: int):
    """Runs of consecutive pages: ``(start, bytes)``."""
    run_start = prev = None
    for p in pages:
        if run_start is None:
            run_start = prev = p
        elif p == prev + page:
            prev = p
        else:
            yield run_start, prev + page - run_start
            run_start = prev = p
    if run_start is not None:
        yield run_start, prev + page - run_start
