"""use / using / current through CuPy's allocator switches, on the fake backend.

CuPy is imported (it imports without a GPU); its allocator functions are
called for real. Memory comes from FakeBackend.
"""

import gc
import sys
import threading
import weakref

import pytest

import cupy_memstrat
from cupy_memstrat import NoStrategyError

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")


@pytest.fixture(autouse=True)
def _restore(restore_cupy_allocator):
    yield


def test_use_installs_process_wide_and_returns_the_live_strategy(fake):
    s = cupy_memstrat.use("device", backend=fake)
    assert cupy_memstrat.current() is s
    seen = []
    t = threading.Thread(target=lambda: seen.append(cupy_memstrat.current()))
    t.start()
    t.join()
    assert seen == [s]  # process-wide: other threads see it too


def test_cupy_alloc_goes_through_the_strategy_and_frees_on_drop(fake):
    s = cupy_memstrat.use("device", backend=fake)
    mp = cupy.cuda.alloc(3000)
    assert fake.is_allocated(mp.ptr) and s.stats(0).bytes_in_use == 3000
    ptr = mp.ptr
    del mp
    gc.collect()
    assert not fake.is_allocated(ptr) and s.stats(0).n_frees == 1


def test_cupy_alloc_of_zero_bytes_is_null(fake):
    cupy_memstrat.use("device", backend=fake)
    mp = cupy.cuda.alloc(0)
    assert mp.ptr == 0 and fake.n_malloc_calls == 0


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (2.5, TypeError)])
def test_bad_sizes_through_the_cupy_allocator(fake, bad, exc):
    s = cupy_memstrat.use("device", backend=fake)
    keep = cupy.cuda.alloc(100)
    with pytest.raises(exc, match="size: expected"):
        s.malloc(bad)
    assert s.stats(0).n_live == 1 and fake.is_allocated(keep.ptr)


def test_arrays_stay_with_their_strategy_after_a_switch(fake):
    a = cupy_memstrat.use("device", backend=fake)
    mp = cupy.cuda.alloc(1 << 20)
    b = cupy_memstrat.use("device", backend=fake)
    assert cupy_memstrat.current() is b
    mp2 = cupy.cuda.alloc(1 << 10)
    assert a.stats(0).n_live == 1 and b.stats(0).n_live == 1
    del mp
    gc.collect()
    assert a.stats(0).n_frees == 1 and b.stats(0).n_frees == 0
    del mp2


def test_using_is_per_thread_and_restores_on_exit_and_on_error(fake):
    outer = cupy_memstrat.use("device", backend=fake)
    seen_in_other_thread = []
    with pytest.raises(KeyError):
        with cupy_memstrat.using("device", backend=fake) as inner:
            assert cupy_memstrat.current() is inner
            t = threading.Thread(target=lambda: seen_in_other_thread.append(cupy_memstrat.current()))
            t.start()
            t.join()
            raise KeyError("boom")
    assert seen_in_other_thread == [outer]
    assert cupy_memstrat.current() is outer


def test_using_nests(fake):
    with cupy_memstrat.using("device", backend=fake) as a:
        with cupy_memstrat.using("device", backend=fake) as b:
            assert cupy_memstrat.current() is b
        assert cupy_memstrat.current() is a
    assert cupy_memstrat.current() is None  # CuPy's default pool again


def test_using_a_spec_gives_idle_memory_back_on_exit(fake):
    for _ in range(20):  # no pool piles up per block
        with cupy_memstrat.using("async", backend=fake):
            mp = cupy.cuda.alloc(4096)
            del mp
    assert fake.mem_get_info(0)[0] == 1 << 30
    with cupy_memstrat.using("async", backend=fake) as s:
        keep = cupy.cuda.alloc(64 << 20)
        cupy.cuda.alloc(1 << 20)  # dies at once: cached, then trimmed on exit
    assert s.pool_stats(0).cached_bytes == 0 and s.stats(0).n_live == 1
    del keep
    gc.collect()
    assert s.stats(0).n_live == 0


def test_using_leaves_a_strategy_object_alone(fake):
    s = cupy_memstrat.create("async", backend=fake)
    with cupy_memstrat.using(s):
        cupy.cuda.alloc(4096)
    assert s.pool_stats(0).cached_bytes == 4096 and s.pool_stats(0).handle


