"""cupy_memstrat.numba, numba-cuda's External Memory Management plugin, without a GPU.

numba-cuda imports without a GPU (``numba.cuda.is_available()`` is False), so
the manager class is Numba's real one: its pointers (``AutoFreePointer``,
``OwnedPointer``, ``view``), its host-side state and ``set_memory_manager``
run for real. The manager is made as numba-cuda makes it, with a ``context``
keyword; ``context=None`` (what ``set_memory_manager`` passes) stands for the
context a GPU would give, and the memory comes from FakeBackend through the
strategy CuPy allocates with. ``DeviceNDArray``, kernels and IPC need a CUDA
driver: tests/gpu/test_numba_gpu.py runs those.
"""

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

import cupy_memstrat
from cupy_memstrat import NoStrategyError

MiB = 1 << 20


def _numba():
    return pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install numba-cuda)")


@pytest.fixture
def mm(restore_cupy_allocator):
    """A fresh manager as Numba makes one per context; CuPy's allocator put back afterwards."""
    _numba()
    from cupy_memstrat.numba import MemstratNumbaManager

    return MemstratNumbaManager(context=None)


def _ptr(mem) -> int:
    return int(mem.device_pointer_value or 0)


# -- the interface Numba checks --------------------------------------------------------------------------


def test_numba_accepts_the_module_named_by_the_environment_variable():
    """What numba-cuda does with NUMBA_CUDA_MEMORY_MANAGER: import the module, take its
    _numba_memory_manager and pass it to set_memory_manager, which instantiates it with
    context=None and refuses an interface_version other than 1 (numba-cuda's driver.py)."""
    _numba()
    code = textwrap.dedent("""
        import importlib, os
        from numba import cuda
        mod = importlib.import_module(os.environ["NUMBA_CUDA_MEMORY_MANAGER"])
        cls = mod._numba_memory_manager
        cuda.set_memory_manager(cls)
        assert issubclass(cls, cuda.HostOnlyCUDAMemoryManager), cls.__mro__
        assert issubclass(cls, cuda.BaseCUDAMemoryManager)
        m = cls(context=None)
        m.initialize(); m.initialize()      # called at every context push: harmless, touches no CUDA
        m.reset()                           # may come before any allocation
        print("OK", cls.__module__, cls.__name__, m.interface_version)
    """)
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="cupy_memstrat.numba")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OK", "cupy_memstrat.numba", "MemstratNumbaManager", "1"]


def test_without_numba_the_import_names_the_package_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["numba"] = None          # as if numba were not installed
        import cupy_memstrat
        from cupy_memstrat import MemstratError
        try:
            import cupy_memstrat.numba
        except ImportError as exc:
            assert isinstance(exc, MemstratError), type(exc).__mro__
            print(type(exc).__name__, "|", exc)
        else:
            raise SystemExit("imported without numba")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("NumbaNotInstalledError | ")
    assert "pip install numba-cuda" in r.stdout


# -- allocations reach the strategy -------------------------------------------------------------------


def test_an_allocation_is_the_strategys_and_its_free_returns(mm, fake):
    s = cupy_memstrat.use("device", backend=fake)
    mem = mm.memalloc(3 * MiB)
    ptr = _ptr(mem)
    assert mem.size == 3 * MiB and fake.is_allocated(ptr)
    st = cupy_memstrat.stats()
    assert st.bytes_in_use == 3 * MiB and st.n_live == 1 and st.n_allocs == 1
    assert [(a.ptr, a.size, a.device) for a in cupy_memstrat.live_allocations()] == [(ptr, 3 * MiB, 0)]
    del mem
    gc.collect()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0 and st.n_frees == 1 and st.n_invalid_frees == 0
    assert not fake.is_allocated(ptr)


@pytest.mark.parametrize("name", ["device", "managed", "async", "pool"])
def test_each_strategy_serves_numba(mm, fake, name):
    s = cupy_memstrat.use(name, backend=fake)
    mems = [mm.memalloc(n) for n in (1000, MiB, 5 * MiB)]
    assert len({_ptr(m) for m in mems}) == 3
    st = s.stats()
    assert st.n_live == 3 and st.bytes_in_use == 1000 + MiB + 5 * MiB
    del mems
    gc.collect()
    assert s.stats().n_live == 0 and s.stats().bytes_in_use == 0


