"""The C allocation hot path (csrc/hotpath.c) on the GPU: built and used there,
equal to the Python one, and keeping CuPy's memory objects off the garbage
collector (which in CuPy 14.2 otherwise loses blocks freed in reference cycles)."""

import gc
import sys

import pytest

import cupy_memstrat
from cupy_memstrat.strategies import _support

STRATEGIES = ["device", "pool", "managed", "async", "pool:route=wrap"]


def test_the_c_hot_path_is_built_and_used_here(cp, monkeypatch):
    monkeypatch.delenv(_support.HOT_PATH_ENV, raising=False)
    assert cupy_memstrat.hot_path_status()["hot_path"] == "c", _support.C_MISSING
    for name in ("device", "pool", "managed"):
        s = cupy_memstrat.use(name)
        x = cp.arange(1000, dtype=cp.float32)
        assert s.hot_path == "c" and float(x.sum()) == 499500.0
        # pool's default route hands CuPy its pool's own objects: no PythonFunctionAllocator to guard
        assert type(cp.cuda.get_allocator()).__name__ == ("PoolDirect" if name == "pool" else "GcSafeMalloc")
        assert cupy_memstrat.current() is s
        del x


@pytest.mark.parametrize("hot_path", ["c", "python"])
@pytest.mark.parametrize("name", ["device", "managed"])
def test_both_hot_paths_count_the_same_on_the_gpu(cp, monkeypatch, hot_path, name):
    monkeypatch.setenv(_support.HOT_PATH_ENV, hot_path)
    s = cupy_memstrat.use(name)
    arrays = [cp.full(n, 2.0, dtype=cp.float64) for n in (1, 100, 10_000, 1_000_000)]  # 8 B .. 8 MB
    st = s.stats()
    assert s.hot_path == hot_path
    sizes = [8 * n for n in (1, 100, 10_000, 1_000_000)]
    if name == "managed":  # blocks as CuPy's pool reports them: 512-byte steps
        sizes = [-(-b // 512) * 512 for b in sizes]
    assert st.n_live == st.n_allocs == 4 and st.bytes_in_use == st.peak_bytes_in_use == sum(sizes)
    assert [float(a.sum()) for a in arrays] == [2.0, 200.0, 20_000.0, 2_000_000.0]  # temporaries too
    del arrays
    st = s.stats()
    assert st.n_live == 0 and st.bytes_in_use == 0 and st.n_allocs == st.n_frees > 4
    assert st.peak_bytes_in_use >= 8 * 1_010_101


class _Holder:
    pass


def _lost_in_cycles(cp, monkeypatch, name):
    """Blocks never freed, and destructor errors, after 100 arrays died in
    reference cycles made after their memory objects (so that the collector
    would clear the memory object first)."""
    s = cupy_memstrat.use(name)
    errors = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: errors.append(u.exc_value))
    gc.collect()
    base_live = s.stats().n_live
    gc.disable()
    try:
        for _ in range(100):
            mp = cp.cuda.alloc(4096)
            h = _Holder()
            h.me, h.mp = h, mp
            del mp, h
    finally:
        gc.enable()
    gc.collect()
    return s.stats().n_live - base_live, errors


@pytest.mark.parametrize("name", STRATEGIES)
def test_arrays_dying_in_reference_cycles_are_freed(cp, monkeypatch, name):
    monkeypatch.delenv(_support.HOT_PATH_ENV, raising=False)
    assert _lost_in_cycles(cp, monkeypatch, name) == (0, [])


def test_control_without_gc_safe_malloc_cupy_14_2_loses_them(cp, monkeypatch):
    """The control: CuPy's PythonFunctionAllocator.malloc as it is (the Python
    hot path does not wrap it) loses every block on CuPy 14.2, so the test
    above can fail."""
    if cp.__version__ != "14.2.0":
        pytest.skip(f"the control is for CuPy 14.2.0's behaviour; this is CuPy {cp.__version__}")
    monkeypatch.setenv(_support.HOT_PATH_ENV, "python")
    lost, errors = _lost_in_cycles(cp, monkeypatch, "device")
    assert lost == 100 and len(errors) == 100 and "NoneType" in str(errors[0])
