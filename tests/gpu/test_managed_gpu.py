"""The ``managed`` strategy, prefetch() and advise() on a real GPU: chunking,
policies (read back with cudaMemRangeGetAttribute), explicit prefetch both
ways with exact driver counters, the oversubscription guard, trim, and the
rest of CuPy. Sizes stay far below the card's free memory."""

import ctypes
import warnings

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat.strategies.managed import CHUNK_BYTES

MiB = 1 << 20


def range_attr(ptr, nbytes, name):
    from cuda.bindings import runtime as cudart

    attr = getattr(cudart.cudaMemRangeAttribute, f"cudaMemRangeAttribute{name}")
    err, value = cudart.cudaMemRangeGetAttribute(4, attr, ptr, nbytes)
    assert int(err) == 0, err
    return int(value)


def host_view(ptr, nbytes):
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=np.float32)


def fault_counter():
    faults = pytest.importorskip("cupy_memstrat.faults")
    try:
        c = faults.FaultCounter(source="driver")
        c.start()
        c.stop()
    except faults.FaultCountersUnavailable as exc:
        pytest.skip(f"driver fault counters unavailable here: {exc}")
    return c


@pytest.fixture
def managed(cp):
    s = cupy_memstrat.use("managed")
    yield s
    cp.cuda.Device().synchronize()


def test_arrays_are_managed_memory_and_small_ones_share_chunks(cp, managed):
    xs = [cp.arange(100, dtype=cp.float32) for _ in range(1000)]  # 400 B each
    assert all(int(x.sum()) == 4950 for x in xs[:5])
    ms = managed.managed_stats()
    assert ms.n_chunks == 1  # a thousand small arrays, one 2 MiB chunk
    assert cp.cuda.runtime.pointerGetAttributes(xs[0].data.ptr).type == 3  # cudaMemoryTypeManaged
    big = cp.ones(3 * MiB, dtype=cp.uint8)
    assert big.data.ptr % CHUNK_BYTES == 0  # runs of chunks are 2 MiB aligned
    st = managed.stats()
    assert st.bytes_reserved == CHUNK_BYTES + 4 * MiB and st.n_live == 1001
    del xs, big
    assert managed.stats().n_live == 0 and managed.trim() == CHUNK_BYTES + 4 * MiB


def test_host_reads_results_without_a_copy(cp, managed):
    x = cp.arange(1 << 20, dtype=cp.float32)
    x *= 2
    cp.cuda.Device().synchronize()  # before the CPU touches managed memory
    h = host_view(x.data.ptr, x.nbytes)
    assert h[12345] == 24690.0 and h[-1] == 2.0 * ((1 << 20) - 1)


def test_advice_is_set_on_each_chunk(cp):
    dev = cp.cuda.Device().id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cupy_memstrat.ManagedMemoryWarning)
        s = cupy_memstrat.use("managed", preferred_location="device", accessed_by="host", read_mostly=True)
    x = cp.zeros(4 * MiB, dtype=cp.uint8)
    small = cp.zeros(10, dtype=cp.float32)
    base = small.data.ptr & -CHUNK_BYTES
    for ptr, n in ((x.data.ptr, 4 * MiB), (base, CHUNK_BYTES)):
        assert range_attr(ptr, n, "PreferredLocation") == dev
        assert range_attr(ptr, n, "ReadMostly") == 1
    h = cupy_memstrat.use("managed", preferred_location="host")
    y = cp.zeros(2 * MiB, dtype=cp.uint8)
    assert range_attr(y.data.ptr, 2 * MiB, "PreferredLocation") == -1  # cudaCpuDeviceId
    del x, small, y
    s.close()
    h.close()