def test_use_inside_using_is_refused_and_installs_nothing(fake):
    with cupy_memstrat.using("device", backend=fake) as a:
        before = cupy.cuda.get_allocator()
        with pytest.raises(RuntimeError, match="forbids inside"):
            cupy_memstrat.use("device", backend=fake)
        assert cupy.cuda.get_allocator() == before
        assert cupy_memstrat.current() is a


def test_use_accepts_an_existing_strategy_but_no_options_with_it(fake):
    s = cupy_memstrat.create("device", backend=fake)
    assert cupy_memstrat.use(s) is s and cupy_memstrat.current() is s
    with pytest.raises(ValueError, match="options apply only when a strategy is created by name"):
        cupy_memstrat.use(s, track_origins=True)


def test_bad_spec_leaves_the_allocator_alone(fake):
    before = cupy.cuda.get_allocator()
    with pytest.raises(ValueError, match="unknown strategy"):
        cupy_memstrat.use("nope", backend=fake)
    assert cupy.cuda.get_allocator() == before


def test_module_level_views_follow_current(fake):
    with pytest.raises(NoStrategyError, match="no cupy_memstrat strategy is installed"):
        cupy_memstrat.stats()
    s = cupy_memstrat.use("device", backend=fake, track_origins=True)
    mp = cupy.cuda.alloc(4096)
    assert cupy_memstrat.stats().bytes_in_use == 4096
    [row] = cupy_memstrat.live_allocations()
    assert row.size == 4096 and row.origin.filename == __file__
    cupy_memstrat.reset_peak()
    del mp
    gc.collect()
    assert s.stats().peak_bytes_in_use == 4096 and s.stats().bytes_in_use == 0


def test_reset_peak_at_module_level_takes_reserved_and_refuses_a_non_bool(fake):
    s = cupy_memstrat.use("managed", backend=fake)
    a = s.raw_malloc(4 << 20)
    s.raw_free(s.raw_malloc(8 << 20))
    before = s.stats()
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=f"reset_peak: reserved must be True or False, got {bad!r}"):
            cupy_memstrat.reset_peak(reserved=bad)
        assert s.stats() == before  # nothing reset
    cupy_memstrat.reset_peak(reserved=False)
    st = s.stats()
    assert st.peak_bytes_in_use == 4 << 20 and st.peak_bytes_reserved == before.peak_bytes_reserved
    cupy_memstrat.reset_peak()
    assert s.stats().peak_bytes_reserved == s.stats().bytes_reserved
    s.raw_free(a)


def test_a_finaliser_freeing_in_the_middle_of_an_allocation_neither_deadlocks_nor_miscounts(fake):
    """CuPy frees from finalisers, which the garbage collector can run at any
    call inside an allocation on the same thread (a lock there hung CuPy's
    test suite on the H200). A profile hook injects such a free at every C
    call that the allocation path makes."""
    s = cupy_memstrat.create("device", backend=fake)
    victims = [s.raw_malloc(100, 0) for _ in range(200)]
    malloc = s.hot_path_functions()[0]  # the hot path CuPy calls
    # At every C call of the Python hot path; the C hot path runs no Python code
    # of its own, so there at the call of the backend's malloc it makes.
    code, event_at = (malloc.__code__, "c_call") if s.hot_path == "python" else (type(fake).malloc.__code__, "call")
    injected = []

    def finaliser_at_c_calls(frame, event, arg):
        if event == event_at and frame.f_code is code and victims:
            injected.append(victims[-1])
            s.raw_free(victims.pop(), 0)

    done = threading.Event()

    def churn():
        sys.setprofile(finaliser_at_c_calls)
        try:
            for _ in range(100):
                s.raw_free(s.raw_malloc(256, 0), 0)
        finally:
            sys.setprofile(None)
            done.set()

    threading.Thread(target=churn, daemon=True).start()
    assert done.wait(30), "an allocation deadlocked against a free from a finaliser"
    assert injected, "the hook never ran inside the allocation"
    for p in victims:
        s.raw_free(p, 0)
    st = s.stats(0)
    assert st.n_allocs == st.n_frees == 300 and st.bytes_in_use == 0 and fake.used_bytes(0) == 0


def test_a_strategy_that_allocated_stays_alive_until_closed(fake):
    """CuPy frees through the strategy from finalisers. Seen on the H200: a
    test's traceback cycle held a strategy and its arrays, the collector
    cleared the strategy first, and the frees then failed. So a strategy that
    has handed out memory is kept alive by cupy_memstrat until close()."""
    s = cupy_memstrat.create("device", backend=fake)
    ref = weakref.ref(s)
    s.raw_free(s.raw_malloc(4096, 0), 0)
    del s
    gc.collect()
    assert ref() is not None
    ref().close()
    gc.collect()
    assert ref() is None


