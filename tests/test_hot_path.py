"""The allocation hot path in C (csrc/hotpath.c) and its Python twin: which one
a strategy gets, and the C one's own checks. Every strategy test that uses the
``fake`` fixtures already runs on both (tests/conftest.py)."""

import gc

import pytest

import cupy_memstrat
from cupy_memstrat.strategies import _support
from cupy_memstrat.testing import FakeBackend

needs_c = pytest.mark.skipif(_support.c_hotpath is None, reason=_support.C_MISSING or "built")


@pytest.mark.parametrize("name", ["device", "managed"])
def test_python_hot_path_by_request(monkeypatch, name):
    monkeypatch.setenv(_support.HOT_PATH_ENV, " Python ")
    assert cupy_memstrat.hot_path_status()["hot_path"] == "python"
    s = cupy_memstrat.create(name, backend=FakeBackend())
    s.raw_free(s.raw_malloc(1000))
    assert s.hot_path == "python"


def _allocate_here(s, size):
    return s.raw_malloc(size)


@needs_c
@pytest.mark.parametrize("name", ["device", "managed", "async", "pool", "expandable", "device:check=all"])
@pytest.mark.parametrize("track", [True, 3])
def test_the_c_hot_path_records_origins_as_its_reference_model_does(monkeypatch, name, track):
    """track_origins on the C hot path: each live allocation's origin (the first frame, or N
    frames, outside CuPy and cupy_memstrat) is the one the Python reference model records for
    the same calls, and a freed block's origin goes with it."""
    got = {}
    for hot_path in ("c", "python"):
        monkeypatch.setenv(_support.HOT_PATH_ENV, hot_path)
        s = cupy_memstrat.create(name, backend=FakeBackend(), track_origins=track)
        ptrs = [_allocate_here(s, n) for n in (1000, 3 << 20)]
        s.raw_free(_allocate_here(s, 4096))
        rows = sorted((a.size, a.origin) for a in s.live_allocations())
        got[hot_path] = [(size, (o.filename, o.lineno, o.function, o.stack)) for size, o in rows]
        if name != "device:check=all":  # the checking layer's own hot path is Python
            assert s.hot_path == hot_path
        for ptr in ptrs:
            s.raw_free(ptr)
        assert s.live_allocations() == []
    assert got["c"] == got["python"]
    assert [o[2] for _, o in got["c"]] == ["_allocate_here", "_allocate_here"]
    assert all(bool(o[3]) == (track == 3) for _, o in got["c"])


def test_a_bad_hot_path_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_support.HOT_PATH_ENV, "fast")
    with pytest.raises(ValueError, match=r"CUPY_MEMSTRAT_HOT_PATH='fast': expected one of auto, c, python"):
        cupy_memstrat.hot_path_status()
    with pytest.raises(ValueError, match="CUPY_MEMSTRAT_HOT_PATH"):
        cupy_memstrat.create("device", backend=FakeBackend())  # refused before anything is made
    monkeypatch.setenv(_support.HOT_PATH_ENV, "auto")
    s = cupy_memstrat.create("device", backend=FakeBackend())
    monkeypatch.setenv(_support.HOT_PATH_ENV, "fast")  # changed after creation: the first allocation refuses
    with pytest.raises(ValueError, match="CUPY_MEMSTRAT_HOT_PATH"):
        s.raw_malloc(100)
    assert s.stats().n_allocs == 0
    monkeypatch.setenv(_support.HOT_PATH_ENV, "auto")
    s.raw_free(s.raw_malloc(100))  # the strategy still works once the setting is fixed
    assert s.stats().n_frees == 1


def test_asking_for_c_where_it_is_not_built_says_why(monkeypatch):
    monkeypatch.setattr(_support, "c_hotpath", None)
    monkeypatch.setattr(_support, "C_MISSING", "the C hot path (cupy_memstrat._hotpath) is not built (test)")
    monkeypatch.setenv(_support.HOT_PATH_ENV, "c")
    with pytest.raises(ValueError, match=r"CUPY_MEMSTRAT_HOT_PATH=c: the C hot path .* is not built"):
        cupy_memstrat.hot_path_status()
    monkeypatch.setenv(_support.HOT_PATH_ENV, "auto")
    st = cupy_memstrat.hot_path_status()
    assert st["hot_path"] == "python" and "not built" in st["reason"]
    s = cupy_memstrat.create("device", backend=FakeBackend())
    s.raw_free(s.raw_malloc(100))
    assert s.hot_path == "python"


def test_info_reports_the_hot_path(monkeypatch):
    from cupy_memstrat.info import collect, format_report

    monkeypatch.setenv(_support.HOT_PATH_ENV, "python")
    report = collect(backend=FakeBackend())
    assert report["hot_path"]["hot_path"] == "python"
    assert "allocation hot path: python: CUPY_MEMSTRAT_HOT_PATH=python" in format_report(report)
    monkeypatch.setenv(_support.HOT_PATH_ENV, "fast")
    assert ("allocation hot path: error: CUPY_MEMSTRAT_HOT_PATH='fast': expected one of auto, c, python"
            in format_report(collect(backend=FakeBackend())))


