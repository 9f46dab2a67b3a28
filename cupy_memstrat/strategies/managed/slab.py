"""The slab of the ``managed`` strategy: size classes, chunks and per-stream arenas.

No CUDA here: the strategy makes and frees the chunks (``cudaMallocManaged`` /
``cudaFree``), and this keeps what they are cut into and who may use which
piece, as CuPy's ``_Arena`` keeps its free lists apart from the pool that
fills them.

* A chunk is the unit in which memory comes from CUDA: 2 MiB, the size of the
  driver's VA blocks. A request above :data:`SMALL_MAX` takes its own run of
  chunks (a multiple of 2 MiB); smaller ones take a slot of a shared chunk of
  their size class (:data:`SIZE_CLASSES`: multiples of 512 B, at most 25% apart).
* An arena per stream (CuPy's stream key: the handle, or minus the thread's
  ident for the per-thread default stream) holds the free slots by class and
  the free runs by bytes: ``lists[d][key] = (class lists, {run bytes: list})``.
  The hot path's view of the same lists, ``arenas[d][key]``, indexes the class
  lists by the size in 512-byte units and the runs by the size rounded to
  512 B. A chunk belongs to the arena it was made for, for good
  (``owner[base]``), and a freed block goes back there, whatever stream is
  current at the free: only later work on that stream reuses it.
* A destroyed stream's arena leaves the tables at once (:meth:`Slab.stream_died`,
  from the stream's deallocation); its free chunks are taken back
  (:meth:`Slab.reclaim`) through a quarantine, so that one synchronisation
  waits for the dead stream's work before any of them is spare, for any stream.
"""

from __future__ import annotations

import bisect
import collections
import threading

__all__ = ["CHUNK_BYTES", "CHUNK_MASK", "CLASS_INDEX", "SIZE_CLASSES", "SMALL_MAX", "Slab", "class_index"]

#: A chunk: the unit in which the strategy takes managed memory from CUDA,
#: the size of the driver's VA blocks (docs/claims.md: cudaMallocManaged returned
#: 2 MiB-aligned pointers; ranges off a 2 MiB boundary were ~35% slower).
CHUNK_BYTES = 2 << 20
CHUNK_MASK = -CHUNK_BYTES
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
#: (size + 511) >> 9  ->  index of the smallest class that holds size
CLASS_INDEX = tuple(
    bisect.bisect_left(SIZE_CLASSES, max(i << 9, 1)) for i in range((SMALL_MAX >> 9) + 1)
)


def class_index(size: int) -> int:
    """The index in :data:`SIZE_CLASSES` of the smallest class that holds ``size`` (1 to SMALL_MAX bytes)."""
    return CLASS_INDEX[(size + 511) >> 9]


