"""The managed strategy's slab on its own (no strategy, no CUDA): size classes, chunks cut into
slots, per-stream arenas, and what a destroyed stream's arena gives back. The chunks here are
plain numbers standing for CUDA's; only the quarantine's synchronisation asks a backend."""

import pytest

from cupy_memstrat.strategies.managed.slab import CHUNK_BYTES, SIZE_CLASSES, SMALL_MAX, Slab, class_index
from cupy_memstrat.strategies.stream_deaths import Quarantine
from cupy_memstrat.testing import FakeBackend

BASE = 0x7F00_0000_0000  # 2 MiB-aligned, as cudaMallocManaged returns


def _chunk(slab, key, ci, base=BASE, device=0):
    slab.add_chunk(device, base, CHUNK_BYTES, ci)
    return slab.carve(device, key, base, ci)


def test_size_classes_hold_every_small_size_in_the_smallest_class_that_fits():
    for size in (1, 511, 512, 513, 2047, 2049, 5000, 65536, 700_000, SMALL_MAX):
        ci = class_index(size)
        assert SIZE_CLASSES[ci] >= size and (ci == 0 or SIZE_CLASSES[ci - 1] < size)


def test_a_carved_chunk_gives_its_slots_lowest_address_first_to_its_streams_arena():
    slab = Slab(1)
    ci = class_index(1000)  # 1024-byte slots
    lst = _chunk(slab, key=7, ci=ci)
    n = CHUNK_BYTES // SIZE_CLASSES[ci]
    assert len(lst) == n - 1  # the first slot is the request's
    assert lst.pop() == BASE + SIZE_CLASSES[ci]
    assert slab.arena(0, 7)[0][ci] is lst and slab.arena(0, 8)[0][ci] == []  # another stream: its own
    assert slab.cached_bytes(0) == (n - 2) * SIZE_CLASSES[ci]


def test_a_freed_slot_goes_back_to_the_arena_it_came_from_whatever_stream_frees_it():
    slab = Slab(1)
    ci = class_index(1000)
    lst = _chunk(slab, key=7, ci=ci)
    slab.arena(0, 8)  # stream 8 exists too
    slab.give_back(BASE, 1000, 0)  # the request's slot, freed (say) while stream 8 is current
    assert lst[-1] == BASE and not slab.arena(0, 8)[0][ci]


def test_a_chunk_not_aligned_to_2_mib_is_found_by_its_base():
    slab = Slab(1)
    base = BASE + 4096  # CUDA did not align it
    ci = class_index(512)
    _chunk(slab, key=7, ci=ci, base=base)
    assert slab.arena_of(base + 512 * 10, 0) is slab.arenas[0][7]
    with pytest.raises(RuntimeError, match="lies in no chunk of this strategy on device 0"):
        slab.arena_of(BASE - 512, 0)


def test_a_destroyed_streams_free_chunks_become_spare_after_one_synchronisation():
    fake = FakeBackend()
    q, slab = Quarantine(fake, 1), Slab(1)
    ci = class_index(4096)
    whole = _chunk(slab, key=7, ci=ci)  # all its slots free once the first is given back
    slab.give_back(BASE, 4096, 0)
    partly = _chunk(slab, key=7, ci=ci, base=BASE + CHUNK_BYTES)  # its first slot stays live
    slab.add_chunk(0, BASE + 2 * CHUNK_BYTES, 2 * CHUNK_BYTES, -1)  # a run, free in the arena
    slab.own_run(0, 7, BASE + 2 * CHUNK_BYTES)
    slab.arena(0, 7)[1].setdefault(2 * CHUNK_BYTES, []).append(BASE + 2 * CHUNK_BYTES)
    assert whole is partly  # one list per class in an arena
    assert slab.stream_died(0, 7) and 7 not in slab.arenas[0]  # out of reach at once
    syncs = fake.n_device_synchronize_calls
    assert slab.reclaim(0, q) == CHUNK_BYTES + 2 * CHUNK_BYTES
    assert fake.n_device_synchronize_calls == syncs + 1
    assert slab.spare_small[0] == [BASE] and slab.spare_large[0] == {2 * CHUNK_BYTES: [BASE + 2 * CHUNK_BYTES]}
    assert len(partly) == CHUNK_BYTES // SIZE_CLASSES[ci] - 1  # the partly used chunk's slots stay
    assert slab.reclaim(0, q) == 0 and fake.n_device_synchronize_calls == syncs + 1  # nothing new: no wait
    assert slab.take_spare_chunk(0, class_index(100)) == BASE and slab.chunks[0][BASE] == (CHUNK_BYTES, 0)


def test_release_gives_back_free_chunks_down_to_what_is_kept_never_one_with_a_live_slot():
    slab = Slab(1)
    ci = class_index(100_000)
    _chunk(slab, key=7, ci=ci)  # its first slot live
    slab.add_chunk(0, BASE + CHUNK_BYTES, CHUNK_BYTES, ci)
    slab.spare_small[0].append(BASE + CHUNK_BYTES)
    freed = []

    def free_chunk(base):
        freed.append(base)
        slab.remove_chunk(0, base)

    assert slab.release(0, keep=1 << 40, free_chunk=free_chunk) == 0 and freed == []
    assert slab.release(0, keep=0, free_chunk=free_chunk) == CHUNK_BYTES
    assert freed == [BASE + CHUNK_BYTES] and list(slab.chunks[0]) == [BASE]