@needs_c
def test_c_malloc_refuses_a_bad_device_before_allocating(monkeypatch):
    monkeypatch.delenv(_support.HOT_PATH_ENV, raising=False)
    fake = FakeBackend()
    s = cupy_memstrat.create("device", backend=fake)
    malloc, free = s.hot_path_functions()
    for bad in (1, -1, "0", None):
        with pytest.raises(ValueError, match=rf"malloc: device {bad!r} is not a device ordinal in range\(1\)"):
            malloc(100, bad)
    assert fake.n_malloc_calls == 0 and s.stats().n_allocs == 0
    with pytest.raises(TypeError, match="malloc\\(size, device\\) takes 2 arguments, got 1"):
        malloc(100)
    p = malloc(100, 0)
    free(p, 7)  # a wrong device hint: found by its pointer
    assert s.stats().n_frees == 1 and fake.used_bytes(0) == 0


@needs_c
def test_c_accounting_checks_its_tables():
    A = _support.c_hotpath.Accounting
    ok = dict(unknown_free=print, failed=print, error=RuntimeError,
              recorded={}, defer=print, pending=[], poll=print, watch=[None])
    with pytest.raises(TypeError, match="recorded, defer, pending, poll and watch are required"):
        A([{}], allocate=print, deallocate=print, dealloc_failed=print,
          **{k: v for k, v in ok.items() if k != "watch"})
    with pytest.raises(TypeError, match="watch a 1-item list"):
        A([{}], allocate=print, deallocate=print, dealloc_failed=print, **dict(ok, watch=[]))
    with pytest.raises(TypeError, match="capsule must hold a C function"):
        A([{}], arenas=[{}], owner={}, arena_of=print, chunk_bytes=1 << 21, stream_ptr=print, capsule=3,
          miss=print, **ok)
    with pytest.raises(TypeError, match="live must be a list with one dict per device"):
        A([], allocate=print, deallocate=print, dealloc_failed=print, **ok)
    with pytest.raises(TypeError, match=r"live\[0\] must be a dict"):
        A([[]], allocate=print, deallocate=print, dealloc_failed=print, **ok)
    with pytest.raises(TypeError, match="must be callables"):
        A([{}], allocate=print, deallocate=3, dealloc_failed=print, **ok)
    with pytest.raises(TypeError, match=r"arenas\[0\] must be a dict"):
        A([{}], arenas=[[]], owner={}, arena_of=print, chunk_bytes=1 << 21, stream_ptr=print, small_max=1024,
          miss=print, **ok)
    with pytest.raises(TypeError, match="error must be an exception class"):
        A([{}], allocate=print, deallocate=print, dealloc_failed=print, **dict(ok, error=3))


@needs_c
def test_gc_safe_malloc_keeps_the_memory_object_off_the_collector():
    class MemoryPointer:
        def __init__(self, mem):
            self.mem = mem

    class Allocator:
        def malloc(self, size):
            return MemoryPointer([size])  # a list: tracked by the collector

    a = Allocator()
    wrapped = _support.c_hotpath.GcSafeMalloc(a.malloc)
    mp = wrapped(512)
    assert mp.mem == [512] and not gc.is_tracked(mp.mem)
    assert wrapped.__self__ is a and wrapped.__wrapped__ == a.malloc
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(wrapped)
    try:
        assert cupy_memstrat.current() is None  # not a strategy's PythonFunctionAllocator
    finally:
        cupy.cuda.set_allocator(previous)
    with pytest.raises(TypeError, match="expected PythonFunctionAllocator.malloc"):
        _support.c_hotpath.GcSafeMalloc(3)


def test_the_fake_backend_knows_which_devices_have_a_context():
    fake = FakeBackend(devices=2)
    assert not fake.context_active(0) and not fake.context_active(1)
    fake.free(fake.malloc(100))
    assert fake.context_active(0) and not fake.context_active(1)
    fake.set_device(1)
    assert fake.context_active(1)


@needs_c
def test_c_accounting_refuses_a_small_max_out_of_range():
    f = print
    for bad in (-1, 1 << 41):
        with pytest.raises(ValueError, match=rf"small_max must be in \[0, 2\*\*40\], got {bad}"):
            _support.c_hotpath.Accounting([{}], f, f, RuntimeError, arenas=[{}], owner={}, arena_of=f,
                                       chunk_bytes=1 << 21,
                                       stream_ptr=f, small_max=bad, miss=f, recorded={}, defer=f, pending=[],
                                       poll=f, watch=[None])


