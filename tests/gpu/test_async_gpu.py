"""The async strategy on the GPU, through real CuPy arrays and streams."""

import gc

import numpy as np
import pytest

import cupy_memstrat

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def strategies():
    """Strategies made by a test; CuPy's allocator is restored, then their
    pools are trimmed and closed."""
    import cupy

    prev = cupy.cuda.get_allocator()
    made = []
    yield made
    cupy.cuda.set_allocator(prev)
    gc.collect()
    for s in made:
        s.trim()
        s.close()


def use(strategies, *args, **kw):
    s = cupy_memstrat.use(*args, **kw)
    strategies.append(s)
    return s


_SLOW_SUM = r"""
extern "C" __global__ void slow_sum(const float* x, float* out, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, x[i]);
}
"""


def _slow_sum(cp):
    return cp.RawKernel(_SLOW_SUM, "slow_sum")


def test_arrays_compute_and_stats_are_exact(cp, strategies):
    s = use(strategies, "async")
    assert cupy_memstrat.current() is s
    x = cp.arange(1_000_000, dtype=cp.float64)
    st = s.stats()
    assert st.bytes_in_use == 8_000_000 and st.n_live == 1
    assert st.bytes_reserved == 32 * MiB  # one 32 MiB step of the pool
    assert float((x * 2).sum()) == 2 * (999_999 * 1_000_000 / 2)
    del x
    gc.collect()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_allocs == st.n_frees and st.bytes_reserved == 32 * MiB


def test_installing_it_leaves_the_devices_pools_alone(cp, strategies):
    rt = cp.cuda.runtime
    dev = cp.cuda.Device().id
    before = rt.deviceGetDefaultMemPool(dev), rt.deviceGetMemPool(dev)
    s = use(strategies, "async")
    x = cp.ones(1000)
    assert (rt.deviceGetDefaultMemPool(dev), rt.deviceGetMemPool(dev)) == before
    assert s.pool_stats().handle not in before
    del x


def test_pool_reserves_in_32_MiB_steps(cp, strategies):
    s = use(strategies, "async")
    seen = []
    ptrs = []
    for n in (1, 40 * MiB + 7):
        ptrs.append(s.raw_malloc(n))
        seen.append(s.pool_stats().reserved_bytes)
    for p in ptrs:
        s.raw_free(p)
    # 1 B -> 32 MiB; 40 MiB + 7 B more fill the first step and add one (measured on the H200)
    assert seen == [32 * MiB, 64 * MiB]


