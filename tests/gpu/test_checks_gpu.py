"""The checking layer on the GPU: the four bugs of issue 6, each shown to slip
through without the check (the data is silently wrong, or nothing is said)
and to be caught with it; the kernels themselves; no false findings on real
CuPy work."""

import contextlib
import gc
import textwrap

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat import checks

N = 1 << 20  # float32 elements: 4 MiB arrays
SPIN = 100_000_000  # clock cycles a "long kernel" waits first: ~50 ms on an H200

@pytest.fixture
def installed(cp):
    """use() a strategy for the test; afterwards: CuPy's allocator back, the
    findings cleared, the strategies closed."""
    made = []
    checks.clear()

    def install(spec, **kw):
        s = cupy_memstrat.use(spec, **kw)
        made.append(s)
        return s

    yield install
    cp.cuda.Device().synchronize()
    gc.collect()
    for s in made:
        try:
            checks.collect()
        except checks.CheckError:
            pass
        s.trim()
    checks.clear()


def _grid(n):
    return ((n + 255) // 256,), (256,)


@contextlib.contextmanager
def _streams_a_and_b(cp):
    """Two non-blocking streams, A and B, for bugs 1 and 2; when the block ends, B then A is
    synchronised, so that what the bug returns is final (B's long kernel done). An error raised
    in the block (a check's finding) leaves both unsynchronised: the test synchronises. The
    arrays stay in the bug's own frame, where the checks record their sites."""
    A, B = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    yield A, B
    B.synchronize()
    A.synchronize()


# -- bug 1: cross-stream reuse ------------------------------------------------------------------------


def _bug1(cp, k):
    """x made on stream A, read by a long kernel on stream B, dropped on A with
    no event ordering B before A; a new array of the same size on A gets the
    block and overwrites it while B still reads. Returns (x's pointer, z's
    pointer, what B read)."""
    with _streams_a_and_b(cp) as (A, B):
        with A:
            x = cp.full(N, 1.0, dtype=cp.float32)
            A.synchronize()
            xptr = x.data.ptr
        with B:
            y = cp.zeros(N, dtype=cp.float32)
            B.synchronize()
            k["slow_copy"]((1,), (256,), (x, y, np.int32(N), np.int64(SPIN)))
        with A:
            del x
            z = cp.full(N, 7.0, dtype=cp.float32)
    return xptr, z.data.ptr, cp.asnumpy(y)


@pytest.mark.parametrize("spec", ["pool", "async"])
def test_bug1_cross_stream_reuse_corrupts_silently_without_the_check(cp, k, installed, spec):
    installed(spec)
    xptr, zptr, read = _bug1(cp, k)
    assert zptr == xptr  # the block was handed out again at once
    assert (read == 7.0).any()  # B read z's values instead of x's: wrong numbers, no error


@pytest.mark.parametrize("spec", ["pool", "async"])
def test_bug1_cross_stream_reuse_is_caught_by_the_streams_check(cp, k, installed, spec):
    installed(spec, check="streams")  # on_finding="raise"
    with pytest.raises(checks.CheckError) as exc:
        _bug1(cp, k)  # raised at z's allocation, which is not made
    (f,) = exc.value.findings
    assert f.kind == "cross-stream reuse" and f.check == "streams" and f.size == 4 * N
    assert f.alloc_stream != f.other_stream and f.free_stream == f.alloc_stream
    assert f.alloc_site.function == f.free_site.function == "_bug1"
    cp.cuda.Device().synchronize()


# -- bug 2: write after free ----------------------------------------------------------------------------


def _bug2(cp, k):
    """A long kernel on stream B still writes x after x was released on A and
    its block handed to z. Returns (x's pointer, z's pointer, z)."""
    # z's fill kernel compiled before the race: on a cold kernel cache its compilation outlasts
    # the long kernel, which then finishes before z is written (the race shown by timing fails)
    cp.full(8, 7.0, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with _streams_a_and_b(cp) as (A, B):
        with A:
            x = cp.zeros(N, dtype=cp.float32)
            A.synchronize()
            xptr = x.data.ptr
        with B:
            k["slow_fill"]((1,), (256,), (x, np.int32(N), np.float32(5.0), np.int64(SPIN)))
        with A:
            del x
            z = cp.full(N, 7.0, dtype=cp.float32)
    return xptr, z.data.ptr, cp.asnumpy(z)


@pytest.mark.gpu_exclusive  # a race shown by timing: other tests' kernels on the GPU can let it finish first
def test_bug2_write_after_free_corrupts_silently_without_the_check(cp, k, installed):
    installed("pool")
    xptr, zptr, z = _bug2(cp, k)
    assert zptr == xptr and (z == 5.0).all()  # z holds the late writes: wrong data, no error


def test_bug2_write_after_free_is_caught_by_poison(cp, k, installed):
    installed("pool", check="poison", on_finding="record")
    xptr, zptr, z = _bug2(cp, k)
    assert zptr != xptr and (z == 7.0).all()  # x's block was in quarantine: z is intact
    (f,) = checks.collect()
    assert f.kind == "write after free" and f.ptr == xptr and f.size == 4 * N
    assert f.bad_bytes == 4 * N and f.first_bad_offset == 0
    assert f.alloc_site.function == f.free_site.function == "_bug2"


# -- bug 3: out-of-bounds write ------------------------------------------------------------------------------


def _bug3(cp, k, n=1000):
    x = cp.zeros(n, dtype=cp.float32)
    k["fill_n"](*_grid(n + 3), (x, np.int32(n + 3), np.float32(1.0)))  # three elements too many
    cp.cuda.Device().synchronize()
    ptr = x.data.ptr
    del x
    return ptr


def test_bug3_out_of_bounds_write_goes_unnoticed_without_the_check(cp, k, installed):
    s = installed("pool")
    _bug3(cp, k)
    assert s.stats().n_frees == 1  # freed normally; nothing anywhere reports the write


def test_bug3_out_of_bounds_write_is_caught_by_the_redzone(cp, k, installed):
    installed("device", check="redzone", on_finding="record")
    ptr = _bug3(cp, k)
    (f,) = checks.collect()
    assert f.kind == "out-of-bounds write" and f.ptr == ptr and f.size == 4000
    assert (f.bad_bytes, f.first_bad_offset) == (12, 4000)
    assert f.alloc_site.function == f.free_site.function == "_bug3"


# -- bug 4: hard-coded legacy stream, through the plugin --------------------------------------------------------

LEGACY_TEST = textwrap.dedent(
    """
    import cupy, numpy as np
    SLOW = cupy.RawKernel(r'''
    extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
        for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = v;
    }''', "slow_fill")
    N = 1 << 20

    def normalise(x):
        with cupy.cuda.Stream.null:  # library code that hard-codes the legacy default stream
            return x / x.sum()

    def test_normalise():
        # once first, so that the pool has normalise's blocks cached for the legacy stream: a new
        # cudaMalloc there would synchronise the device and hide the race
        warm = cupy.ones(N, dtype=cupy.float32)
        normalise(warm).get()
        del warm
        x = cupy.zeros(N, dtype=cupy.float32)
        SLOW((1,), (256,), (x, np.int32(N), np.float32(2.0), np.int64(%d)))
        y = normalise(x)
        assert abs(float(y[0]) * N - 1.0) < 1e-3
    """
    % SPIN
)


def test_bug4_legacy_stream_passes_by_default_is_exposed_by_a_fresh_stream_and_caught_by_the_check(pytester, cp):
    pytester.makepyfile(LEGACY_TEST)
    base = ("-p", "no:cacheprovider")
    # the default: everything runs on the legacy stream, so the bug never shows
    pytester.runpytest_subprocess(*base, "--gpumem").assert_outcomes(passed=1)
    # a fresh non-blocking stream per test: the race shows as wrong numbers
    r = pytester.runpytest_subprocess(*base, "--gpumem-stream-policy=fresh")
    r.assert_outcomes(failed=1)
    # with the streams check the report names the line that hard-codes the stream
    r = pytester.runpytest_subprocess(*base, "--gpumem-stream-policy=fresh", "--gpumem-check=streams")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*gpumem checks*", "*[[]legacy stream[]]*while the legacy default stream was current*",
                            "*allocated at *in normalise on stream 0 (the legacy default stream)*"])