def test_a_strategy_that_never_allocated_is_not_kept(fake):
    ref = weakref.ref(cupy_memstrat.create("device", backend=fake))
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("name", ["device", "managed", "async", "pool"])
def test_in_use_and_a_reset_of_the_peak_in_use_alone(fake, name):
    """What a per-task hook reads (the Dask plugin): in use and its peak as stats() has
    them; reset_peak(reserved=False) leaves the peak reserved as it was."""
    s = cupy_memstrat.create(name, backend=fake)
    a, b = s.raw_malloc(3 << 20), s.raw_malloc(1 << 20)
    s.raw_free(a)
    st = s.stats(0)
    assert s.in_use(0) == (st.bytes_in_use, st.peak_bytes_in_use) == (1 << 20, 4 << 20)
    s.reset_peak(0, reserved=False)
    after = s.stats(0)
    assert s.in_use(0) == (1 << 20, 1 << 20)
    if not s.reserved_is_in_use:  # device (and pool on the fake) reserve what is in use, no more
        assert after.peak_bytes_reserved == st.peak_bytes_reserved
    s.reset_peak(0)
    assert s.stats(0).peak_bytes_reserved == s.stats(0).bytes_reserved
    s.raw_free(b)
    with pytest.raises(ValueError, match="device: expected 0 <= device < 1, got 3"):
        s.in_use(3)


@pytest.mark.parametrize("spec", ["device", "managed", "async", "pool", "async:check=all"])
def test_a_strategy_refuses_pickle_and_copy_saying_what_to_send_instead(fake, spec):
    import copy
    import pickle

    s = cupy_memstrat.create(spec, backend=fake)
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be pickled or copied: it holds CUDA memory.*spec string"):
            attempt(s)
    s.close()


def test_prefetch_and_advise_use_the_backend_of_the_strategy_in_use(fake):
    """A strategy made with backend= keeps it: prefetch() and advise() without backend= act on that
    one (they asked the process's real backend, which raised NoDeviceError without a GPU)."""
    cupy_memstrat.use("managed", backend=fake)
    x = cupy.empty(4 << 20, dtype=cupy.uint8)
    cupy_memstrat.advise(x, preferred_location="device")
    before = fake.n_prefetch_calls
    cupy_memstrat.prefetch(x, to="host")
    cupy_memstrat.prefetch(x)
    assert fake.n_prefetch_calls == before + 2


def test_installs_lists_what_use_and_using_installed_since_a_mark(fake):
    mark = cupy_memstrat.install_mark()
    assert cupy_memstrat.installs(since=mark) == []
    cupy_memstrat.use("device", backend=fake)
    with cupy_memstrat.using("async", backend=fake, check="redzone"):
        pass
    got = cupy_memstrat.installs(since=mark)
    assert [(i.name, i.checked, i.how, i.thread) for i in got] == [
        ("device", False, "use", threading.get_ident()), ("async", True, "using", threading.get_ident())]
    assert got[0].seq < got[1].seq == cupy_memstrat.install_mark()
    assert cupy_memstrat.installs(since=got[0].seq) == got[1:]


def test_using_that_cupy_refuses_is_not_listed(fake):
    mark = cupy_memstrat.install_mark()
    with cupy_memstrat.using("device", backend=fake):
        with pytest.raises(RuntimeError, match="forbids"):
            cupy_memstrat.use("device", backend=fake)
    assert [i.how for i in cupy_memstrat.installs(since=mark)] == ["using"]


@pytest.mark.parametrize("bad", [None, 1.5, True, "3"])
def test_installs_refuses_a_since_that_is_not_a_mark(bad):
    with pytest.raises(TypeError, match=r"since: expected an int from install_mark\(\), got"):
        cupy_memstrat.installs(since=bad)


def test_owner_of_pointer_refuses_what_is_not_an_int_by_name():
    for ptr, device, what in ((1, None, "device: expected an int, got NoneType None"),
                              ("0x10", 0, "ptr: expected an int, got str '0x10'"), (1, True, "device")):
        with pytest.raises(TypeError, match=f"owner_of_pointer: {what}"):
            cupy_memstrat.Strategy.owner_of_pointer(ptr, device)