def test_block_freed_while_another_stream_is_current_is_not_reused_under_running_work(cp, strategies):
    """The cross-stream hazard: without stream-ordered frees, a block still
    read by a kernel on stream a is handed to stream b and overwritten."""
    s = use(strategies, "async")
    slow = _slow_sum(cp)
    n = 1 << 20
    cycles = np.int64(200_000_000)  # about 0.1 s on an H200
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    # Control, raw pool calls: free on the wrong stream, b gets the block at once.
    rt = cp.cuda.runtime
    s.raw_free(s.raw_malloc(1))
    pool = s.pool_stats().handle
    out = cp.zeros(1, dtype=cp.float32)
    with a:
        p = rt.mallocFromPoolAsync(4 * n, pool, a.ptr)
        x = cp.ndarray(n, cp.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(p, 4 * n, None), 0))
        x.fill(1.0)
        cp.cuda.Device().synchronize()
        slow((n // 256,), (256,), (x, out, np.int32(n), cycles))
    rt.freeAsync(p, b.ptr)  # wrong stream
    q = rt.mallocFromPoolAsync(4 * n, pool, b.ptr)
    rt.memsetAsync(q, 0, 4 * n, b.ptr)
    cp.cuda.Device().synchronize()
    rt.freeAsync(q, b.ptr)
    control = float(out[0])
    assert q == p and control < n, "control: a wrong-stream free should race (it did not here)"

    # The strategy: the array is dropped while b is current, but freed on a.
    out = cp.zeros(1, dtype=cp.float32)
    with a:
        x = cp.ones(n, dtype=cp.float32)
        a.synchronize()
        slow((n // 256,), (256,), (x, out, np.int32(n), cycles))
    with b:
        del x
        gc.collect()
        z = cp.zeros(n, dtype=cp.float32)  # written on b at once
    cp.cuda.Device().synchronize()
    assert float(out[0]) == n
    del z


def test_free_after_its_stream_was_destroyed(cp, strategies):
    s = use(strategies, "async")
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        x = cp.arange(1 << 20, dtype=cp.float32)
        y = x * 2
        st.synchronize()
    del st
    gc.collect()  # the Stream object is gone: cudaStreamDestroy ran
    assert float(y[-1]) == 2 * ((1 << 20) - 1)
    del x, y
    gc.collect()
    ps = s.pool_stats()
    assert ps.n_frees_after_stream_destroyed == 2 and s.stats().n_live == 0
    cp.cuda.Device().synchronize()
    ps = s.pool_stats()
    assert ps.used_bytes == ps.cached_bytes  # blocks st freed while it lived wait for a synchronisation
    s.trim()
    assert s.pool_stats().used_bytes == 0
    assert float(cp.ones(10).sum()) == 10.0


@pytest.fixture
def three_gib_free(cp):
    """All but 3 GiB of the device taken by one plain cudaMalloc (never managed memory)."""
    cp.get_default_memory_pool().free_all_blocks()
    gc.collect()
    free, _ = cp.cuda.runtime.memGetInfo()
    ballast = cp.cuda.runtime.malloc(free - 3 * GiB)
    yield
    cp.cuda.runtime.free(ballast)


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_a_pool_reuses_idle_memory_for_a_larger_request(cp, strategies, three_gib_free):
    """What the fake backend simulates: no recovery is needed for idle pool memory."""
    s = cupy_memstrat.create("async", cache=0)
    strategies.append(s)
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        s.raw_free(s.raw_malloc(2 * GiB))  # idle in the pool
    q = s.raw_malloc(2 * GiB + 512 * MiB)  # only ~1 GiB outside the pool
    s.raw_free(q)
    assert s.pool_stats().n_oom_recoveries == 0


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_oom_recovery_gives_the_cache_back(cp, strategies, three_gib_free):
    s = cupy_memstrat.create("async", cache="4GiB")
    strategies.append(s)
    s.raw_free(s.raw_malloc(2 * GiB))  # default stream: cached, still used memory to CUDA
    assert s.pool_stats().cached_bytes == 2 * GiB
    q = s.raw_malloc(2 * GiB + 512 * MiB)
    ps = s.pool_stats()
    s.raw_free(q)
    assert ps.n_oom_recoveries == 1 and ps.cached_bytes == 0 and s.stats().n_failed == 0


@pytest.mark.gpu_exclusive  # asks for twice the device: the driver may fill it before refusing
def test_oom_is_clear_and_loses_nothing(cp, strategies):
    from cuda.bindings import runtime as crt

    s = use(strategies, "async")
    _, total = cp.cuda.runtime.memGetInfo()
    keep = cp.arange(1 << 20, dtype=cp.int32)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
        cp.empty(2 * total, dtype=cp.uint8)
    msg = str(info.value)
    assert f"out of memory allocating {cupy_memstrat.format_size(2 * total)}" in msg
    assert "after synchronizing the device and trimming the pool" in msg
    assert "in use in 1 allocation" in msg and "reserved" in msg
    (err,) = crt.cudaPeekAtLastError()
    assert err == crt.cudaError_t.cudaSuccess
    assert int(keep.sum()) == sum(range(1 << 20)) and s.stats().n_failed == 1
    assert float(cp.ones(1000).sum()) == 1000.0


def test_default_stream_blocks_are_reused_from_the_cache(cp, strategies):
    s = use(strategies, "async")
    x = cp.empty(1000, dtype=cp.float32)
    p = x.data.ptr
    del x
    y = cp.empty(1000, dtype=cp.float32)
    assert y.data.ptr == p and s.pool_stats().cached_bytes == 0
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        z = cp.empty(1000, dtype=cp.float32)
    q = z.data.ptr
    del z
    assert s.pool_stats().cached_bytes == 4096  # kept for st, and for st only
    w = cp.empty(1000, dtype=cp.float32)  # the default stream: never st's block
    assert w.data.ptr != q
    with st:
        v = cp.empty(1000, dtype=cp.float32)
    assert v.data.ptr == q and s.pool_stats().cached_bytes == 0
    del y, w, v


def test_threshold_zero_releases_at_sync_the_default_keeps(cp, strategies):
    keep = cupy_memstrat.create("async")
    give = cupy_memstrat.create("async", release_threshold=0)
    strategies += [keep, give]
    for s in (keep, give):
        s.raw_free(s.raw_malloc(64 * MiB))
    cp.cuda.Device().synchronize()
    assert keep.pool_stats().reserved_bytes == 64 * MiB
    assert give.pool_stats().reserved_bytes == 0
    assert keep.trim() == 64 * MiB and keep.pool_stats().reserved_bytes == 0


def test_max_size_acts_in_32_MiB_steps(cp, strategies):
    s = cupy_memstrat.create("async", max_size="33MiB")
    strategies.append(s)
    p = s.raw_malloc(60 * MiB)  # 33 MiB acts as 64 MiB (bench async on the H200)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError, match="max_size is 33.0 MiB"):
        s.raw_malloc(8 * MiB)
    s.raw_free(p)


def test_cufft_cublas_dlpack_and_stream_contexts(cp, strategies):
    s = use(strategies, "async")
    rng = np.random.default_rng(0)
    a_h = rng.standard_normal((256, 256)).astype(np.float32)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        a = cp.asarray(a_h)
        m = a @ a.T  # cuBLAS
        f = cp.fft.fft(a, axis=1)  # cuFFT (plan work area through the allocator)
        st.synchronize()
    np.testing.assert_allclose(cp.asnumpy(m), a_h @ a_h.T, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(cp.asnumpy(f), np.fft.fft(a_h, axis=1), rtol=1e-3, atol=1e-3)
    d = cp.from_dlpack(a)  # DLPack export shares the block
    assert d.data.ptr == a.data.ptr
    assert s.stats().n_allocs >= 3


def test_several_devices_pool_each_and_free_on_the_owner(cp, strategies, n_devices):
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    s = use(strategies, "async")
    with cp.cuda.Device(1):
        x = cp.arange(1 << 20, dtype=cp.float32)
        assert x.device.id == 1
    assert s.pool_stats(1).handle and s.stats(1).bytes_in_use == 4 << 20
    with cp.cuda.Device(0):
        del x  # device 0 current: freed on device 1's stream
        gc.collect()
    with cp.cuda.Device(1):
        cp.cuda.Device().synchronize()
    ps = s.pool_stats(1)
    assert s.stats(1).n_live == 0 and ps.used_bytes == ps.cached_bytes == 4 << 20
    assert s.stats(0).n_allocs == 0


def test_arrays_cross_devices_like_cudamalloc_memory(cp, strategies, n_devices):
    """Pool memory ignores cudaDeviceEnablePeerAccess; without the pool's
    access grant, CuPy's multi-GPU copies failed (invalid value, then an
    illegal address) on two H200s."""
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    use(strategies, "async")
    with cp.cuda.Device(0):
        a = cp.arange(1 << 20, dtype=cp.float32)
    with cp.cuda.Device(1):
        b = cp.array(a)  # peer copy of a pool block
        c = cp.empty_like(b)
        c[...] = a  # a kernel on device 1 reading device 0's pool memory
        assert b.device.id == 1 and float(b[-1]) == (1 << 20) - 1 and float(c[-1]) == (1 << 20) - 1
        cp.cuda.Device().synchronize()


def test_plugin_runs_a_session_under_async(pytester):
    pytester.makepyfile(
        """
        import cupy, cupy_memstrat
        def test_it():
            assert cupy_memstrat.current().name == "async"
            assert float(cupy.arange(10).sum()) == 45
        """
    )
    r = pytester.runpytest_subprocess("--gpumem-strategy=async")
    r.assert_outcomes(passed=1)


_SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""


def _cross_device_copy_reads(cp, sync_source: bool, trials: int = 3) -> int:
    """Device 0 fills a buffer with a slow kernel; device 1 copies it at once
    on its legacy stream, as CuPy's cross-device copy does. Returns how many
    copies read unfinished data."""
    n = 1 << 16
    bad = 0
    for _ in range(trials):
        with cp.cuda.Device(0):
            fill = cp.RawKernel(_SLOW_FILL, "slow_fill")
            src = cp.zeros(n, cp.float32)
            cp.cuda.Device().synchronize()
            fill((n // 256,), (256,), (src, np.int32(n), np.float32(7.0), np.int64(50_000_000)))
            if sync_source:
                cp.cuda.Device().synchronize()
        with cp.cuda.Device(1):
            dst = cp.empty(n, cp.float32)
            dst.data.copy_from_device_async(src.data, src.nbytes)
            bad += float(dst.sum()) != 7.0 * n
        with cp.cuda.Device(0):
            cp.cuda.Device().synchronize()
    return bad


def test_cross_device_copies_of_pool_memory_are_not_ordered_on_the_null_stream(cp, strategies, n_devices):
    """CUDA orders a copy between two devices on the legacy NULL stream after
    the source device's work for cudaMalloc memory, not for pool memory:
    measured on two H200s, this is why CuPy's test_copy_multigpu and
    test_copyto_multigpu(_noncontinguous) fail under async (docs/async.md)."""
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    dev = cupy_memstrat.create("device")
    strategies.append(dev)
    cp.cuda.set_allocator(dev.cupy_allocator())
    assert _cross_device_copy_reads(cp, sync_source=False) == 0  # cudaMalloc memory: ordered
    use(strategies, "async")
    assert _cross_device_copy_reads(cp, sync_source=True) == 0  # the documented remedy works
    assert _cross_device_copy_reads(cp, sync_source=False) > 0, "CUDA now orders it: update docs/async.md"


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_close_with_a_live_array_then_the_last_free_releases_the_pool(cp, strategies):
    import warnings

    cp.get_default_memory_pool().free_all_blocks()
    s = cupy_memstrat.create("async")
    cp.cuda.set_allocator(s.cupy_allocator())
    free0, _ = cp.cuda.runtime.memGetInfo()
    x = cp.ones(256 * MiB // 4, dtype=cp.float32)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    s.close()  # the pool is destroyed while x lives: CUDA keeps it until the last free
    assert float(x[-1]) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del x
        gc.collect()
    cp.cuda.Device().synchronize()
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert free1 >= free0 - 2 * MiB and s.stats().n_live == 0


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_using_async_in_a_loop_leaves_no_pools_behind(cp):
    cp.get_default_memory_pool().free_all_blocks()
    cp.cuda.Device().synchronize()
    free0, _ = cp.cuda.runtime.memGetInfo()
    for _ in range(10):
        with cupy_memstrat.using("async"):
            y = cp.ones(1 << 20, dtype=cp.float32) * 2
            assert float(y[0]) == 2.0
            del y
    cp.cuda.Device().synchronize()
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert free1 >= free0 - 4 * MiB  # ten blocks would have kept ten 32 MiB pools
