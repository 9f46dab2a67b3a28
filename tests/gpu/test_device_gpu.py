"""The device strategy on the GPU, through real CuPy arrays."""

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat import InvalidFreeWarning
from helpers import run_threads


def test_arrays_compute_right_and_stats_are_exact(cp):
    s = cupy_memstrat.use("device")
    assert cupy_memstrat.current() is s
    x = cp.arange(1_000_000, dtype=cp.float64)  # 8 000 000 bytes
    st = s.stats()
    assert st.bytes_in_use == 8_000_000 and st.n_live == 1 and st.bytes_reserved == 8_000_000
    y = (x * 2).sum()
    assert float(y) == 2 * (999_999 * 1_000_000 / 2)
    del x, y
    gc.collect()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0 and st.n_allocs == st.n_frees
    assert st.peak_bytes_in_use >= 8_000_000


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_one_cuda_malloc_per_allocation_is_visible_in_mem_get_info(cp):
    s = cupy_memstrat.use("device")
    free0, _ = cp.cuda.runtime.memGetInfo()
    x = cp.empty(256 * 2**20, dtype=cp.uint8)
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert free0 - free1 >= 256 * 2**20  # no pool: the device lost the memory at once
    del x
    gc.collect()
    free2, _ = cp.cuda.runtime.memGetInfo()
    assert free2 >= free0 - 2 * 2**20  # and got it back at once (2 MiB driver granularity)
    assert s.stats().bytes_in_use == 0


def test_empty_arrays_work(cp):
    s = cupy_memstrat.use("device")
    e = cp.empty((0, 5), dtype=cp.float32)
    assert e.size == 0 and e.data.ptr == 0
    assert cp.concatenate([e, cp.ones((2, 5), cp.float32)]).shape == (2, 5)
    assert s.stats().n_failed == 0


def test_oom_is_clear_and_recoverable(cp):
    from cuda.bindings import runtime as crt

    s = cupy_memstrat.use("device")
    keep = cp.arange(1 << 20, dtype=cp.int32)
    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
        cp.empty(2 * total, dtype=cp.uint8)
    msg = str(info.value)
    assert f"out of memory allocating {cupy_memstrat.format_size(2 * total)}" in msg
    assert "in use in 1 allocation (" in msg and "CUDA reports" in msg
    assert info.value.requested == 2 * total
    assert s.stats().n_failed == 1
    # the existing array is intact, CUDA's last error is clear, the next allocation works
    assert int(keep[-1]) == (1 << 20) - 1 and int(keep.sum()) == sum(range(1 << 20))
    (err,) = crt.cudaPeekAtLastError()
    assert err == crt.cudaError_t.cudaSuccess
    z = cp.ones(1000)
    assert float(z.sum()) == 1000.0


def test_arrays_outlive_a_switch_and_are_freed_by_their_strategy(cp):
    a = cupy_memstrat.use("device")
    x = cp.full(1000, 7.0)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)  # back to CuPy's pool
    y = x + 1  # from CuPy's pool
    assert float(y[0]) == 8.0 and a.stats().n_live == 1
    del x
    gc.collect()
    assert a.stats().n_live == 0 and a.stats().n_frees == 1
    del y


def test_invalid_free_warns_and_does_not_crash(cp):
    s = cupy_memstrat.use("device")
    x = cp.ones(10)
    with pytest.warns(InvalidFreeWarning):
        s.raw_free(x.data.ptr + 8, 0)  # not a pointer it handed out
    assert s.stats().n_invalid_frees == 1 and float(x.sum()) == 10.0


def test_track_origins_names_the_callers_line(cp):
    cupy_memstrat.use("device", track_origins=True)
    x, line = cp.zeros(12345, dtype=cp.uint8), sys._getframe().f_lineno
    [row] = [r for r in cupy_memstrat.live_allocations() if r.ptr == x.data.ptr]
    assert row.origin.filename == __file__ and row.origin.lineno == line


def test_eight_threads_allocating_keep_counters_exact(cp):
    s = cupy_memstrat.use("device")
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                a = cp.empty(int(rng.integers(1, 1 << 20)), dtype=cp.uint8)
                a.fill(1)
                del a
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    run_threads(work, 8)
    gc.collect()
    assert not errors
    st = s.stats()
    assert st.n_allocs == st.n_frees == 8 * 200 and st.bytes_in_use == 0


def test_using_restores_cupys_pool(cp):
    before = cp.cuda.get_allocator()
    with pytest.raises(ZeroDivisionError):
        with cupy_memstrat.using("device") as s:
            x = cp.ones(100)
            assert s.stats().n_live == 1
            1 / 0
    assert cp.cuda.get_allocator() == before
    del x


def test_multi_device_allocates_on_current_and_frees_for_owner(cp, n_devices):
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    s = cupy_memstrat.use("device")
    with cp.cuda.Device(1):
        x = cp.ones(1 << 20, dtype=cp.uint8)
        assert x.device.id == 1
    assert s.stats(1).bytes_in_use == 1 << 20 and s.stats(0).bytes_in_use == 0
    with cp.cuda.Device(0):
        del x  # freed while device 0 is current
        gc.collect()
    assert s.stats(1).bytes_in_use == 0 and s.stats(1).n_frees == 1


def test_info_command_reports_the_device():
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "device 0: " in r.stdout and "memoryPoolsSupported" in r.stdout and "CUDA driver API" in r.stdout


def test_pytest_option_runs_a_session_under_the_strategy(pytester):
    pytester.makepyfile(
        """
        import cupy, cupy_memstrat
        def test_under_device():
            s = cupy_memstrat.current()
            assert s is not None and s.name == "device"
            x = cupy.ones(10)
            assert s.stats().n_live == 1
        """
    )
    r = pytester.runpytest_subprocess("--gpumem-strategy=device", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["gpumem: CuPy allocates with strategy 'device'*"])


def test_collector_freeing_arrays_during_allocations_does_not_hang(cp):
    """Python 3.12 runs the garbage collector at calls inside an allocation;
    CuPy then frees cyclic garbage arrays through the same strategy."""
    s = cupy_memstrat.use("device")
    done = threading.Event()

    def churn():
        old = gc.get_threshold()
        gc.set_threshold(1)
        try:
            for _ in range(3000):
                a = cp.empty(16)
                cycle = [a]
                cycle.append(cycle)
                del a, cycle
        finally:
            gc.set_threshold(*old)
            done.set()

    threading.Thread(target=churn, daemon=True).start()
    assert done.wait(120), "allocation deadlocked against a finaliser's free"
    gc.collect()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_allocs == st.n_frees == 3000