@pytest.mark.parametrize("name", ["device", "managed"])
def test_tables_changed_behind_the_hot_paths_back_raise_instead_of_crashing(fake, name):
    """The C hot path checks the strategy's tables at every use (a crash
    would take the interpreter down)."""
    s = cupy_memstrat.create(name, backend=fake)
    s.raw_free(s.raw_malloc(8))
    s.accounts.live.clear()
    with pytest.raises((RuntimeError, IndexError)):
        s.raw_malloc(4096)


def test_a_pointer_whose_comparison_swaps_the_live_table_does_not_crash(fake):
    s = cupy_memstrat.create("device", backend=fake)
    malloc, free = s.hot_path_functions()
    p = malloc(100, 0)

    class Evil(int):
        __hash__ = int.__hash__

        def __eq__(self, other):
            s.accounts.live[0] = {}
            gc.collect()
            return int(self) == other

    free(Evil(p), 0)
    assert s.stats().n_frees == 1


def test_a_size_that_does_not_fit_is_the_same_error_on_both_hot_paths(fake):
    s = cupy_memstrat.create("managed", backend=fake, check="poison")
    with pytest.raises(ValueError, match="does not fit in size_t"):
        s.raw_malloc(2**64 - 1)


def test_an_int_subclass_size_is_counted_as_a_plain_int(fake):
    class Odd(int):
        def __neg__(self):
            return 0

    s = cupy_memstrat.create("device", backend=fake)
    s.raw_free(s.raw_malloc(Odd(4096)))
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0


def test_a_bad_hot_path_setting_is_refused_at_use_also_on_the_fake(monkeypatch, restore_cupy_allocator):
    cupy = restore_cupy_allocator
    before = cupy.cuda.get_allocator()
    monkeypatch.setenv(_support.HOT_PATH_ENV, "bogus")
    with pytest.raises(ValueError, match="CUPY_MEMSTRAT_HOT_PATH='bogus': expected one of auto, c, python"):
        cupy_memstrat.use("device", backend=FakeBackend(memory="1GiB"))
    assert cupy.cuda.get_allocator() is before  # nothing installed


@needs_c
@pytest.mark.parametrize("name", ["device", "managed", "async", "pool", "expandable"])
def test_both_hot_paths_count_a_random_sequence_alike(monkeypatch, name):
    """The C hot path keeps its counts in C and hands them over at each read; the
    Python one folds a list of events. The same random sequence of allocations,
    frees, reads and peak resets on two devices gives the same statistics after
    every step (peaks included), on each hot path."""
    import random

    runs = {}
    for hot_path in ("c", "python"):
        monkeypatch.setenv(_support.HOT_PATH_ENV, hot_path)
        fake = FakeBackend(devices=2, memory=["1GiB", "1GiB"])
        s = cupy_memstrat.create(name, backend=fake)
        rng, live, seen = random.Random(20261202), [], []
        for step in range(3000):
            r = rng.random()
            if r < 0.45 or not live:
                dev = rng.randrange(2)
                fake.set_device(dev)
                live.append((s.raw_malloc(rng.choice((1, 512, 4000, 1 << 20, 3 << 20))), dev))
            elif r < 0.9:
                ptr, dev = live.pop(rng.randrange(len(live)))
                s.raw_free(ptr)
            elif r < 0.97:
                seen.append([s.stats(d) for d in (0, 1)])
            else:
                s.reset_peak(rng.randrange(2))
        seen.append([s.stats(d) for d in (0, 1)])
        assert s.hot_path == hot_path
        runs[hot_path] = seen
        for ptr, _ in live:
            s.raw_free(ptr)
        assert all(s.stats(d).n_live == 0 and s.stats(d).bytes_in_use == 0 for d in (0, 1))
    assert runs["c"] == runs["python"]


@needs_c
def test_threads_making_a_strategys_first_allocations_at_once_build_one_hot_path():
    """Two C hot paths would each count on their own, and the peak drained from them
    one after the other would be wrong: a second thread arriving while the first
    builds waits for that build (it would reach the build within the wait here)."""
    import threading

    MiB = 1 << 20
    builders, entered, second = [], threading.Event(), threading.Event()

    class SlowToBuild(cupy_memstrat.DeviceStrategy):
        @property
        def allocate(self):  # the hook, read once: when the hot path is built
            builders.append(threading.get_ident())
            if len(builders) == 1:
                entered.set()
                second.wait(0.5)  # the other thread, if nothing stops it, is building too by now
            else:
                second.set()
            return super().allocate

    s = SlowToBuild(backend=FakeBackend())
    ptrs = []
    threads = [threading.Thread(target=lambda: ptrs.append(s.raw_malloc(MiB))) for _ in range(2)]
    threads[0].start()
    assert entered.wait(5)
    threads[1].start()
    for t in threads:
        t.join()
    assert len(builders) == 1 and s.accounts.n_drains == 1
    st = s.stats()
    assert st.n_allocs == 2 and st.bytes_in_use == st.peak_bytes_in_use == 2 * MiB
    for p in ptrs:
        s.raw_free(p)
