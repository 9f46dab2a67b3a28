"""The 'pool' strategy (CuPy's default pool, measured) on the fake backend."""

import pytest

import cupy_memstrat
from cupy_memstrat import CuPyPoolStrategy

MiB = 1 << 20


def test_registered_with_alias_and_description():
    assert "pool" in cupy_memstrat.available()
    assert "CuPy's default MemoryPool" in cupy_memstrat.available()["pool"]
    assert cupy_memstrat.validate("cupy") == ("pool", {"track_origins": False, "oom_snapshot": None})


def test_same_stats_as_every_strategy(fake):
    s = cupy_memstrat.create("pool", backend=fake)
    assert isinstance(s, CuPyPoolStrategy)
    a = s.raw_malloc(3 * MiB)
    b = s.raw_malloc(1 * MiB)
    st = s.stats()
    assert (st.bytes_in_use, st.peak_bytes_in_use, st.n_allocs, st.n_live) == (4 * MiB, 4 * MiB, 2, 2)
    assert st.bytes_reserved == st.bytes_in_use  # no CuPy pool here: nothing cached
    s.raw_free(a)
    st = s.stats()
    assert (st.bytes_in_use, st.peak_bytes_in_use, st.n_frees) == (1 * MiB, 4 * MiB, 1)
    assert not fake.is_allocated(a) and fake.is_allocated(b)
    s.reset_peak()
    assert s.stats().peak_bytes_in_use == 1 * MiB
    assert [x.size for x in s.live_allocations()] == [1 * MiB]
    s.raw_free(b)
    assert s.trim() == 0 and s.stats().n_live == 0


def test_live_sizes_is_a_snapshot_in_allocation_order(fake2):
    s = cupy_memstrat.create("pool", backend=fake2)
    a = s.raw_malloc(100)
    fake2.set_device(1)
    b = s.raw_malloc(200)
    c = s.raw_malloc(300)
    fake2.set_device(0)
    snap = s.live_sizes()
    assert snap == {a: 100, b: 200, c: 300}
    assert s.live_sizes(1) == {b: 200, c: 300} and s.live_sizes(0) == {a: 100}
    s.raw_free(b)
    assert b in snap  # a copy
    d = s.raw_free(a) or s.raw_malloc(50)
    assert s.live_sizes().items() - snap.items() == {(d, 50)}
    with pytest.raises(ValueError):
        s.live_sizes(2)


def test_track_origins_and_oom(fake):
    s = cupy_memstrat.create("cupy:track_origins=true", backend=fake)
    p = s.raw_malloc(MiB)
    (a,) = s.live_allocations()
    assert a.origin is not None and a.origin.function == "test_track_origins_and_oom"
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="pool strategy: out of memory"):
        s.raw_malloc(2 << 30)
    assert s.stats().n_failed == 1
    s.raw_free(p)


def test_trim_checks_its_arguments(fake):
    s = cupy_memstrat.create("pool", backend=fake)
    assert s.trim("10%") == 0 and s.trim(0, device=0) == 0
    with pytest.raises(ValueError):
        s.trim("lots")
    with pytest.raises(ValueError):
        s.trim(device=3)


def test_as_cupy_allocator(fake, restore_cupy_allocator):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use(cupy_memstrat.create("pool", backend=fake))
    mp = cupy.cuda.alloc(3000)
    assert mp.mem.size == 3072  # rounded up to 512 B, as CuPy's own pool reports it
    assert s.stats().bytes_in_use == 3072
    del mp
    assert s.stats().bytes_in_use == 0