# -- the kernels, and no false findings ---------------------------------------------------------------------------


def test_verify_kernel_reads_damage_exactly(cp):
    b = cupy_memstrat.backends.get_backend()
    kern = b.check_kernels()
    buf = cp.empty(1 << 20, dtype=cp.uint8)
    ptr, dev = buf.data.ptr, cp.cuda.Device().id
    for start, end in [(0, 1 << 20), (3, 1001), (1000, 1000 + 511)]:
        buf[:] = 0xAB
        kern.verify(dev, ptr, start, end, 0xAB, 5, 0)
        cp.cuda.Device().synchronize()
        assert kern.read(dev) == {}
        buf[end - 1] = 0
        buf[start] = 1
        kern.verify(dev, ptr, start, end, 0xAB, 6, 0)
        cp.cuda.Device().synchronize()
        assert kern.flagged()
        assert kern.read(dev) == {6: (2, start)}
        kern.clear_flag()
        assert kern.read(dev) == {}  # read() reset the slot


def test_stream_queries_do_not_disturb_cupy(cp, k):
    b = cupy_memstrat.backends.get_backend()
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    with s:
        k["slow_fill"]((1,), (256,), (x, np.int32(N), np.float32(1.0), np.int64(SPIN)))
    assert b.stream_busy(s.ptr) and b.stream_non_blocking(s.ptr) and not b.stream_non_blocking(0)
    ev = b.event_create()
    b.event_record(ev, s.ptr)
    assert not b.event_done(ev)
    s.synchronize()
    assert not b.stream_busy(s.ptr) and b.event_done(ev)
    b.event_destroy(ev)
    assert float((x + 1).sum()) == 2.0 * N  # CuPy carries on normally