class Slab:
    """The chunks and arenas of one strategy over ``n_devices`` devices.

    The hot path reads :attr:`arenas` and :attr:`owner` directly (list pops and
    appends, atomic in CPython); everything that changes which chunk is where
    takes :attr:`lock`.
    """

    def __init__(self, n_devices: int):
        n = n_devices
        #: per device: stream key -> (class lists, {run bytes: list})
        self.lists: list[dict[int, tuple[list, dict]]] = [{} for _ in range(n)]
        #: per device: stream key -> the hot path's view of the same lists
        self.arenas: list[dict[int, tuple[list, dict]]] = [{} for _ in range(n)]
        #: chunk base -> the view of the arena it belongs to
        self.owner: dict[int, tuple[list, dict]] = {}
        #: destroyed streams' arenas, queued from their deallocation: (device, lists, view)
        self.died: list[tuple[int, tuple, tuple]] = []
        #: per device: id(lists) -> [lists, view, free bytes at the last reclaim (-1: none yet)]
        self.dead: list[dict[int, list]] = [{} for _ in range(n)]
        #: per device: whole shared chunks (any class) and runs (bytes -> bases) no arena owns
        self.spare_small: list[list[int]] = [[] for _ in range(n)]
        self.spare_large: list[dict[int, list[int]]] = [{} for _ in range(n)]
        self._empty_arenas: list[list[tuple]] = [[] for _ in range(n)]  # forgotten arenas' tables, empty
        #: per device: chunk base -> (bytes, class index or -1 for a run)
        self.chunks: list[dict[int, tuple[int, int]]] = [{} for _ in range(n)]
        self._small_bases: list[list[int]] = [[] for _ in range(n)]  # shared chunks' bases, sorted
        #: per device: synchronisations that took chunks back, and their bytes
        self.n_reclaims = [0] * n
        self.reclaimed = [0] * n
        self.lock = threading.RLock()

    # -- arenas ------------------------------------------------------------------------
    def arena(self, device: int, key: int) -> tuple[list, dict]:
        """The lists of stream ``key``'s arena on ``device``, made on first use."""
        lists = self.lists[device].get(key)
        if lists is None:
            with self.lock:
                lists = self.lists[device].get(key)
                if lists is None:
                    recycled = self._empty_arenas[device]
                    if recycled:  # a destroyed stream's arena, forgotten empty: no new tables
                        lists, view = recycled.pop()
                    else:
                        small = [[] for _ in SIZE_CLASSES]
                        lists = (small, {})
                        view = ([small[ci] for ci in CLASS_INDEX], {})
                    self.lists[device][key] = lists
                    self.arenas[device][key] = view
        return lists

    def stream_died(self, device: int, key: int) -> bool:
        """Stream ``key`` of ``device`` was destroyed: its arena leaves the tables (no stream
        finds it by that handle any more) and waits for :meth:`reclaim`. Dict and list
        operations only (it runs in the stream's deallocation). Returns whether it had one."""
        mine, view = self.lists[device].pop(key, None), self.arenas[device].pop(key, None)
        if mine is not None:
            self.died.append((device, mine, view))
        return mine is not None

    def every_arena(self, device: int) -> list[tuple[list, dict]]:
        """The lists of every arena on ``device``: live streams' and destroyed
        streams' not yet forgotten (queued or in :attr:`dead`)."""
        out = list(self.lists[device].values())
        out += [lists for d, lists, _ in list(self.died) if d == device]
        out += [entry[0] for entry in list(self.dead[device].values())]
        return out

    @staticmethod
    def free_bytes(lists: tuple[list, dict]) -> int:
        """Bytes of the free slots and runs in an arena's lists."""
        small, large = lists
        return sum(SIZE_CLASSES[ci] * len(lst) for ci, lst in enumerate(small) if lst) + sum(
            n * len(lst) for n, lst in list(large.items())
        )

    def cached_bytes(self, device: int) -> int:
        """Bytes free on ``device``: spare chunks and runs, and every arena's free blocks."""
        total = CHUNK_BYTES * len(self.spare_small[device])
        total += sum(n * len(lst) for n, lst in list(self.spare_large[device].items()))
        for lists in self.every_arena(device):
            total += self.free_bytes(lists)
        return total

    def largest_free(self, device: int) -> int:
        """Bytes of the largest request ``device``'s cache serves without a new chunk: the
        biggest free run (it serves requests that round up to its size), a whole spare chunk
        (any slot class, up to :data:`SMALL_MAX`), or the biggest class with a free slot. A
        block serves the stream whose arena holds it; destroyed streams' blocks count (they are
        taken back before new chunks are made). 0: nothing free."""
        best = max((n for n, lst in list(self.spare_large[device].items()) if lst), default=0)
        if self.spare_small[device]:
            best = max(best, SMALL_MAX)
        for small, large in self.every_arena(device):
            best = max(best, max((n for n, lst in list(large.items()) if lst), default=0))
            if best < SMALL_MAX:
                best = max(best, max((SIZE_CLASSES[ci] for ci, lst in enumerate(small) if lst), default=0))
        return best

    def arena_of(self, ptr: int, device: int) -> tuple[list, dict]:
        """The arena a live block goes back to, when its chunk's base is not
        ``ptr & CHUNK_MASK`` (CUDA gave a chunk that is not 2 MiB-aligned).

        Raises:
            RuntimeError: ``ptr`` lies in no chunk on ``device``.
        """
        if ptr in self.owner:
            return self.owner[ptr]
        bases = self._small_bases[device]
        i = bisect.bisect_right(bases, ptr) - 1
        if i >= 0 and bases[i] in self.owner:
            return self.owner[bases[i]]
        raise RuntimeError(f"managed: 0x{ptr:x} lies in no chunk of this strategy on device {device}")

    def give_back(self, ptr: int, size: int, device: int) -> None:
        """A block of ``size`` bytes whose free is accounted goes to its arena's free list."""
        arena = self.owner.get(ptr & CHUNK_MASK) or self.arena_of(ptr, device)
        if size <= SMALL_MAX:
            arena[0][(size + 511) >> 9].append(ptr)
        else:
            arena[1][(size + 511) & -512].append(ptr)

    # -- chunks ------------------------------------------------------------------------
    def add_chunk(self, device: int, base: int, nbytes: int, ci: int) -> None:
        """A chunk (``ci`` >= 0: shared, of class ``ci``) or a run (``ci`` = -1) of
        ``nbytes`` came from CUDA."""
        with self.lock:
            self.chunks[device][base] = (nbytes, ci)
            if ci >= 0:
                bisect.insort(self._small_bases[device], base)

    def remove_chunk(self, device: int, base: int) -> int:
        """The chunk at ``base`` goes back to CUDA: out of the tables; returns its bytes."""
        with self.lock:
            nbytes, ci = self.chunks[device].pop(base)
            self.owner.pop(base, None)
            if ci >= 0:
                bases = self._small_bases[device]
                del bases[bisect.bisect_left(bases, base)]
            return nbytes

    def carve(self, device: int, key: int, base: int, ci: int) -> list:
        """The shared chunk at ``base`` belongs to stream ``key``'s arena now, its slots but the
        first onto the class's free list (lowest address popped first). Returns that list."""
        cls = SIZE_CLASSES[ci]
        lst = self.arena(device, key)[0][ci]
        self.owner[base] = self.arenas[device][key]
        n = CHUNK_BYTES // cls
        lst.extend(range(base + (n - 1) * cls, base, -cls))
        return lst

    def own_run(self, device: int, key: int, base: int) -> None:
        """The run at ``base`` belongs to stream ``key``'s arena now."""
        self.owner[base] = self.arenas[device][key]

    def take_spare_chunk(self, device: int, ci: int) -> int:
        """A spare whole chunk, now of class ``ci``, or 0."""
        with self.lock:
            spare = self.spare_small[device]
            if not spare:
                return 0
            base = spare.pop()
            self.chunks[device][base] = (CHUNK_BYTES, ci)
            return base

    def take_spare_run(self, device: int, nbytes: int) -> int:
        """A spare run of ``nbytes``, or 0."""
        lst = self.spare_large[device].get(nbytes)
        try:
            return lst.pop() if lst else 0
        except IndexError:  # another thread took the last one
            return 0

    def has_dead(self, device: int) -> bool:
        """Whether destroyed streams' arenas wait to be reclaimed (on ``device``, or queued)."""
        return bool(self.died or self.dead[device])

    # -- destroyed streams' chunks --------------------------------------------------------
    def reclaim(self, device: int, quarantine) -> int:
        """Take back the free chunks of destroyed streams' arenas on ``device``, before new
        chunks are made: a program that makes streams and drops them would otherwise keep
        every dead stream's cache. Every free block of those arenas is first taken out of
        circulation into ``quarantine`` (a :class:`~cupy_memstrat.strategies.stream_deaths.Quarantine`),
        whose one synchronisation waits for every queued work (the dead streams' included)
        before whole free shared chunks and free runs become spare; slots of chunks still
        partly in use go back. An arena is reclaimed again only once frees have added to
        it, and forgotten once it owns no chunk. Returns the bytes made spare (0: nothing
        taken, no synchronisation).

        Raises:
            the backend's error: the synchronisation failed (the blocks stay quarantined).
        """
        died = self.died
        while died:
            try:
                d, lists, view = died.pop()
            except IndexError:  # another thread took the last one
                break
            self.dead[d][id(lists)] = [lists, view, -1]
        dead = self.dead[device]
        if not dead:
            return 0
        reclaimed = 0
        with self.lock:
            todo = []
            for entry in list(dead.values()):
                free = self.free_bytes(entry[0])
                if free > 0 and free > entry[2]:
                    todo.append((entry[0], entry[1]))
            if todo:
                reclaimed = self._take_back(device, todo, quarantine)
            owned = {id(v) for v in list(self.owner.values())}
            for k, entry in list(dead.items()):
                if id(entry[1]) not in owned:  # owns nothing: forget it, its tables made again of use
                    dead.pop(k, None)
                    small, large = entry[0]
                    if len(self._empty_arenas[device]) < 64 and not any(small) and not any(large.values()):
                        self._empty_arenas[device].append((entry[0], entry[1]))
                else:
                    entry[2] = self.free_bytes(entry[0])
        return reclaimed

    def _take_back(self, device: int, arenas: list[tuple[tuple[list, dict], tuple]], quarantine) -> int:
        """Out of destroyed streams' arenas (``(lists, view)`` pairs; no stream allocates from
        them any more, frees may still append): every free run, and every shared chunk whose
        slots are all free, through the quarantine; then they are spare. Returns their bytes."""
        bases, chunks, owner = self._small_bases[device], self.chunks[device], self.owner
        mask = CHUNK_MASK

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
        q = quarantine
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
                    for base in full:
                        q.add(device, (base, False), CHUNK_BYTES)
            for nbytes, lst in list(large.items()):
                while lst:
                    try:
                        q.add(device, (lst.pop(), True), nbytes)
                    except IndexError:
                        break
        spare_small, spare_large = self.spare_small[device], self.spare_large[device]

        def spare(item, nbytes):  # after the synchronisation: the dead streams' queued work is done
            ptr, run = item
            owner.pop(ptr, None)
            if run:
                spare_large.setdefault(nbytes, []).append(ptr)
            else:
                spare_small.append(ptr)

        reclaimed = q.release(device, spare)  # nothing taken: no synchronisation
        if reclaimed:
            self.n_reclaims[device] += 1
            self.reclaimed[device] += reclaimed
        return reclaimed

    # -- giving chunks back to CUDA ---------------------------------------------------------
    def release(self, device: int, keep: int, free_chunk) -> int:
        """Give cached chunks of ``device`` back until at most ``keep`` bytes stay cached:
        spare runs and chunks, then free runs of every arena (biggest first), then shared
        chunks whose every slot is free. ``free_chunk(base)`` gives one back to CUDA (and
        calls :meth:`remove_chunk`). Returns the bytes released."""
        released = 0
        with self.lock:
            for entry in list(self.dead[device].values()):
                entry[2] = -1  # free bytes change here: the next reclaim looks at every dead arena again
            chunks = self.chunks[device]
            cached = self.cached_bytes(device)
            for nbytes, lst in sorted(self.spare_large[device].items(), reverse=True):
                while cached > keep and lst:
                    free_chunk(lst.pop())
                    cached -= nbytes
                    released += nbytes
            spare = self.spare_small[device]
            while cached > keep and spare:
                free_chunk(spare.pop())
                cached -= CHUNK_BYTES
                released += CHUNK_BYTES
            arenas = self.every_arena(device)
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
                        free_chunk(ptr)
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
                        free_chunk(base)
                        cached -= CHUNK_BYTES - CHUNK_BYTES % SIZE_CLASSES[ci]
                        released += CHUNK_BYTES
                    else:
                        for lst, ptr in sorted(held, key=lambda h: -h[1]):
                            lst.append(ptr)
        return released
