"""Drop-in safety on the GPU: no strategy hands a block to one stream while
another still writes or reads it where CuPy's pool does not, record_stream
closes cupy#8068, arrays held by reference cycles are collected before an
out-of-memory error, using() gives everything back, block sizes as CuPy's.

Each safety claim has its control: the same program without the fix
(``managed-one-cache``: managed with one cache for every stream, as before)
or without record_stream, which corrupts the data. The patterns live in
cupy_memstrat.bench.streams (``python -m cupy_memstrat bench streams`` makes
the table of docs/streams.md from them)."""

import gc
import subprocess
import sys
import threading
import time

import pytest

import cupy_memstrat
from cupy_memstrat.strategies.reachable import REACHABLE
from cupy_memstrat import backends as C
from cupy_memstrat.bench import streams as S

GiB = 1 << 30
SAFE = ["cupy-default", "device", "managed", "async", "pool", "pool:route=wrap", "expandable"]


@pytest.fixture
def kern(cp):
    return S.Kernels(cp)


def _run(cp, spec, fn, **options):
    s = S.install(cp, spec, **options)
    try:
        return fn()
    finally:
        S.release(cp, s)


PATTERNS = {
    "other-stream": lambda cp, k: S.other_stream(cp, k),
    "freed-elsewhere": lambda cp, k: S.freed_elsewhere(cp, k),
    "freed-by-gc": lambda cp, k: S.freed_elsewhere(cp, k, by_gc=True),
    # a stream dies while its kernel writes a freed block; a new stream, which CUDA may give the
    # dead one's handle while that kernel still runs, makes the next array (CuPy's pool and pool,
    # keyed by handle: see the test after this one)
    "dead-stream": lambda cp, k: S.dead_stream(cp, k),
    # the same, the next array made on a stream that lived all along: managed hands it the dead
    # stream's cached block, after a device synchronisation
    "dead-stream-reclaimed": lambda cp, k: S.dead_stream_reclaimed(cp, k),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("spec", SAFE)
def test_no_block_reaches_another_stream_while_its_stream_still_writes(cp, kern, spec, pattern):
    if pattern == "dead-stream" and spec == "cupy-default":
        pytest.skip("CuPy's pool keys its arenas by handle: test_dead_stream_under_cupys_own_pool_only_with_its_handle")
    assert _run(cp, spec, lambda: PATTERNS[pattern](cp, kern)) == 0
    if pattern == "dead-stream" and spec == "async":
        assert _run(cp, "async:cache=0", lambda: PATTERNS[pattern](cp, kern)) == 0


def test_dead_stream_under_cupys_own_pool_only_with_its_handle(cp, kern):
    """CuPy's pool finds a stream's free blocks by the stream's handle, which
    CUDA may give a new stream while the destroyed one's kernel still runs
    (measured on the H200: 1 048 576 wrong elements in one run, and 3 145 728
    under pool:route=wrap before its guard). What holds of CuPy's pool: a new
    stream with a handle of its own never gets the block early. Whether the
    handle comes back is CUDA's choice: the rounds are printed."""
    rounds = []
    _run(cp, "cupy-default", lambda: S.dead_stream(cp, kern, rounds=8, per_round=rounds))
    print(f"CuPy's pool: (handle reused, wrong elements) per round: {rounds}")
    assert len(rounds) == 8
    if all(reused for reused, _wrong in rounds):
        pytest.skip(f"CUDA gave B A's handle in every round: nothing to check ({rounds})")
    assert all(wrong == 0 for reused, wrong in rounds if not reused), rounds


def _a_dead_streams_kernel_is_done_when_the_next_allocation_returns(cp, kern) -> bool:
    a = cp.cuda.Stream(non_blocking=True)
    with a:
        x = cp.empty(S.N, dtype=cp.float32)
        kern.fill(x, 5.0)  # about 0.1 s
        ev = a.record()
        del x
    del a  # cudaStreamDestroy: the kernel goes on
    b = cp.cuda.Stream(non_blocking=True)
    with b:
        y = cp.empty(S.N, dtype=cp.float32)
        done = ev.done
    cp.cuda.Device().synchronize()
    del y, b
    return done


@pytest.mark.parametrize("spec", ["pool", "pool:route=wrap"])
def test_pool_waits_for_a_dead_streams_kernel_before_handing_out_a_block(cp, kern, spec):
    """pool's dead-stream guard: after a stream that allocated dies, the next
    allocation waits for the device, so a block CuPy's pool cached under the
    dead handle is handed out only once that stream's kernels are done, even
    if CUDA gives the new stream the same handle. The control, CuPy's own
    pool, returns while the dead stream's kernel still runs."""
    assert _run(cp, spec, lambda: _a_dead_streams_kernel_is_done_when_the_next_allocation_returns(cp, kern))
    assert not _run(cp, "cupy-default",
                    lambda: _a_dead_streams_kernel_is_done_when_the_next_allocation_returns(cp, kern))
    rounds = []
    _run(cp, spec, lambda: S.dead_stream(cp, kern, rounds=8, per_round=rounds))
    print(f"{spec}: (handle reused, wrong elements) per round: {rounds}")
    assert all(wrong == 0 for _reused, wrong in rounds), rounds


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_control_without_stream_ordered_reuse_corrupts_the_next_array(cp, kern, pattern):
    assert _run(cp, "managed-one-cache", lambda: PATTERNS[pattern](cp, kern)) > 0


class _NoDeviceSync:
    """The real backend without cudaDeviceSynchronize: the control for the
    synchronisation before a destroyed stream's chunks are reclaimed."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def device_synchronize(self, device):
        pass


def test_managed_reclaims_a_dead_streams_chunks_after_a_synchronisation_and_corrupts_without_it(cp, kern):
    s = cupy_memstrat.use("managed")
    try:
        assert S.dead_stream_reclaimed(cp, kern) == 0
        ms = s.managed_stats()
        assert ms.n_reclaims == 5 and ms.reclaimed_bytes == 5 * 4 * (1 << 20)  # A's block each round, no new chunk
    finally:
        S.release(cp, s)
    control = cupy_memstrat.create("managed", backend=_NoDeviceSync(C.get_backend()))
    cp.cuda.set_allocator(control.cupy_allocator())
    try:
        assert S.dead_stream_reclaimed(cp, kern) > 0  # reclaimed while A's kernel still writes
        assert control.managed_stats().n_reclaims == 5
    finally:
        S.release(cp, control)


class _Foreign:  # a stream of another library, through the CUDA stream protocol
    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@pytest.mark.parametrize("how", ["ExternalStream", "from_external"])
def test_managed_keeps_a_live_streams_cache_when_an_external_stream_wraps_it_anew_each_step(cp, how):
    """The PyTorch interop idiom, cupy.cuda.ExternalStream(stream.ptr) (or CuPy 14's
    Stream.from_external(obj)) at every step around one live stream: the wrapper's death
    destroys nothing, so the cache stays (no device synchronisation, no reclaim, the same
    block each step, the sums right)."""
    if how == "from_external" and not hasattr(cp.cuda.Stream, "from_external"):
        pytest.skip("this CuPy has no Stream.from_external")
    s = cupy_memstrat.use("managed")
    owner = cp.cuda.Stream(non_blocking=True)
    try:
        assert C.get_backend().stream_owns_handle(owner)
        ptrs, sums = set(), []
        for i in range(8):
            if how == "ExternalStream":
                w = cp.cuda.ExternalStream(owner.ptr)
            else:
                w = cp.cuda.Stream.from_external(_Foreign(owner.ptr))
            assert not C.get_backend().stream_owns_handle(w)
            with w:
                x = cp.full(1 << 20, float(i), dtype=cp.float32)
                ptrs.add(x.data.ptr)
                sums.append(float(x.sum()))
                del x
            del w
            gc.collect()
        owner.synchronize()
        assert sums == [float(i << 20) for i in range(8)]
        assert len(ptrs) == 1 and s.managed_stats().n_reclaims == 0
    finally:
        S.release(cp, s)


def test_per_thread_default_streams_are_told_apart():
    got = S.per_thread(SAFE + ["managed-one-cache"])
    assert {k: v for k, v in got.items() if k in SAFE} == dict.fromkeys(SAFE, 0)
    assert got["managed-one-cache"] > 0  # the control: one cache for every thread's stream


def test_the_managed_hot_path_reads_the_stream_through_cupys_own_c_function(cp):
    s = cupy_memstrat.use("managed")
    try:
        capsule = s.backend.current_stream_ptr_capsule()  # what the hot path reads the stream with
        assert capsule is not None  # cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
        x = cp.ones(10)
        assert s.hot_path in ("c", "python") and float(x.sum()) == 10.0
    finally:
        S.release(cp, s)


@pytest.mark.parametrize("spec", ["managed", "async", "pool", "pool:route=wrap"])
def test_cupy_8068_corrupts_without_record_stream_and_not_with_it(cp, kern, spec):
    assert _run(cp, spec, lambda: S.other_reader(cp, kern)) > 0  # the control, as under CuPy's pool
    assert _run(cp, spec, lambda: S.other_reader(cp, kern, record=True)) == 0


def test_cupy_8068_is_safe_under_device_without_record_stream(cp, kern):
    # cudaFree synchronises the device: the reader on B finishes first
    assert _run(cp, "device", lambda: S.other_reader(cp, kern)) == 0
    assert _run(cp, "device", lambda: S.other_reader(cp, kern, record=True)) == 0


def test_cupy_8068_under_cupys_own_pool_is_unsafe_and_record_stream_cannot_help(cp, kern):
    assert _run(cp, "cupy-default", lambda: S.other_reader(cp, kern, record=True)) > 0


def test_the_streams_check_reports_cupy_8068(cp, kern):
    got = S.checks_findings(cp, kern)
    assert got["findings"] >= 1 and got["kinds"] == ["cross-stream reuse"]


@pytest.mark.parametrize("spec", ["managed", "async", "pool"])
def test_record_stream_with_the_streams_check_is_safe_and_silent(cp, kern, spec):
    from cupy_memstrat import checks

    mark = checks.mark()
    assert _run(cp, spec, lambda: S.other_reader(cp, kern, record=True), check="streams", on_finding="record") == 0
    assert checks.findings(mark) == []


def test_record_stream_refuses_bad_input_on_the_gpu(cp):
    s = cupy_memstrat.use("managed")
    try:
        x = cp.ones(1000, dtype=cp.float32)
        with pytest.raises(TypeError, match="stream: expected a cupy.cuda.Stream"):
            cupy_memstrat.record_stream(x, cp.cuda.Stream().ptr)
        with pytest.raises(TypeError, match="array: expected a CuPy array"):
            cupy_memstrat.record_stream(x.get(), cp.cuda.Stream())
        assert s.deferred.recorded == {} and float(x.sum()) == 1000.0
        assert cupy_memstrat.record_stream(x, cp.cuda.Stream.null) is True
    finally:
        S.release(cp, s)


def test_record_stream_takes_an_external_stream(cp, kern):
    """An ExternalStream (another library's handle) works like a CuPy stream.
    (Whether its handle was destroyed cannot be asked safely: cudaStreamQuery
    on a destroyed handle killed the process with SIGSEGV here.)"""
    s = cupy_memstrat.use("managed")
    raw = cp.cuda.runtime.streamCreateWithFlags(1)  # cudaStreamNonBlocking
    try:
        ext = cp.cuda.ExternalStream(raw)
        a = cp.cuda.Stream(non_blocking=True)
        with a:
            x = cp.full(S.N, 7.0, dtype=cp.float32)
        a.synchronize()
        with ext:
            out = cp.empty(S.N, dtype=cp.float32)
        with ext:
            kern.copy(x, out)
        assert cupy_memstrat.record_stream(x, ext) is True
        with a:
            del x
            z = cp.zeros(S.N, dtype=cp.float32)
        ext.synchronize()
        a.synchronize()
        assert int(cp.count_nonzero(out != 7.0)) == 0
        del out, z
    finally:
        S.release(cp, s)
        cp.cuda.runtime.streamDestroy(raw)


def _other_thread_allocates_during_the_free(cp, kern, s, hold: bool, rounds: int = 5) -> int:
    """cupy#8068 with two threads on one stream: while thread 1 frees x (which
    stream B still reads, recorded), thread 2 allocates on x's stream A and
    zero-fills. hold=True: cupy_memstrat.record_stream; hold=False (the
    control): Strategy.record_stream with the pointer alone, whose free on the
    direct route gives the block to CuPy's pool before it waits for B."""
    bad = 0
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for _ in range(rounds):
        with a:
            x = cp.full(S.N, 7.0, dtype=cp.float32)
        a.synchronize()
        with b:
            out = cp.empty(S.N, dtype=cp.float32)
            kern.copy(x, out)  # reads x late (about 0.1 s), on B
        if hold:
            assert cupy_memstrat.record_stream(x, b) is True
        else:
            assert s.record_stream(x.data.mem.ptr, b) is True
        go, got = threading.Event(), []

        def other():
            go.wait()
            time.sleep(0.02)  # thread 1 is in the free by then
            with a:
                got.append(cp.zeros(S.N, dtype=cp.float32))

        t = threading.Thread(target=other)
        t.start()
        go.set()
        with a:
            del x
        t.join()
        b.synchronize()
        a.synchronize()
        bad += int(cp.count_nonzero(out != 7.0))
        got.clear()
        del out
    return bad


def test_route_direct_keeps_a_recorded_block_from_another_thread_on_its_stream(cp, kern):
    """pool:route=direct: the block of an array freed with a recorded stream
    stays out of CuPy's pool until the recorded stream's work is done, under
    threads too; the control (the pointer alone recorded) corrupts."""
    s = S.install(cp, "pool:route=direct")
    try:
        assert type(cp.cuda.alloc(512).mem).__name__ == "PooledMemory"  # the direct route runs
        assert _other_thread_allocates_during_the_free(cp, kern, s, hold=False) > 0  # the control
        assert _other_thread_allocates_during_the_free(cp, kern, s, hold=True) == 0
        assert s.stats().n_live == 0
    finally:
        S.release(cp, s)


# -- out of memory with reference cycles --------------------------------------------------------------


class _Cycle:
    def __init__(self, x):
        self.me, self.x = self, x


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
@pytest.mark.parametrize("spec", SAFE)
def test_arrays_held_by_reference_cycles_are_collected_before_out_of_memory(cp, spec):
    """A program drops 2 GiB arrays in reference cycles with the collector
    off; about 6 GiB are free (the rest held by plain cudaMalloc outside any
    strategy, so nothing is ever oversubscribed). CuPy's pool collects and
    retries: so must every strategy."""
    rt = cp.cuda.runtime
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    free, _ = rt.memGetInfo()
    ballast = rt.malloc(free - 6 * GiB)
    try:
        s = S.install(cp, spec)
        gc.disable()
        try:
            for _ in range(6):  # 12 GiB in all
                _Cycle(cp.empty(2 * GiB // 4, dtype=cp.float32))
        finally:
            gc.enable()
        if s is not None:
            st = s.stats()
            assert st.n_failed == 0
            # (CuPy's own pool behind the pool strategy collects and retries by itself)
            assert st.n_oom_recoveries >= 1 or spec.split(":")[0] == "pool"
        S.release(cp, s)
    finally:
        rt.free(ballast)


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
def test_the_control_without_collection_runs_out_of_memory(cp):
    """The same program with CuPy's allocator off (raw cudaMalloc, no retry)."""
    rt = cp.cuda.runtime
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    free, _ = rt.memGetInfo()
    ballast = rt.malloc(free - 6 * GiB)
    prev = cp.cuda.get_allocator()
    try:
        cp.cuda.set_allocator(None)
        gc.disable()
        with pytest.raises((cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError)):
            for _ in range(6):
                _Cycle(cp.empty(2 * GiB // 4, dtype=cp.float32))
    finally:
        gc.enable()
        gc.collect()
        cp.cuda.set_allocator(prev)
        rt.free(ballast)


# -- using() lets go; block sizes -----------------------------------------------------------------------


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
@pytest.mark.parametrize("spec", ["managed", "async", "pool"])
def test_using_in_a_loop_gives_everything_back_once_the_arrays_die(cp, spec):

    cp.cuda.Device().synchronize()
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    free0, _ = cp.cuda.runtime.memGetInfo()
    for _ in range(10):
        with cupy_memstrat.using(spec) as s:
            x = cp.ones(64 << 20, dtype=cp.uint8)
        assert s in REACHABLE
        del x
        assert s not in REACHABLE
    cp.get_default_memory_pool().free_all_blocks()
    free1, _ = cp.cuda.runtime.memGetInfo()
    assert free0 - free1 < 64 << 20  # ten strategies' pools and caches are gone


@pytest.mark.parametrize("spec", ["device", "managed", "async", "pool"])
def test_block_sizes_are_reported_as_cupys_pool_reports_them(cp, spec):
    s = cupy_memstrat.use(spec)
    try:
        x = cp.empty(1000, dtype=cp.uint8)
        assert x.data.mem.size == (1000 if spec == "device" else 1024)
        assert s.stats().bytes_in_use == x.data.mem.size
    finally:
        S.release(cp, s)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    assert cp.empty(1000, dtype=cp.uint8).data.mem.size == 1024  # CuPy's own pool


# -- across devices (two GPUs; issue 22) ------------------------------------------------------------


@pytest.mark.parametrize("spec", SAFE)
def test_the_patterns_hold_with_the_second_device_current(cp, spec, n_devices):
    """The stream-ordering patterns above, all on device 1: each strategy's pools and caches are
    per device, and a block freed there waits for device 1's streams as on device 0."""
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        k = S.Kernels(cp)
        for name, pattern in PATTERNS.items():
            if name == "dead-stream" and spec == "cupy-default":
                continue  # CuPy's pool keys its arenas by handle (the test above)
            assert _run(cp, spec, lambda: pattern(cp, k)) == 0, name


@pytest.mark.parametrize("spec", ["managed", "async", "pool"])
def test_record_stream_with_another_devices_stream_is_refused_and_changes_nothing(cp, spec, n_devices):
    if n_devices < 2:
        pytest.skip("needs two GPUs")
    s = S.install(cp, spec)
    try:
        x = cp.arange(1000, dtype=cp.float32)
        with cp.cuda.Device(1):
            other = cp.cuda.Stream(non_blocking=True)
        before = s.stats(0)
        with pytest.raises(ValueError, match="is on device 1, but the array's memory is on device 0"):
            cupy_memstrat.record_stream(x, other)
        assert s.stats(0) == before and float(x[-1]) == 999.0
        del x
        cp.cuda.Device().synchronize()
        assert s.stats(0).n_live == 0  # freed as if never recorded
    finally:
        S.release(cp, s)


# -- an array's memory passed as the stream --------------------------------------------------------


@pytest.mark.parametrize("spec", ["device", "managed", "async", "pool"])
def test_an_arrays_memory_is_refused_as_a_stream(cp, spec):
    """A MemoryPointer has .ptr and .device_id as a stream has; record_stream refuses it (and the
    array) by type, before anything is recorded."""
    s = S.install(cp, spec)
    try:
        x, y = cp.ones(1 << 20, dtype=cp.float32), cp.ones(1 << 20, dtype=cp.float32)
        before = s.stats()
        for bad in (y.data, y):
            with pytest.raises(TypeError, match=r"stream: expected a cupy.cuda.Stream \(or ExternalStream\), got "):
                cupy_memstrat.record_stream(x, bad)
        assert s.stats() == before
        del x
        cp.cuda.Device().synchronize()
        z = cp.ones(1 << 20, dtype=cp.float32)
        assert float(z.sum()) == 1 << 20
        del y, z
    finally:
        S.release(cp, s)


_OLD_CHECK = """
import sys, cupy as cp, cupy_memstrat as m
from cupy_memstrat import api
from cupy_memstrat.strategies import base

def old_check(stream):  # the check before: any object whose .ptr is an int in range
    h = getattr(stream, "ptr", None)
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 64:
        raise TypeError(stream)

api.check_stream = base.check_stream = old_check  # where record_stream() and Strategy look it up
m.use(sys.argv[1])
x, y = cp.ones(1 << 20, dtype=cp.float32), cp.ones(1 << 20, dtype=cp.float32)
print("recorded:", m.record_stream(x, y.data), flush=True)
del x
cp.cuda.Device().synchronize()
z = cp.ones(1 << 20, dtype=cp.float32)
cp.cuda.Device().synchronize()
print("survived", flush=True)
"""


@pytest.mark.parametrize("spec", ["pool", "async"])
def test_control_without_the_type_check_a_memory_pointer_recorded_as_a_stream_kills_the_process(spec):
    """The control of the test above, in a child process: with the duck-typed check of before, the
    device pointer is recorded as a cudaStream_t and the process dies at the free (measured on an
    H200 under pool and async: SIGSEGV)."""
    r = subprocess.run([sys.executable, "-c", _OLD_CHECK, spec], capture_output=True, text=True, timeout=120)
    print(f"{spec}: exit {r.returncode}; {r.stdout.strip()!r}")
    assert "recorded: True" in r.stdout, r.stderr[-2000:]
    assert r.returncode != 0 and "survived" not in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
