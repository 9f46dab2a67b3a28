"""The pool strategy (CuPy's default MemoryPool, measured) on the GPU."""

import gc
import subprocess
import sys
import textwrap

import pytest

import cupy_memstrat
from helpers import run_threads

MiB = 1 << 20


@pytest.mark.parametrize("spec", ["pool", "pool:route=wrap"])
def test_arrays_compute_right_and_stats_are_exact(cp, spec):
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    s = cupy_memstrat.use(spec)
    assert cupy_memstrat.current() is s and s.name == "pool"
    x = cp.arange(1_000_000, dtype=cp.float64)  # 8 000 000 bytes
    st = s.stats()
    assert st.bytes_in_use == 8_000_000 and st.n_live == 1
    assert st.bytes_reserved == pool.total_bytes() >= 8_000_000
    assert float((x * 2).sum()) == 2 * (999_999 * 1_000_000 / 2)
    del x
    gc.collect()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0 and st.n_allocs == st.n_frees
    assert st.peak_bytes_in_use >= 8_000_000 and st.peak_bytes_reserved >= st.peak_bytes_in_use


@pytest.mark.parametrize("route", ["direct", "wrap"])
def test_a_memory_pool_of_the_programs_own_is_the_one_used_and_trimmed(cp, route):
    """memory_pool=: the blocks come from the program's MemoryPool, not CuPy's default one (the
    control: the default pool's bytes stay where they were)."""
    default = cp.get_default_memory_pool()
    default.free_all_blocks()
    default_total = default.total_bytes()
    mine = cp.cuda.MemoryPool()
    s = cupy_memstrat.use(cupy_memstrat.CuPyPoolStrategy(memory_pool=mine, route=route))
    assert s.route == route
    x = cp.arange(1_000_000, dtype=cp.float64)  # 8 000 000 bytes
    assert float(x.sum()) == 999_999 * 1_000_000 / 2
    assert mine.used_bytes() == 8_000_000 and default.total_bytes() == default_total
    st = s.stats()
    assert st.bytes_in_use == 8_000_000 and st.bytes_reserved == mine.total_bytes()
    del x
    gc.collect()
    cached = mine.total_bytes()
    assert mine.used_bytes() == 0 and s.stats().bytes_in_use == 0 and cached >= 8_000_000
    assert s.trim() == cached and mine.total_bytes() == 0


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
@pytest.mark.parametrize("spec", ["pool", "pool:route=wrap"])
def test_freed_arrays_go_back_to_cupys_pool_and_trim_frees_its_cache(cp, spec):
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    s = cupy_memstrat.use(spec)
    used0 = pool.used_bytes()
    x = cp.empty(64 * MiB, dtype=cp.uint8)
    assert pool.used_bytes() - used0 >= 64 * MiB
    ptr = x.data.ptr
    del x
    assert pool.used_bytes() == used0  # back in the pool ...
    assert pool.total_bytes() >= 64 * MiB  # ... which caches it
    y = cp.empty(64 * MiB, dtype=cp.uint8)
    assert y.data.ptr == ptr  # and hands the same block out again
    del y
    free0, _ = cp.cuda.runtime.memGetInfo()
    released = s.trim()
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert released >= 64 * MiB and pool.total_bytes() == pool.used_bytes()
    assert free1 - free0 >= 62 * MiB  # CUDA got it back
    assert s.stats().bytes_reserved == pool.total_bytes()


def test_route_direct_is_the_default_and_gives_cupy_the_pools_own_memory_object(cp):
    s = cupy_memstrat.use("pool:route=wrap")
    assert type(cp.empty(512, dtype=cp.uint8).data.mem).__name__ == "PythonFunctionAllocatorMemory"
    assert s.route == "wrap"
    s = cupy_memstrat.use("pool")
    assert s.config["route"] == "direct" and s.route == "direct"
    from cupy_memstrat.info import collect

    assert collect()["hot_path"]["pool_route"]["route"] == "direct"  # what info says a new pool takes
    x = cp.empty(3 * MiB, dtype=cp.uint8)
    assert type(x.data.mem).__name__ == "PooledMemory" and s.hot_path == "c"
    assert type(cp.cuda.get_allocator()).__name__ == "PoolDirect"
    assert cupy_memstrat.current() is s
    (a,) = [a for a in s.live_allocations() if a.ptr == x.data.ptr]
    assert a.size == 3 * MiB
    y = x[1:]  # a view: the same memory object, one block
    del x
    assert s.stats().bytes_in_use == 3 * MiB
    del y
    assert s.stats().bytes_in_use == 0


def test_route_direct_counts_exactly_under_threads(cp):
    """Eight threads allocate and free through CuPy's pool at once: every
    block counted, none left, none counted twice (the stale path)."""
    import random

    s = cupy_memstrat.use("pool:route=direct")
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            keep = []
            for _ in range(3000):
                keep.append(cp.empty(rng.choice((512, 4096, 1 << 20)), dtype=cp.uint8))
                if len(keep) > 8:
                    keep.pop(rng.randrange(len(keep)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_threads(work, 8)
    st = s.stats()
    assert not errors
    assert st.n_allocs == st.n_frees == 8 * 3000 and st.bytes_in_use == 0 and st.n_live == 0
    assert cp.cuda.get_allocator().generations == {}


def test_live_allocations_and_origins(cp):
    s = cupy_memstrat.use("pool:track_origins=true")
    x = cp.empty(3 * MiB, dtype=cp.uint8)
    (a,) = [a for a in s.live_allocations() if a.size == 3 * MiB]
    assert a.ptr == x.data.ptr and a.origin.function == "test_live_allocations_and_origins"
    assert s.live_sizes()[x.data.ptr] == 3 * MiB


@pytest.mark.parametrize("spec", ["pool", "pool:route=wrap"])
def test_out_of_memory_is_ours_and_counted(cp, spec):
    s = cupy_memstrat.use(spec)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="pool strategy: out of memory allocating"):
        cp.empty(1 << 50, dtype=cp.uint8)
    assert s.stats().n_failed == 1
    x = cp.ones(MiB, dtype=cp.uint8)  # still usable
    assert int(x.sum()) == MiB


def test_measuring_the_pool_creates_no_context_on_an_unused_device(n_devices):
    """pytest_gpumem reads every device's statistics for every test. Reading
    CuPy's pool total on a device made it current, which created a CUDA
    context there in each process (1.9 s per pytest-xdist worker on an H200
    pair, and device memory). A fresh process shows it."""
    if n_devices < 2:
        pytest.skip("needs two devices")
    code = textwrap.dedent(
        """
        import cupy, cupy_memstrat
        s = cupy_memstrat.use("pool")
        x = cupy.arange(10)
        b = s.backend
        assert b.context_active(0) and not b.context_active(1)
        st = s.stats(1); s.reset_peak(1); s.trim(); s.trim(device=1)
        assert st.bytes_reserved == 0 and st.n_allocs == 0
        assert not b.context_active(1), "reading device 1's statistics created a context there"
        with cupy.cuda.Device(1):
            y = cupy.arange(10)
        assert b.context_active(1) and s.stats(1).bytes_reserved > 0
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