@pytest.mark.parametrize("spec", ["pool", "device", "async", "managed"])
def test_no_false_findings_on_real_cupy_work(cp, installed, spec):
    s = installed(spec, check="all")  # raise on any finding
    a = cp.random.random((512, 512), dtype=cp.float32)
    for _ in range(3):
        b = a @ a.T
        f = cp.fft.fft2(b)
        c = cp.sort(cp.abs(f).ravel())[-10:]
        d = cp.concatenate([a.ravel(), c]).astype(cp.float64)
        e = cp.cumsum(d)
    # two streams, correctly ordered: B waits for A's work, and A for B's before the drop
    A, B = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with A:
        x = cp.arange(N, dtype=cp.float32)
    B.wait_event(A.record())
    with B:
        y = x * 2
    A.wait_event(B.record())
    with A:
        del x
        z = cp.ones(N, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    assert float(y[-1]) == 2.0 * (N - 1) and float(e[-1]) > 0 and float(z.sum()) == N
    del a, b, f, c, d, e, y, z
    gc.collect()
    assert checks.collect() == [] and checks.findings() == []
    st = s.stats()
    assert st.bytes_in_use <= st.bytes_reserved


@pytest.mark.parametrize("spec", ["pool", "async"])
def test_the_layers_own_poison_fills_are_not_user_work(cp, installed, spec):
    """Seen on the H200: freeing many blocks of the legacy stream queues their
    poison fills there; freeing, right after, a block of another stream (whose
    work is done and ordered) found the legacy stream busy with nothing but
    those fills, and reported cross-stream reuse."""
    s = installed(spec, check="all")
    blocks = [cp.empty(256 << 20, dtype=cp.uint8) for _ in range(16)]  # 4 GiB on the legacy stream
    B = cp.cuda.Stream(non_blocking=True)
    with B:
        y = cp.arange(N, dtype=cp.float32)
    B.synchronize()
    cp.cuda.Device().synchronize()
    del blocks  # 4 GiB of poison fills queued on the legacy stream
    del y  # freed while the legacy stream is current and busy with our fills only
    assert checks.collect() == [] and checks.findings() == []


def test_checks_on_a_second_device(cp, k, installed, n_devices):
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    installed("device", check="all", on_finding="record")
    with cp.cuda.Device(1):
        x = cp.zeros(1000, dtype=cp.float32)
        k["fill_n"](*_grid(1003), (x, np.int32(1003), np.float32(1.0)))
        cp.cuda.Device().synchronize()
    del x  # freed while device 0 is current
    (f,) = checks.collect()
    assert f.kind == "out-of-bounds write" and f.device == 1 and f.first_bad_offset == 4000