def test_a_view_keeps_the_block_alive_until_the_last_reference_goes(mm, fake):
    """A slice of a Numba array holds a view of its pointer (MemoryPointer.view, what
    DeviceNDArray.__getitem__ calls): the block must outlive the base array."""
    s = cupy_memstrat.use("device", backend=fake)
    mem = mm.memalloc(4096)
    base = _ptr(mem)
    view = mem.view(1024, 2048)
    assert _ptr(view) == base + 1024 and view.size == 1024
    del mem
    gc.collect()
    assert s.stats().n_live == 1 and fake.is_allocated(base)  # the view still uses it
    del view
    gc.collect()
    assert s.stats().n_live == 0 and not fake.is_allocated(base)


def test_the_free_goes_to_the_allocating_strategy_after_a_switch(mm, fake):
    a = cupy_memstrat.use("device", backend=fake)
    mem = mm.memalloc(MiB)
    b = cupy_memstrat.use("async", backend=fake)
    other = mm.memalloc(2 * MiB)  # now from b
    assert a.stats().n_live == 1 and b.stats().n_live == 1
    del mem
    gc.collect()
    assert a.stats().n_frees == 1 and a.stats().n_live == 0
    assert b.stats().n_frees == 0 and b.stats().n_live == 1 and b.stats().n_invalid_frees == 0
    del other
    gc.collect()
    assert b.stats().n_live == 0


def test_using_in_one_thread_is_that_threads_strategy(mm, fake):
    glob = cupy_memstrat.use("device", backend=fake)
    seen = {}

    def worker():
        with cupy_memstrat.using("managed", backend=fake) as t:
            seen["mem"] = mm.memalloc(MiB)
            seen["strategy"] = t
            seen["in_use"] = t.stats().bytes_in_use

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    t = seen["strategy"]
    assert seen["in_use"] == MiB and glob.stats().n_allocs == 0
    # the block outlives the using() block: its strategy stays open and frees it later
    assert t.stats().n_live == 1
    del seen["mem"]
    gc.collect()
    assert t.stats().n_live == 0 and t.stats().n_frees == 1 and glob.stats().n_frees == 0


def test_origins_name_the_caller_not_cupy_memstrat(mm, fake):
    cupy_memstrat.use("device", backend=fake, track_origins=True)
    mem = mm.memalloc(512)  # the line below the test's def: the caller of memalloc
    (a,) = cupy_memstrat.live_allocations()
    assert a.origin is not None and a.origin.filename == __file__ and a.ptr == _ptr(mem)


# -- refused requests change nothing -----------------------------------------------------------------


@pytest.mark.parametrize("bad, exc, shown", [
    (-1, ValueError, "got -1"),
    (-(2**70), ValueError, f"got {-(2**70)}"),
    (2**64, ValueError, f"{2**64} bytes does not fit in size_t"),
    (1.5, TypeError, "got float 1.5"),
    (True, TypeError, "got bool True"),
    ("4096", TypeError, "got str '4096'"),
    (None, TypeError, "got NoneType None"),
])
def test_bad_sizes_are_refused_naming_the_value_and_nothing_changes(mm, fake, bad, exc, shown):
    s = cupy_memstrat.use("device", backend=fake)
    keep = mm.memalloc(1000)
    before = s.stats()
    with pytest.raises(exc, match="cupy_memstrat.numba: memalloc: size: ") as info:
        mm.memalloc(bad)
    assert shown in str(info.value)
    after = s.stats()
    assert (after.n_allocs, after.n_live, after.bytes_in_use, after.n_failed) == (
        before.n_allocs, before.n_live, before.bytes_in_use, before.n_failed)
    assert fake.n_malloc_calls == 1 and fake.is_allocated(_ptr(keep))


def test_a_numpy_integer_size_is_taken(mm, fake):
    np = pytest.importorskip("numpy")
    s = cupy_memstrat.use("device", backend=fake)
    mem = mm.memalloc(np.int64(2048))
    assert mem.size == 2048 and s.stats().bytes_in_use == 2048