def test_prefetch_on_alloc_prefetches_to_the_current_device(cp):
    dev = cp.cuda.Device().id
    cupy_memstrat.use("managed", prefetch="on_alloc")
    x = cp.empty(8 * MiB, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    assert range_attr(x.data.ptr, 8 * MiB, "LastPrefetchLocation") == dev


@pytest.mark.parametrize("mode", ["on_alloc", "on_new"])
def test_a_reused_block_is_prefetched_again_under_on_alloc_only(cp, mode):
    dev = cp.cuda.Device().id
    s = cupy_memstrat.use("managed", prefetch=mode)
    x = cp.empty(8 * MiB, dtype=cp.uint8)
    ptr = x.data.ptr
    cp.cuda.Device().synchronize()
    assert range_attr(ptr, 8 * MiB, "LastPrefetchLocation") == dev  # new memory: both modes
    cupy_memstrat.prefetch(x, "host")
    cp.cuda.Device().synchronize()
    del x
    y = cp.empty(8 * MiB, dtype=cp.uint8)  # the cached block comes back
    cp.cuda.Device().synchronize()
    assert y.data.ptr == ptr
    assert range_attr(ptr, 8 * MiB, "LastPrefetchLocation") == (dev if mode == "on_alloc" else -1)
    del y
    s.trim()


@pytest.mark.gpu_exclusive  # the driver's fault counters count the whole device: run alone (ci/gpu.sh)
def test_explicit_prefetch_both_ways_moves_exact_bytes_without_faults(cp, managed):
    counter = fault_counter()
    n = 64 * MiB
    x = cp.empty(n // 4, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    host_view(x.data.ptr, n)[:] = 3.0  # on the host now
    counter.start()
    cupy_memstrat.prefetch(x, "device")
    c = counter.stop()
    assert c.bytes_htod == n and c.gpu_faults == 0 and c.bytes_dtoh == 0
    counter.start()
    x *= 2  # resident: no faults
    c = counter.stop()
    assert c.gpu_faults == 0 and c.bytes_htod == 0
    counter.start()
    cupy_memstrat.prefetch(x, "host")
    c = counter.stop()
    assert c.bytes_dtoh == n and c.cpu_faults == 0
    assert range_attr(x.data.ptr, n, "LastPrefetchLocation") == -1
    h = host_view(x.data.ptr, n)
    counter.start()
    assert h.sum() == 6.0 * (n // 4)  # the host reads it where it is: no faults
    assert counter.stop().cpu_faults == 0


@pytest.mark.gpu_exclusive  # the driver's fault counters count the whole device: run alone (ci/gpu.sh)
def test_a_gpu_pass_over_host_data_faults_and_prefetch_avoids_it(cp, managed):
    counter = fault_counter()
    n = 64 * MiB
    a = cp.empty(n // 4, dtype=cp.float32)
    b = cp.empty(n // 4, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    host_view(a.data.ptr, n)[:] = 1.0
    host_view(b.data.ptr, n)[:] = 1.0
    # the prefetched pass first, so that no late count of the fault-driven pass falls into its
    # window (on an H100, a window right after that pass counted 166 faults and no extra bytes)
    counter.start()
    cupy_memstrat.prefetch(b)
    b *= 2
    prefetched = counter.stop()
    counter.start()
    a *= 2
    fault_driven = counter.stop()
    assert fault_driven.gpu_faults > 0 and fault_driven.bytes_htod >= n
    assert prefetched.gpu_faults == 0 and prefetched.bytes_htod == n
    assert float(a[-1]) == float(b[-1]) == 2.0


def test_prefetch_and_advise_refuse_device_memory(cp):
    x = cp.zeros(1000, dtype=cp.float32)  # CuPy's default pool: cudaMalloc memory
    with pytest.raises(ValueError, match="device memory, not managed memory"):
        cupy_memstrat.prefetch(x)
    with pytest.raises(ValueError, match="not managed memory"):
        cupy_memstrat.advise(x, preferred_location="host")


def test_advise_on_an_array_reads_back(cp, managed):
    x = cp.zeros(4 * MiB, dtype=cp.uint8)
    cupy_memstrat.advise(x, preferred_location="host")
    assert range_attr(x.data.ptr, x.nbytes, "PreferredLocation") == -1
    cupy_memstrat.advise(x, preferred_location=None)
    assert range_attr(x.data.ptr, x.nbytes, "PreferredLocation") == -2  # cudaInvalidDeviceId: none


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_the_guard_refuses_more_than_the_device_has_free_before_asking_cuda(cp, managed):
    free, _total = cp.cuda.runtime.memGetInfo()
    keep = cp.ones(1000, dtype=cp.float32)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="oversubscription guard") as info:
        cp.empty(free + (1 << 30), dtype=cp.uint8)  # refused by the guard: never reaches CUDA
    assert info.value.reason == "oversubscription_guard"
    assert managed.managed_stats().n_guard_refusals == 1
    assert int(keep.sum()) == 1000  # nothing lost
    y = cp.ones(10, dtype=cp.float32)  # and the next allocation works
    assert int(y.sum()) == 10


@pytest.mark.gpu_exclusive  # takes most of the device's free memory: run alone (ci/gpu.sh)
def test_the_guard_counts_memory_allocated_by_others_after_it_held_nothing(cp):
    # the guard's first reading is taken while the device is nearly empty; then another user takes
    # all but 1.5 GiB. A guard that counted that as the strategy's own chunks made resident would
    # let the second 400 MiB through; a new reading whenever it holds no chunk refuses it
    s = cupy_memstrat.create("managed", headroom="1GiB")
    try:
        s.raw_free(s.raw_malloc(64 * MiB))
        s.trim()  # no chunk held
        free, _ = cp.cuda.runtime.memGetInfo()
        other = cp.cuda.runtime.malloc(free - 1536 * MiB)  # someone else's cudaMalloc
        try:
            a = s.raw_malloc(400 * MiB)  # 400 MiB of the 512 MiB left above the headroom
            with pytest.raises(cupy_memstrat.OutOfMemoryError, match="oversubscription guard"):
                s.raw_malloc(400 * MiB)
            s.raw_free(a)
        finally:
            cp.cuda.runtime.free(other)
    finally:
        s.trim()
        s.close()


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_trim_gives_resident_memory_back_to_the_device(cp, managed):
    free0, _ = cp.cuda.runtime.memGetInfo()
    x = cp.ones(256 * MiB, dtype=cp.uint8)  # populated on the device by the fill
    cp.cuda.Device().synchronize()
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert free0 - free1 >= 256 * MiB - 2 * MiB
    del x
    assert managed.stats().bytes_reserved == 256 * MiB  # cached
    assert cupy_memstrat.trim() == 256 * MiB
    free2, _ = cp.cuda.runtime.memGetInfo()
    assert free2 - free1 >= 256 * MiB - 2 * MiB


def test_cupy_libraries_work_on_managed_memory(cp, managed):
    a = cp.random.rand(256, 256).astype(cp.float32)
    b = cp.linalg.inv(a @ a.T + cp.eye(256, dtype=cp.float32))  # cuBLAS / cuSOLVER
    assert cp.allclose((a @ a.T + cp.eye(256, dtype=cp.float32)) @ b, cp.eye(256), atol=1e-2)
    f = cp.fft.fft(cp.ones(1024, dtype=cp.complex64))  # cuFFT
    assert abs(complex(f[0]) - 1024) < 1e-3
    cap = a.toDlpack() if hasattr(a, "toDlpack") else a.__dlpack__()
    assert cp.from_dlpack(cap).shape == (256, 256)


def test_stream_contexts(cp, managed):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.arange(1 << 20, dtype=cp.float32)
        y = x * 2
    s.synchronize()
    assert float(y[-1]) == 2.0 * ((1 << 20) - 1)


def test_read_mostly_warns(cp):
    with pytest.warns(cupy_memstrat.ManagedMemoryWarning, match="harmful"):
        s = cupy_memstrat.create("managed", read_mostly=True)
    s.close()


def test_two_devices_get_their_own_chunks(cp, n_devices):
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    s = cupy_memstrat.use("managed", preferred_location="device")
    with cp.cuda.Device(1):
        x = cp.ones(4 * MiB, dtype=cp.uint8)
        assert range_attr(x.data.ptr, 4 * MiB, "PreferredLocation") == 1
    y = cp.ones(4 * MiB, dtype=cp.uint8)
    assert s.stats(1).n_live == 1 and s.stats(0).n_live == 1
    assert int(x.sum()) == int(y.sum()) == 4 * MiB
