"""The C allocation hot path (csrc/hotpath.c) on the GPU: built and used there,
equal to the Python one, and keeping CuPy's memory objects off the garbage
collector (which in CuPy 14.2 otherwise loses blocks freed in reference cycles)."""

import gc
import sys

import pytest

import cupy_memstrat
from cupy_memstrat.strategies import base

STRATEGIES = ["device", "pool", "managed", "async"]


def test_the_c_hot_path_is_built_and_used_here(cp, monkeypatch):
    monkeypatch.delenv(base.HOT_PATH_ENV, raising=False)
    assert cupy_memstrat.hot_path_status()["hot_path"] == "c", base._C_MISSING
    for name in ("device", "pool", "managed"):
        s = cupy_memstrat.use(name)
        x = cp.arange(1000, dtype=cp.float32)
        assert s.hot_path == "c" and float(x.sum()) == 499500.0
        assert type(cp.cuda.get_allocator()).__name__ == "GcSafeMalloc"
        assert cupy_memstrat.current() is s
        del x


@pytest.mark.parametrize("hot_path", ["c", "python"])
@pytest.mark.parametrize("name", ["device", "managed"])
def test_both_hot_paths_count_the_same_on_the_gpu(cp, monkeypatch, hot_path, name):
    monkeypatch.setenv(base.HOT_PATH_ENV, hot_path)
    s = cupy_memstrat.use(name)
    arrays = [cp.full(n, 2.0, dtype=cp.float64) for n in (1, 100, 10_000, 1_000_000)]  # 8 B .. 8 MB
    st = s.stats()
    assert s.hot_path == hot_path
    assert st.n_live == 4 and st.bytes_in_use == 8 * (1 + 100 + 10_000 + 1_000_000)
    assert [float(a.sum()) for a in arrays] == [2.0, 200.0, 20_000.0, 2_000_000.0]
    del arrays
    st = s.stats()
    assert st.n_live == 0 and st.bytes_in_use == 0 and st.n_allocs == st.n_frees == 4
    assert st.peak_bytes_in_use == 8 * 1_010_101


class _Holder:
    pass


@pytest.mark.parametrize("name", STRATEGIES)
def test_arrays_dying_in_reference_cycles_are_freed(cp, monkeypatch, name):
    """The memory object made first, the cycle after it: the collector would
    clear the memory object first (tools/probes/pfa_gc_clear.py: 100 of 100
    blocks lost under every strategy without GcSafeMalloc)."""
    monkeypatch.delenv(base.HOT_PATH_ENV, raising=False)
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
    assert errors == [] and s.stats().n_live == base_live