def test_zero_bytes_is_a_null_pointer_and_allocates_nothing(mm, fake):
    s = cupy_memstrat.use("device", backend=fake)
    mem = mm.memalloc(0)
    assert mem.size == 0 and _ptr(mem) == 0
    assert fake.n_malloc_calls == 0 and s.stats().n_allocs == 0
    del mem
    gc.collect()
    assert s.stats().n_frees == 0 and s.stats().n_invalid_frees == 0


def test_no_strategy_installed_is_a_clear_error(mm, fake, monkeypatch):
    monkeypatch.delenv("CUPY_MEMSTRAT", raising=False)
    assert cupy_memstrat.current() is None  # CuPy's own pool
    with pytest.raises(NoStrategyError) as info:
        mm.memalloc(MiB)
    msg = str(info.value)
    assert "Numba asked for 1.0 MiB (1,048,576 bytes)" in msg
    assert "no cupy_memstrat strategy is installed in this thread" in msg
    assert "cupy_memstrat.use('pool')" in msg and "use_from_env()" in msg and "NUMBA_CUDA_MEMORY_MANAGER" in msg
    assert "is set, but" not in msg
    assert fake.n_malloc_calls == 0
    # CUPY_MEMSTRAT in the environment is not installed behind the program's back, and the message says so
    monkeypatch.setenv("CUPY_MEMSTRAT", "async")
    with pytest.raises(NoStrategyError, match=r"CUPY_MEMSTRAT='async' is set, but is read only by"):
        mm.memalloc(MiB)
    assert cupy_memstrat.current() is None and fake.n_malloc_calls == 0
    # once the program installs one, the same manager allocates through it
    s = cupy_memstrat.use(os.environ["CUPY_MEMSTRAT"], backend=fake)
    mem = mm.memalloc(MiB)
    assert s.stats().bytes_in_use == MiB and mem.size == MiB and fake.n_malloc_calls == 1


def test_out_of_memory_is_both_cupy_memstrats_and_numbas_error(mm, fake):
    from numba.cuda.cudadrv.driver import CudaAPIError, binding

    s = cupy_memstrat.use("device", backend=fake)  # 1 GiB
    keep = mm.memalloc(600 * MiB)
    with pytest.raises(CudaAPIError) as info:
        mm.memalloc(600 * MiB)
    e = info.value
    assert e.code == binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY  # what Numba's own manager raises
    assert isinstance(e, cupy_memstrat.OutOfMemoryError) and isinstance(e, MemoryError)
    import cupy

    assert isinstance(e, cupy.cuda.memory.OutOfMemoryError)
    assert e.requested == 600 * MiB and e.device == 0 and e.strategy == "device"
    assert str(e).startswith("device strategy: out of memory allocating 600.0 MiB (629,145,600 bytes) on device 0")
    assert "this strategy holds 600.0 MiB in use in 1 allocation" in str(e)
    assert s.stats().n_failed == 1 and s.stats().n_live == 1 and fake.is_allocated(_ptr(keep))
    assert fake.peek_last_error() == 0  # no sticky CUDA error left behind
    again = pickle.loads(pickle.dumps(e))  # e.g. from a Dask worker
    assert type(again) is type(e) and again.code == e.code and str(again) == str(e) and again.requested == e.requested
    mem = mm.memalloc(100 * MiB)  # the next one that fits works
    assert mem.size == 100 * MiB


# -- defer_cleanup, reset ---------------------------------------------------------------------------------


