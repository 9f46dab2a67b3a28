"""Page-fault counters on a real GPU: exact driver counts for migrations whose
size is known, faults where the driver must fault, the cost of a counter, and
CUPTI as a lower bound of the driver.

Managed memory comes from CuPy directly (``cupy.cuda.malloc_managed``), the
host side is a NumPy view of the same pointer, and prefetches go through
``cuda.bindings`` because CuPy 14's wrapper cannot target the host on CUDA 13
(docs/faults.md). Never more than 64 MiB of managed memory at a time.
"""

import ctypes
import importlib.util
import statistics
import time

import numpy as np
import pytest

from cupy_memstrat import faults

#: the driver's fault counters count the whole device: other tests' managed memory would add to them
pytestmark = pytest.mark.gpu_exclusive

MiB = 1 << 20
N = 64 * MiB


def prefetch(ptr, size, where):
    """cudaMemPrefetchAsync to device ``where`` or to ``"host"``, on the legacy stream."""
    from cuda.bindings import runtime as cudart

    loc = cudart.cudaMemLocation()
    if where == "host":
        loc.type = cudart.cudaMemLocationType.cudaMemLocationTypeHost
        loc.id = 0
    else:
        loc.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
        loc.id = where
    fn = getattr(cudart, "cudaMemPrefetchAsync_v2", None) or cudart.cudaMemPrefetchAsync  # 12.x / 13.x bindings
    (err,) = fn(ptr, size, loc, 0, 0)
    assert err == cudart.cudaError_t.cudaSuccess, err


@pytest.fixture
def managed(cp):
    """64 MiB of managed memory, written on the CPU (so every page is
    populated and host-resident): (MemoryPointer, uint8 host view, float32
    CuPy array over it)."""
    mem = cp.cuda.malloc_managed(N)
    host = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(mem.ptr))
    host[:] = 0
    x = cp.ndarray((N // 4,), dtype=cp.float32, memptr=mem)
    w = cp.zeros(16, dtype=cp.float32)
    w += 1  # load the kernel that x += 1 uses, outside any count
    cp.cuda.runtime.deviceSynchronize()
    yield mem, host, x
    cp.cuda.runtime.deviceSynchronize()
    del x, host, mem


def test_this_machine_offers_the_driver_counters():
    a = faults.available()
    assert a["driver"] is None, a["driver"]
    assert faults.status().startswith("driver counters (exact")
    from cupy_memstrat.info import collect

    assert collect()["page_fault_counters"].startswith("driver counters (exact")


def test_prefetch_moves_exactly_the_buffer_without_faults(cp, managed):
    mem, _host, _x = managed
    with faults.count() as whole:
        with faults.count() as to_gpu:
            prefetch(mem.ptr, N, 0)
        with faults.count(device=0) as to_host:
            prefetch(mem.ptr, N, "host")
    assert to_gpu.source == "driver" and to_gpu.exact
    assert to_gpu.counts == faults.FaultCounts(0, 0, N, 0, "driver", True), str(to_gpu.counts)
    assert to_host.counts == faults.FaultCounts(0, 0, 0, N, "driver", True), str(to_host.counts)
    assert whole.counts == to_gpu.counts + to_host.counts


def test_a_kernel_on_host_resident_data_faults_once(cp, managed):
    _mem, _host, x = managed
    with faults.count() as first:
        x += 1
    with faults.count() as second:
        x += 1
    print(f"\nfirst pass over {N >> 20} MiB host-resident: {first.counts}\nsecond pass: {second.counts}")
    assert first.gpu_faults > 0
    assert first.bytes_htod >= N  # every page was on the host and the kernel touches all of them
    assert first.cpu_faults == 0 and first.bytes_dtoh == 0
    assert second.counts == faults.FaultCounts(0, 0, 0, 0, "driver", True), str(second.counts)
    assert float(x[:1024].sum()) == 2.0 * 1024


def test_a_cpu_write_to_device_resident_data_faults_on_the_cpu(cp, managed):
    mem, host, _x = managed
    prefetch(mem.ptr, N, 0)
    cp.cuda.runtime.deviceSynchronize()
    with faults.count() as c:
        host.view(np.float32)[:] = 5.0
    print(f"\nCPU write of {N >> 20} MiB device-resident: {c.counts}")
    assert c.cpu_faults > 0
    assert 0 < c.bytes_dtoh <= N
    assert c.gpu_faults == 0 and c.bytes_htod == 0


def test_a_counter_costs_little_beyond_the_synchronisation(cp, capsys):
    cp.cuda.runtime.deviceSynchronize()
    c = faults.FaultCounter()
    for _ in range(20):  # warm up
        c.start()
        c.stop()

    def median_us(fn, n=200):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    sync_only = median_us(cp.cuda.runtime.deviceSynchronize)
    start_stop = median_us(lambda: (c.start(), c.stop()))
    full = median_us(lambda: faults.FaultCounter().start().stop())
    with capsys.disabled():
        print(
            f"\nfault counter ({c.source}): start+stop {start_stop:.1f} us, "
            f"create+start+stop {full:.1f} us (median of 200; one idle deviceSynchronize {sync_only:.1f} us)"
        )
    assert start_stop < 2000 and full < 2000


@pytest.mark.skipif(importlib.util.find_spec("cupti") is None,
                    reason="cupti-python is not installed (pip install 'cupy-memstrat[cupti]')")
def test_cupti_is_a_lower_bound_of_the_driver(cp, capsys):
    # CUPTI sees only managed memory allocated after it was switched on
    # (measured: a counter started after the allocation counted nothing):
    # start the first CUPTI counter before allocating.
    cup = faults.FaultCounter(source="cupti")
    cup.start().stop()
    assert cup.source == "cupti" and cup.exact is False
    mem = cp.cuda.malloc_managed(N)
    host = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(mem.ptr))
    host[:] = 0
    x = cp.ndarray((N // 4,), dtype=cp.float32, memptr=mem)
    cp.cuda.runtime.deviceSynchronize()
    drv = faults.FaultCounter(source="driver")
    with drv, cup:  # CUPTI inside the driver counter: both see the same work
        prefetch(mem.ptr, N, 0)
        prefetch(mem.ptr, N, "host")
        x += 1  # fault-driven this time
    d, c = drv.counts, cup.counts
    with capsys.disabled():
        print(f"\ndriver: {d}\nCUPTI:  {c}")
    assert c.exact is False and c.source == "cupti"
    assert d.bytes_htod >= 2 * N and d.bytes_dtoh == N and d.gpu_faults > 0
    assert 0 < c.bytes_htod <= d.bytes_htod  # it saw the migrations, maybe not all of them
    assert 0 < c.gpu_faults <= d.gpu_faults
    assert 0 <= c.bytes_dtoh <= d.bytes_dtoh
    assert c.cpu_faults <= d.cpu_faults
    del x, host, mem
