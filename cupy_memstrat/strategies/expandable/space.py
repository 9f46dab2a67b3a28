"""The address space of the ``expandable`` strategy on one device: a reserved range of
virtual addresses cut into blocks, and which of its pages have physical memory mapped.

No CUDA here: the strategy reserves the range and maps or unmaps pages; this keeps what is
free, where, and for which stream.

* Free space is kept as ranges of addresses, in address order, each with a *tag*: the stream
  key of the block that was freed there (only that stream may reuse it at once), or ``None``
  once a synchronisation has ordered the free (any stream may). Adjacent free ranges with the
  same tag are one range, so a freed block always joins its free neighbours.
* A request takes the smallest free range that holds it, from its low end (best fit). The
  range beyond the highest block is free too, so a request that no hole holds extends the
  used part of the space instead of leaving a hole.
* Pages (the allocation granularity, 2 MiB) are mapped when a block first needs them and
  stay mapped after its free, for the next block there; :meth:`Space.free_pages` names the
  mapped pages no block touches, which a trim unmaps.
"""

from __future__ import annotations

import bisect

__all__ = ["Space"]


class Space:
    """``size`` bytes of addresses from ``base``, pages of ``page`` bytes (a power of two)."""

    def __init__(self, base: int, size: int, page: int):
        self.base, self.size, self.page = base, size, page
        self._free: dict[int, list] = {base: [size, None]}  # start -> [size, tag]
        self._ends: dict[int, int] = {base + size: base}  # end -> start
        self._by_size: list[tuple[int, int]] = [(size, base)]  # sorted (size, start)
        #: page start -> the handle mapped there
        self.mapped: dict[int, int] = {}
        self._mapped_sorted: list[int] = []
        #: live blocks touching each mapped page (a page with none may be unmapped)
        self._users: dict[int, int] = {}
        #: bytes of the blocks taken and not given back
        self.used_bytes = 0

    # -- free ranges -----------------------------------------------------------------
    def _add(self, start: int, size: int, tag) -> None:
        self._free[start] = [size, tag]
        self._ends[start + size] = start
        bisect.insort(self._by_size, (size, start))

    def _remove(self, start: int) -> tuple[int, object]:
        size, tag = self._free.pop(start)
        del self._ends[start + size]
        i = bisect.bisect_left(self._by_size, (size, start))
        del self._by_size[i]
        return size, tag

    def take(self, nbytes: int, key: int) -> int | None:
        """The start of ``nbytes`` of free addresses this stream may use (a range tagged with
        ``key`` or ``None``), the smallest such range's low end; None where no range holds it."""
        i = bisect.bisect_left(self._by_size, (nbytes, -1))
        free = self._free
        for size, start in self._by_size[i:]:
            tag = free[start][1]
            if tag is None or tag == key:
                self._remove(start)
                if size > nbytes:
                    self._add(start + nbytes, size - nbytes, tag)
                self._use_pages(start, nbytes, +1)
                self.used_bytes += nbytes
                return start
        return None

    def give(self, start: int, nbytes: int, tag) -> None:
        """A block ``[start, start + nbytes)`` is free again, for stream ``tag`` (None: any)."""
        self._use_pages(start, nbytes, -1)
        self.used_bytes -= nbytes
        self._insert(start, nbytes, tag)

    def _insert(self, start: int, nbytes: int, tag) -> None:
        before = self._ends.get(start)
        if before is not None and self._free[before][1] == tag:
            size, _ = self._remove(before)
            start, nbytes = before, nbytes + size
        after = start + nbytes
        if after in self._free and self._free[after][1] == tag:
            size, _ = self._remove(after)
            nbytes += size
        self._add(start, nbytes, tag)

    def settle(self) -> int:
        """Every free was ordered (the device was synchronised): each range becomes any
        stream's and joins its neighbours. Returns the ranges that changed tag."""
        tagged = [(s, v[0]) for s, v in self._free.items() if v[1] is not None]
        for start, _size in tagged:
            size, _ = self._remove(start)
            self._insert(start, size, None)
        return len(tagged)

    def retag(self, old, new) -> int:
        """The free ranges kept for stream ``old`` are kept for ``new`` instead (a tag no
        stream has: a destroyed stream's ranges, which only a synchronisation makes any
        stream's). Returns the ranges retagged."""
        tagged = [s for s, v in self._free.items() if v[1] == old]
        for start in tagged:
            size, _ = self._remove(start)
            self._insert(start, size, new)
        return len(tagged)

    def tagged_bytes(self) -> int:
        """Free bytes that only the stream that freed them may use until a synchronisation."""
        return sum(v[0] for v in self._free.values() if v[1] is not None)

    # -- pages ------------------------------------------------------------------------
    def _use_pages(self, start: int, nbytes: int, delta: int) -> None:
        users, page = self._users, self.page
        p = start - (start - self.base) % page
        while p < start + nbytes:
            users[p] = users.get(p, 0) + delta
            if not users[p]:
                del users[p]
            p += page

    def unmapped_pages(self, start: int, nbytes: int) -> list[int]:
        """Starts of the pages ``[start, start + nbytes)`` touches that have nothing mapped."""
        page = self.page
        p = start - (start - self.base) % page
        out = []
        while p < start + nbytes:
            if p not in self.mapped:
                out.append(p)
            p += page
        return out

    def map(self, page_start: int, handle: int) -> None:
        self.mapped[page_start] = handle
        bisect.insort(self._mapped_sorted, page_start)

    def unmap(self, page_start: int) -> int:
        """Forget the page's mapping; returns its handle."""
        i = bisect.bisect_left(self._mapped_sorted, page_start)
        del self._mapped_sorted[i]
        return self.mapped.pop(page_start)

    def free_pages(self) -> list[int]:
        """Mapped pages that no live block touches (a trim may unmap them), in address order."""
        return [p for p in self._mapped_sorted if p not in self._users]

    @property
    def mapped_bytes(self) -> int:
        return len(self.mapped) * self.page

    def largest_free_mapped(self) -> int:
        """Bytes of the largest part of one free range that is mapped throughout: the largest
        request served without mapping more (by the stream the range is kept for, or by any
        where it is no stream's)."""
        best = 0
        page, mapped = self.page, self.mapped
        for start, (size, _tag) in self._free.items():
            end = start + size
            # the mapped run around each mapped page of the range, clipped to the range
            i = bisect.bisect_left(self._mapped_sorted, start - (start - self.base) % page)
            run_start = None
            while i < len(self._mapped_sorted) and self._mapped_sorted[i] < end:
                p = self._mapped_sorted[i]
                if run_start is None or p - page not in mapped or p - page < start - page:
                    run_start = max(p, start)
                best = max(best, min(p + page, end) - run_start)
                i += 1
        return best

    def free_ranges(self) -> list[tuple[int, int, object]]:
        """``(start, size, tag)`` of every free range, in address order (for tests and reports)."""
        return sorted((s, v[0], v[1]) for s, v in self._free.items())