def test_defer_cleanup_holds_frees_until_the_outermost_block_ends(mm, fake):
    s = cupy_memstrat.use("device", backend=fake)
    a, b = mm.memalloc(MiB), mm.memalloc(2 * MiB)
    pa, pb = _ptr(a), _ptr(b)
    with mm.defer_cleanup():
        assert mm.deallocations.is_disabled  # host-side cleanup deferred too (HostOnlyCUDAMemoryManager)
        with mm.defer_cleanup():
            del a
            gc.collect()
        assert s.stats().n_live == 2 and fake.is_allocated(pa)  # still inside the outer block
        del b
        gc.collect()
        c = mm.memalloc(4096)  # allocations go on as usual
        assert s.stats().bytes_in_use == 3 * MiB + 4096
    assert not mm.deallocations.is_disabled
    assert s.stats().n_live == 1 and s.stats().bytes_in_use == 4096
    assert not fake.is_allocated(pa) and not fake.is_allocated(pb)
    del c
    gc.collect()
    assert s.stats().n_live == 0 and s.stats().n_invalid_frees == 0


def test_defer_cleanup_ends_also_when_its_body_raises(mm, fake):
    s = cupy_memstrat.use("device", backend=fake)
    a = mm.memalloc(MiB)
    with pytest.raises(KeyError):
        with mm.defer_cleanup():
            del a
            gc.collect()
            raise KeyError("boom")
    assert s.stats().n_live == 0 and not mm.deallocations.is_disabled


def test_reset_frees_every_live_block_once(mm, fake):
    s = cupy_memstrat.use("device", backend=fake)
    a, b = mm.memalloc(MiB), mm.memalloc(2 * MiB)
    view = a.view(16)
    pa = _ptr(a)
    with mm.defer_cleanup():
        c = mm.memalloc(4096)
        del c
        gc.collect()  # deferred: still live
        assert s.stats().n_live == 3
        mm.reset()  # numba.cuda.close(): everything of the context goes
        assert s.stats().n_live == 0 and not fake.is_allocated(pa)
    fresh = mm.memalloc(MiB)  # the strategy may hand the same address out again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an InvalidFreeWarning (a second free) would raise here
        del a, b, view
        gc.collect()
    st = s.stats()
    assert st.n_live == 1 and st.n_frees == 3 and st.n_invalid_frees == 0 and fake.is_allocated(_ptr(fresh))
    mm.reset()  # twice: harmless
    assert s.stats().n_live == 0


# -- memory info, IPC ------------------------------------------------------------------------------------


def test_memory_info_is_the_devices_free_and_total(mm, fake):
    cupy_memstrat.use("device", backend=fake)
    info0 = mm.get_memory_info()
    assert info0.total == 1 << 30 and info0.free == 1 << 30
    mem = mm.memalloc(256 * MiB)
    info1 = mm.get_memory_info()
    assert info1.total == 1 << 30 and info1.free == info0.free - 256 * MiB
    assert (info1.free, info1.total) == fake.mem_get_info(0)
    del mem


def test_managed_memory_cannot_be_exported_and_the_error_names_the_strategy(mm, fake):
    from cupy_memstrat.numba import IpcExportError

    cupy_memstrat.use("managed", backend=fake)
    mem = mm.memalloc(MiB)
    with pytest.raises(IpcExportError, match=r"allocated by strategy 'managed' as managed memory") as info:
        mm.get_ipc_handle(mem)
    assert info.value.strategy == "managed" and isinstance(info.value, cupy_memstrat.MemstratError)
    with pytest.raises(IpcExportError, match="'managed'"):
        mm.get_ipc_handle(mem.view(4096))  # a view: found by its address inside the block


# -- the pytest plugin sees Numba's allocations ----------------------------------------------------------


def test_the_plugin_reports_a_leaked_numba_allocation(pytester, fake_env):
    _numba()
    pytester.makepyfile(textwrap.dedent("""
        import gc
        from cupy_memstrat.numba import MemstratNumbaManager
        MiB = 1 << 20
        MM = MemstratNumbaManager(context=None)
        KEEP = []
        def test_leaks_a_numba_block():
            KEEP.append(MM.memalloc(3 * MiB))
        def test_frees_its_numba_block():
            mem = MM.memalloc(2 * MiB)
            del mem
    """))
    r = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--gpumem", "--gpumem-leaks=fail",
                                     "--gpumem-strategy=device")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*_ test_leaks_a_numba_block _*",
                            "leaked 1 allocation, 3.0 MiB > limit 0 B (--gpumem-leaks)*"])
    assert "test_frees_its_numba_block FAILED" not in r.stdout.str()
