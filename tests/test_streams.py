"""Drop-in safety on the fake backend: stream-ordered reuse, record_stream,
out-of-memory recovery in CuPy's order, using() letting go, block sizes.

The fake's streams keep simulated work queued until ``fake.finish()`` (or a
synchronisation): a block handed to another stream while its stream is busy
is the bug these tests rule out. tests/gpu/test_streams_gpu.py shows the same
patterns corrupting real data without the fixes, and not with them.
"""

import gc
import threading
import warnings

import pytest

import cupy_memstrat
from cupy_memstrat.strategies.reachable import REACHABLE
from cupy_memstrat import backends as C
from cupy_memstrat.testing import FakeBackend
from helpers import dead_stream_allocation, stream_on_handle

MiB = 1 << 20
POOLING = ["managed", "async", "pool"]
ALL = ["device", "managed", "async", "pool"]


def _alloc_on(s, stream, size):
    with stream:
        return s.raw_malloc(size)


# -- stream-ordered reuse -------------------------------------------------------------------------

@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_managed_does_not_hand_a_busy_streams_block_to_another_stream(fake, size):
    """Pattern 1: allocated and written by a long kernel on A, dropped; the
    next allocation of that size on B must not get the block."""
    s = cupy_memstrat.create("managed", backend=fake)
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    p = _alloc_on(s, A, size)
    fake.launch(A)  # a long kernel writing p
    with A:
        s.raw_free(p)
    q = _alloc_on(s, B, size)
    assert q != p
    with A:  # A itself reuses it at once: its later work is ordered after the kernel
        assert s.raw_malloc(size) == p


@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_managed_returns_a_block_to_its_allocation_stream_whatever_stream_frees_it(fake, size):
    """Pattern 2: allocated on S, dropped while the legacy default stream is
    current (``del`` outside ``with S:``, or the collector)."""
    s = cupy_memstrat.create("managed", backend=fake)
    S = fake.stream(non_blocking=True)
    p = _alloc_on(s, S, size)
    fake.launch(S)
    s.raw_free(p)  # the legacy stream is current here
    assert s.raw_malloc(size) != p  # the legacy stream does not get S's block
    assert _alloc_on(s, S, size) == p


# -- destroyed streams' caches (managed) ------------------------------------------------------------

def test_managed_hands_a_destroyed_streams_chunks_to_a_new_stream_after_one_synchronisation(fake):
    """A program that makes streams and drops them: the dead stream's free
    chunks go to the next stream that needs new chunks, only after a device
    synchronisation (its last kernel may still write them), and CUDA is not
    asked for new managed memory."""
    s = cupy_memstrat.create("managed", backend=fake)
    A = fake.stream(non_blocking=True)
    small, large = _alloc_on(s, A, 4096), _alloc_on(s, A, 4 * MiB)
    fake.launch(A)  # a long kernel writing both
    with A:
        s.raw_free(small)
        s.raw_free(large)
    a = A.ptr
    del A
    gc.collect()  # cudaStreamDestroy: the kernel goes on
    calls, syncs = fake.n_malloc_calls, fake.n_device_synchronize_calls
    B = fake.stream(non_blocking=True)
    q = _alloc_on(s, B, 4 * MiB)
    assert q == large and fake.n_malloc_calls == calls
    assert fake.n_device_synchronize_calls == syncs + 1 and not fake.stream_busy(a)  # waited for A's kernel
    r = _alloc_on(s, B, 100_000)  # another class: A's 4 KiB chunk, carved again, no new chunk
    assert small & -(2 * MiB) == r & -(2 * MiB) and fake.n_malloc_calls == calls
    assert fake.n_device_synchronize_calls == syncs + 1  # one synchronisation took both back
    ms = s.managed_stats(0)
    assert ms.n_reclaims == 1 and ms.reclaimed_bytes == 4 * MiB + 2 * MiB and ms.reserved_bytes == 6 * MiB
    with B:
        s.raw_free(q)
        s.raw_free(r)
    assert s.stats(0).bytes_in_use == 0
    assert s.trim() == 6 * MiB and s.managed_stats(0).reserved_bytes == 0


@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_managed_gives_a_new_stream_with_a_destroyed_streams_handle_none_of_its_blocks_unsynchronised(fake, size):
    """The dead-stream pattern: CUDA may give a new stream the handle of a
    destroyed one while the destroyed one's kernel still runs, and the new
    stream's work is not ordered after it (measured on the H200; the fake
    always gives the handle back). An arena found by handle would hand B the
    block A's kernel still writes: the arena leaves with its stream."""
    s = cupy_memstrat.create("managed", backend=fake)
    for _ in range(3):
        p, q, B = dead_stream_allocation(fake, s, size)
        assert q != p or fake.busy_destroyed_streams() == 0  # A's block only once A's kernel is done
        fake.device_synchronize(0)
        with B:
            s.raw_free(q)
        del B
        gc.collect()
    assert s.stats(0).bytes_in_use == 0 and s.managed_stats(0).reserved_bytes <= 2 * max(size, 2 * MiB)


def test_managed_keeps_a_live_streams_cache_and_synchronises_nothing(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    with A:
        s.raw_free(s.raw_malloc(4 * MiB))
    syncs = fake.n_device_synchronize_calls
    _alloc_on(s, B, 4 * MiB)  # A lives: its block stays A's, B gets a new one
    assert fake.n_malloc_calls == 2 and fake.n_device_synchronize_calls == syncs
    assert _alloc_on(s, A, 4 * MiB) and fake.n_malloc_calls == 2


def test_managed_takes_a_dead_streams_partly_used_chunk_back_once_its_last_block_is_freed(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    A = fake.stream(non_blocking=True)
    keep, drop = _alloc_on(s, A, 4096), _alloc_on(s, A, 4096)
    with A:
        s.raw_free(drop)
    del A
    gc.collect()
    B = fake.stream(non_blocking=True)
    syncs = fake.n_device_synchronize_calls
    first = _alloc_on(s, B, 4096)  # A's chunk holds a live block: not B's, a new chunk
    assert first & -(2 * MiB) != keep & -(2 * MiB) and fake.n_malloc_calls == 2
    assert fake.n_device_synchronize_calls == syncs  # nothing to take back: nothing to wait for
    _alloc_on(s, B, 100_000)
    assert fake.n_device_synchronize_calls == syncs and fake.n_malloc_calls == 3
    s.raw_free(keep)  # the collector frees the last one, long after A died
    got = _alloc_on(s, B, 300_000)  # a miss: A's chunk, now wholly free, is taken back
    assert got & -(2 * MiB) == keep & -(2 * MiB) and fake.n_malloc_calls == 3
    assert fake.n_device_synchronize_calls == syncs + 1 and s.managed_stats(0).n_reclaims == 1
    _alloc_on(s, B, 600_000)
    assert fake.n_device_synchronize_calls == syncs + 1  # A's arena is forgotten: nothing to wait for


def test_managed_takes_back_a_dead_streams_wholly_free_chunk_and_leaves_its_partly_used_one(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    A = fake.stream(non_blocking=True)
    blocks = [_alloc_on(s, A, 4096) for _ in range(600)]  # two chunks of the 4 KiB class: 512 + 88
    first, second = {p & -(2 * MiB) for p in blocks[:512]}, {p & -(2 * MiB) for p in blocks[512:]}
    assert len(first) == len(second) == 1 and first != second
    keep = blocks.pop()  # in the second chunk
    with A:
        for p in blocks:
            s.raw_free(p)
    del A
    gc.collect()
    B = fake.stream(non_blocking=True)
    syncs = fake.n_device_synchronize_calls
    got = _alloc_on(s, B, 4096)
    assert got & -(2 * MiB) in first and fake.n_malloc_calls == 2  # the wholly free chunk, no new one
    assert fake.n_device_synchronize_calls == syncs + 1 and s.managed_stats(0).reclaimed_bytes == 2 * MiB
    s.raw_free(keep)  # the second chunk's last block
    more = [_alloc_on(s, B, 4096) for _ in range(512)]  # B's chunk is full after 511 more: a miss
    assert {p & -(2 * MiB) for p in more} == first | second and fake.n_malloc_calls == 2
    assert s.managed_stats(0).reclaimed_bytes == 4 * MiB and fake.n_device_synchronize_calls == syncs + 2
    assert len(set(more) | {got}) == 513  # no block handed out twice


def test_managed_memory_stays_bounded_when_every_run_makes_new_streams(fake):
    """The multi-stream workload of ``bench workloads``: four new streams a run,
    each allocating and freeing; a result array per stream outlives its stream."""
    s = cupy_memstrat.create("managed", backend=fake)
    reserved = []
    for _ in range(20):
        streams = [fake.stream(non_blocking=True) for _ in range(4)]
        totals = []
        for st in streams:
            with st:
                totals.append(s.raw_malloc(8))
                for _ in range(4):
                    p, q = s.raw_malloc(8 * MiB), s.raw_malloc(8 * MiB)
                    fake.launch(st)
                    s.raw_free(p)
                    s.raw_free(q)
        del streams, st
        gc.collect()
        fake.finish()
        for t in totals:
            s.raw_free(t)
        reserved.append(s.managed_stats(0).reserved_bytes)
    assert reserved[-1] == reserved[1] <= reserved[0] + 2 * MiB, reserved
    assert s.stats(0).bytes_in_use == 0


@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_managed_tells_per_thread_default_streams_apart(hot_path, size):
    """Pattern 3: CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1, every thread's stream
    has the handle cudaStreamPerThread; CuPy keys its arenas per thread (cupy#5069)."""
    fake = FakeBackend(memory="1GiB", per_thread_default_stream=True)
    s = cupy_memstrat.create("managed", backend=fake)
    assert fake.current_stream().ptr == C.STREAM_PER_THREAD
    got = {}

    def first():
        got["p"] = s.raw_malloc(size)
        fake.launch(fake.current_stream())  # this thread's stream stays busy
        s.raw_free(got["p"])

    t = threading.Thread(target=first)
    t.start()
    t.join()
    q = s.raw_malloc(size)  # the main thread's own per-thread stream
    assert q != got["p"]


def test_a_block_freed_by_another_thread_goes_back_to_its_threads_arena(hot_path):
    fake = FakeBackend(memory="1GiB", per_thread_default_stream=True)
    s = cupy_memstrat.create("managed", backend=fake)
    p = s.raw_malloc(4096)
    t = threading.Thread(target=s.raw_free, args=(p,))  # the collector may free in any thread
    t.start()
    t.join()
    assert s.raw_malloc(4096) == p  # back in the main thread's arena


def test_async_frees_another_threads_per_thread_stream_block_after_a_synchronisation(hot_path):
    fake = FakeBackend(memory="1GiB", per_thread_default_stream=True)
    s = cupy_memstrat.create("async", backend=fake)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("p", s.raw_malloc(MiB)))
    t.start()
    t.join()
    syncs = fake.n_device_synchronize_calls
    s.raw_free(got["p"])  # this thread's cudaStreamPerThread is another stream
    assert fake.n_device_synchronize_calls == syncs + 1
    assert s.pool_stats(0).n_frees_after_stream_destroyed == 1
    assert s.stats(0).n_live == 0


def test_trim_gives_back_every_streams_cache(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    streams = [fake.stream() for _ in range(3)]
    ptrs = [_alloc_on(s, st, 4 * MiB) for st in streams]
    for p in ptrs:
        s.raw_free(p)
    assert s.managed_stats(0).cached_bytes == 12 * MiB
    assert s.trim() == 12 * MiB
    assert s.managed_stats(0).reserved_bytes == 0


# -- record_stream ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", POOLING)
def test_record_stream_keeps_a_block_from_its_own_stream_until_the_other_is_done(fake, name):
    """cupy#8068: allocated on A, read by a long kernel on B, dropped on A,
    the next allocation on A. With record_stream(x, B) it gets another block
    until B's work queued at the free is done."""
    s = cupy_memstrat.create(name, backend=fake)
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    p = _alloc_on(s, A, MiB)
    assert s.record_stream(p, B) is True
    fake.launch(B)  # B still reads p
    with A:
        s.raw_free(p)
    assert s.stats(0).n_live == 0  # freed for the program: in use drops at once
    q = _alloc_on(s, A, MiB)
    assert q != p
    fake.finish(B)
    r = _alloc_on(s, A, MiB)  # B is done: the block is A's again
    assert r == p or name == "pool"  # (the fake's pool strategy caches nothing: p went back to CUDA)
    for x in (q, r):
        with A:
            s.raw_free(x)
    assert s.stats(0).n_live == 0 and not s.deferred.pending


@pytest.mark.parametrize("name", POOLING)
def test_without_record_stream_the_same_stream_reuses_the_block_at_once(fake, name):
    """The control: what record_stream changes (every pool, CuPy's included)."""
    if name == "pool":
        pytest.skip("the fake's pool strategy caches nothing (CuPy's pool needs CUDA)")
    s = cupy_memstrat.create(name, backend=fake)
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    p = _alloc_on(s, A, MiB)
    fake.launch(B)
    with A:
        s.raw_free(p)
    assert _alloc_on(s, A, MiB) == p


def test_record_stream_on_device_has_nothing_to_do(fake):
    s = cupy_memstrat.create("device", backend=fake)
    p = s.raw_malloc(MiB)
    assert s.record_stream(p, fake.stream()) is False  # cudaFree synchronises the device
    s.raw_free(p)
    assert not fake.is_allocated(p)


@pytest.mark.parametrize("name", POOLING)
def test_trim_and_close_give_back_blocks_waiting_for_recorded_streams(fake, name):
    s = cupy_memstrat.create(name, backend=fake)
    B = fake.stream()
    p = s.raw_malloc(MiB)
    s.record_stream(p, B)
    fake.launch(B)
    s.raw_free(p)
    assert len(s.deferred.pending) == 1
    s.trim()  # synchronises: B's work is done
    assert not s.deferred.pending
    s.close()


def test_a_destroyed_recorded_stream_makes_the_free_synchronise(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    B = fake.stream()
    p = s.raw_malloc(MiB)
    s.record_stream(p, B)
    B.destroy()
    syncs = fake.n_device_synchronize_calls
    s.raw_free(p)  # no event can be recorded on B: wait for the whole device instead
    assert fake.n_device_synchronize_calls > syncs and not s.deferred.pending
    assert s.raw_malloc(MiB) == p


def test_record_stream_under_the_checks_counts_the_stream_as_ordered(fake):
    from cupy_memstrat import checks

    s = cupy_memstrat.create("managed", backend=fake, check="streams", on_finding="record")
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    mark = checks.mark()

    def pattern(record):
        with A:
            p = s.raw_malloc(MiB)
        with B:  # B is current at an allocation: the check sees it
            s.raw_free(s.raw_malloc(512))
        if record:
            s.record_stream(p, B)
        fake.launch(B)
        with A:
            s.raw_free(p)
        fake.finish()

    pattern(record=False)
    assert [f.kind for f in checks.findings(mark)] == ["cross-stream reuse"]
    mark = checks.mark()
    pattern(record=True)
    assert checks.findings(mark) == []


# -- the public record_stream: arrays, streams, bad input -----------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_record_stream_on_arrays(restore_cupy_allocator, fake, name):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use(name, backend=fake)
    x = cupy.empty(1000, dtype=cupy.float32)
    B = fake.stream()
    assert cupy_memstrat.record_stream(x, B) is (name != "device")
    assert cupy_memstrat.record_stream(x[10:], B) is (name != "device")  # a view marks its allocation
    if name != "device":
        assert list(s.deferred.recorded) == [x.data.mem.ptr] and len(s.deferred.recorded[x.data.mem.ptr]) == 1
    assert cupy_memstrat.record_stream(cupy.empty(0), B) is False  # nothing allocated


def test_record_stream_refuses_bad_input_and_changes_nothing(restore_cupy_allocator, hot_path):
    cupy = restore_cupy_allocator
    fake = FakeBackend(devices=2, memory="1GiB")
    s = cupy_memstrat.use("managed", backend=fake)
    x = cupy.empty(1000, dtype=cupy.float32)
    B = fake.stream(0)
    with pytest.raises(TypeError, match="array: expected a CuPy array or a cupy.cuda.MemoryPointer, got list"):
        cupy_memstrat.record_stream([1, 2], B)
    with pytest.raises(TypeError, match=r"stream: expected a cupy.cuda.Stream \(or ExternalStream\), got int 7"):
        cupy_memstrat.record_stream(x, 7)
    with pytest.raises(TypeError, match="stream: expected a cupy.cuda.Stream .*got str 'B'"):
        cupy_memstrat.record_stream(x, "B")
    other = fake.stream(1)
    with pytest.raises(ValueError, match="is on device 1, but the array's memory is on device 0"):
        cupy_memstrat.record_stream(x, other)
    dead = fake.stream(0)
    dead.destroy()
    with pytest.raises(ValueError, match=r"is not a live stream on device 0: it was destroyed"):
        cupy_memstrat.record_stream(x, dead)
    assert s.deferred.recorded == {} and s.stats(0).n_live == 1


def test_record_stream_of_memory_no_strategy_owns_returns_false(restore_cupy_allocator, fake):
    s = cupy_memstrat.create("managed", backend=fake)  # made, never installed nor used
    from cupy.cuda import memory

    mp = memory.MemoryPointer(memory.UnownedMemory(0x1234000, 512, None, 0), 0)
    assert cupy_memstrat.record_stream(mp, fake.stream()) is False
    assert s.deferred.recorded == {}


# -- out of memory: CuPy's order ------------------------------------------------------------------------

class _HeldByACycle:
    """A block freed only when the garbage collector breaks this object's cycle."""

    def __init__(self, s, size):
        self.me, self.s, self.ptr = self, s, s.raw_malloc(size)

    def __del__(self):
        self.s.raw_free(self.ptr)


@pytest.mark.parametrize("name", ALL)
def test_arrays_held_by_reference_cycles_are_collected_before_out_of_memory(fake, name):
    """12 x 20 GiB in cycles with gc.disable() on an H200 runs under CuPy's
    pool; here 4 x 300 MiB on a 1 GiB device."""
    s = cupy_memstrat.create(name, backend=fake)
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            _HeldByACycle(s, 300 * MiB)
        st = s.stats(0)
        assert st.n_failed == 0 and st.n_oom_recoveries == 1 and st.n_live == 1
    finally:
        gc.enable()
        gc.collect()
    assert fake.peek_last_error() == C.ERROR_SUCCESS


@pytest.mark.parametrize("name", ALL)
def test_out_of_memory_gives_other_strategies_caches_back_first(fake, name):
    other = cupy_memstrat.create("async", backend=fake)
    other.raw_free(other.raw_malloc(600 * MiB))  # 608 MiB held by another strategy's pool
    assert other.pool_stats(0).reserved_bytes == 608 * MiB
    s = cupy_memstrat.create(name, backend=fake)
    p = s.raw_malloc(700 * MiB)
    assert other.pool_stats(0).reserved_bytes == 0 and s.stats(0).n_oom_recoveries == 1
    s.raw_free(p)
    other.close()


@pytest.mark.parametrize("name", ALL)
def test_a_hopeless_request_still_fails_clearly(fake, name):
    s = cupy_memstrat.create(name, backend=fake)
    p = s.raw_malloc(MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="out of memory allocating 8.0 GiB"):
        s.raw_malloc(8 << 30)
    st = s.stats(0)
    assert st.n_failed == 1 and st.n_live == 1 and st.n_oom_recoveries == 0
    assert fake.peek_last_error() == C.ERROR_SUCCESS
    s.raw_free(p)


# -- using() lets go ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", POOLING)
def test_using_lets_go_of_its_strategy_when_the_last_array_that_outlived_it_dies(restore_cupy_allocator, name):
    cupy = restore_cupy_allocator
    fake = FakeBackend(memory="1GiB")

    for _ in range(5):
        with cupy_memstrat.using(name, backend=fake) as s:
            x = cupy.empty(MiB, dtype=cupy.uint8)
        assert s in REACHABLE  # x still lives
        del x
        assert s not in REACHABLE  # closed: out of reach of nothing, holding nothing
    assert fake.used_bytes(0) == 0  # no pool, chunk or cache left behind


def test_using_a_strategy_object_leaves_it_open(restore_cupy_allocator, fake):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.create("async", backend=fake)
    with cupy_memstrat.using(s):
        x = cupy.empty(MiB, dtype=cupy.uint8)
    del x
    assert s.pool_stats(0).handle != 0  # not closed: it belongs to the caller
    s.close()


# -- block sizes as CuPy's pool reports them -------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_mem_size_is_rounded_as_cupys_pool_rounds_it(restore_cupy_allocator, fake, name):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use(name, backend=fake)
    x = cupy.empty(1000, dtype=cupy.uint8)
    assert x.data.mem.size == (1000 if name == "device" else 1024)
    assert s.stats(0).bytes_in_use == x.data.mem.size


def test_device_rounds_like_cupys_pool_when_asked(restore_cupy_allocator, fake):
    cupy = restore_cupy_allocator
    cupy_memstrat.use("device:granule=512", backend=fake)
    assert cupy.empty(1000, dtype=cupy.uint8).data.mem.size == 1024


@pytest.mark.parametrize("bad", [0, 3, 1000, "4MiB", "1%", -512, "x"])
def test_device_refuses_a_bad_granule(bad):
    with pytest.raises((ValueError, TypeError), match="granule"):
        cupy_memstrat.validate("device", granule=bad)


def test_stream_key_is_cupys_stream_identifier(hot_path):
    fake = FakeBackend(memory="1GiB")
    s = cupy_memstrat.create("device", backend=fake)
    assert s.stream_key() == 0
    st = fake.stream()
    with st:
        assert s.stream_key() == st.ptr
    ptds = FakeBackend(memory="1GiB", per_thread_default_stream=True)
    s2 = cupy_memstrat.create("device", backend=ptds)
    keys = []
    t = threading.Thread(target=lambda: keys.append(s2.stream_key()))
    t.start()
    t.join()
    assert s2.stream_key() == -threading.get_ident() != keys[0] < 0


@pytest.mark.parametrize("name", POOLING)
@pytest.mark.parametrize("when", ["inside", "after"])
def test_record_stream_with_using_gives_everything_back(restore_cupy_allocator, hot_path, name, when):
    """A new user's trial found the block of a recorded array kept for good under async and pool
    once using() (or close()) had let the strategy go: 64 MiB per iteration."""
    cupy = restore_cupy_allocator
    fake = FakeBackend(memory="1GiB")
    for _ in range(3):
        B = fake.stream()
        with cupy_memstrat.using(name, backend=fake) as s:
            x = cupy.empty(64 * MiB, dtype=cupy.uint8)
            fake.launch(B)
            assert cupy_memstrat.record_stream(x, B) is True
            if when == "inside":
                del x
        if when == "after":
            del x
        fake.finish(B)
        assert not s.deferred.pending
    assert fake.used_bytes(0) == 0


def test_async_keeps_its_reserved_peak_after_close(fake):
    s = cupy_memstrat.create("async", backend=fake)
    s.raw_free(s.raw_malloc(64 * MiB))
    peak = s.stats(0).peak_bytes_reserved
    s.close()
    assert peak >= 64 * MiB and s.stats(0).peak_bytes_reserved == peak
    s.reset_peak(0)
    assert s.stats(0).peak_bytes_reserved == 0


# -- corner cases: closed, reinstalled and recorded strategies ---------------------------------------

def test_a_closed_strategy_installed_again_is_reachable_again(restore_cupy_allocator, hot_path):
    """use(s) after using() had closed s left it out of reach of record_stream and of other
    strategies' out-of-memory recovery."""
    cupy = restore_cupy_allocator
    fake = FakeBackend(memory="1GiB")
    with cupy_memstrat.using("managed", backend=fake) as s:
        del_me = cupy.empty(10)
        del del_me

    assert s not in REACHABLE
    cupy_memstrat.use(s)
    x = cupy.empty(1 << 18, dtype=cupy.float32)
    cupy_memstrat.use("device", backend=fake)
    assert s in REACHABLE  # reachable again: record_stream finds it, recovery trims it
    B = fake.stream()
    assert s.record_stream(x.data.mem.ptr, B) is True


def test_using_a_strategy_object_with_checks_keeps_the_object_open(restore_cupy_allocator, fake):
    cupy = restore_cupy_allocator
    with cupy_memstrat.using("async", backend=fake) as s:
        x = cupy.empty(MiB, dtype=cupy.uint8)
    with cupy_memstrat.using(s, check="streams"):
        pass
    del x
    assert s.pool_stats(0).handle != 0  # taken back by the caller: not let go
    s.close()


def test_flush_gives_back_only_what_was_pending_before_its_synchronisation(fake):
    """A block another thread defers while trim() synchronises waits for its own events."""
    s = cupy_memstrat.create("managed", backend=fake)
    B = fake.stream()
    p1, p2 = s.raw_malloc(MiB), s.raw_malloc(MiB)
    for p in (p1, p2):
        s.record_stream(p, B)
    fake.launch(B)
    s.raw_free(p1)
    sync = fake.device_synchronize

    def sync_then_other_thread_frees(device):
        sync(device)
        fake.launch(B)  # more work on B, then p2 freed, after the synchronisation
        s.raw_free(p2)

    fake.device_synchronize = sync_then_other_thread_frees
    s.trim()
    fake.device_synchronize = sync
    assert [e[1] for e in s.deferred.pending] == [p2]  # still waiting for B
    assert s.raw_malloc(MiB) not in (p2,)


@pytest.mark.parametrize("bad, err", [(None, TypeError), ("abc", TypeError), (1.5, TypeError), (True, TypeError)])
def test_strategy_record_stream_refuses_a_bad_pointer(fake, bad, err):
    s = cupy_memstrat.create("managed", backend=fake)
    with pytest.raises(err, match="ptr: expected an int pointer"):
        s.record_stream(bad, fake.stream())
    assert s.deferred.recorded == {}


class _Duck:
    """Has a stream's attributes, is no stream (as a MemoryPointer has .ptr and .device_id)."""

    def __init__(self, ptr, device_id=0):
        self.ptr, self.device_id = ptr, device_id


class _Handle(_Duck):
    simulated_stream = True  # a stream of the simulated GPU, with a bad handle


@pytest.mark.parametrize("stream, err, match", [
    (None, TypeError, "expected a cupy.cuda.Stream"),
    (7, TypeError, "expected a cupy.cuda.Stream"),
    ("B", TypeError, "expected a cupy.cuda.Stream"),
    (_Duck(5), TypeError, r"expected a cupy.cuda.Stream \(or ExternalStream\), got test_streams._Duck$"),
    (_Handle(True), TypeError, r"whose \.ptr is an int handle"),
    (_Handle(-7), ValueError, "which is no cudaStream_t"),
    (_Handle(1 << 70), ValueError, "which is no cudaStream_t"),
])
def test_both_record_streams_refuse_a_bad_stream(restore_cupy_allocator, fake, stream, err, match):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use("managed", backend=fake)
    x = cupy.empty(1000, dtype=cupy.float32)
    with pytest.raises(err, match=match):
        cupy_memstrat.record_stream(x, stream)
    with pytest.raises(err, match=match):
        s.record_stream(x.data.mem.ptr, stream)
    assert s.deferred.recorded == {}


@pytest.mark.parametrize("name", ["managed", "async", "device"])
def test_an_arrays_memory_is_refused_as_a_stream(restore_cupy_allocator, fake, name):
    """A MemoryPointer has .ptr and .device_id as a stream has: recorded as a stream, its device
    pointer was used as a cudaStream_t and crashed the process at the free (pool and async on an
    H200; tests/gpu/test_streams_gpu.py)."""
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use(name, backend=fake)
    x, y = cupy.empty(1000, dtype=cupy.float32), cupy.empty(1000, dtype=cupy.float32)
    for not_a_stream in (y.data, y, y.data.mem):
        what = f"got {type(not_a_stream).__module__}.{type(not_a_stream).__qualname__}$"
        with pytest.raises(TypeError, match="stream: expected a cupy.cuda.Stream .*" + what):
            cupy_memstrat.record_stream(x, not_a_stream)
        with pytest.raises(TypeError, match="stream: expected a cupy.cuda.Stream .*" + what):
            s.record_stream(x.data.mem.ptr, not_a_stream)
    assert s.deferred.recorded == {} and s.stats().n_live == 2


def test_strategy_record_stream_refuses_another_devices_or_a_destroyed_stream(fake2):
    s = cupy_memstrat.create("managed", backend=fake2)
    p = s.raw_malloc(MiB)
    with pytest.raises(ValueError, match="is on device 1, but the block"):
        s.record_stream(p, fake2.stream(1))
    dead = fake2.stream(0)
    dead.destroy()
    with pytest.raises(ValueError, match="was destroyed"):
        s.record_stream(p, dead)
    assert s.deferred.recorded == {}


def test_an_empty_view_records_nothing(restore_cupy_allocator, fake):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use("managed", backend=fake)
    x = cupy.empty(10, dtype=cupy.float32)
    assert cupy_memstrat.record_stream(x[5:5], fake.stream()) is False and s.deferred.recorded == {}


@pytest.mark.parametrize("bad", ["512.9", "1.99", "2.5"])
def test_device_refuses_a_fractional_granule(bad):
    with pytest.raises(ValueError, match="granule: expected a whole number of bytes"):
        cupy_memstrat.validate("device", granule=bad)


def test_managed_keeps_the_cache_of_a_live_stream_wrapped_anew_at_every_step(fake):
    """cupy.cuda.ExternalStream(torch_stream.cuda_stream) made at every step: the wrapper dies,
    the stream lives. Its cache stays under the handle (as CuPy's pool keys it): reused at
    once, no synchronisation, no new chunk."""
    s = cupy_memstrat.create("managed", backend=fake)
    owner = fake.stream(non_blocking=True)  # e.g. a PyTorch stream, alive all along
    seen = set()
    for _ in range(5):
        w = fake.external_stream(owner)
        assert not fake.stream_owns_handle(w) and w.ptr == owner.ptr
        p = _alloc_on(s, w, 4 * MiB)
        q = _alloc_on(s, w, 4096)
        fake.launch(w)
        with w:
            s.raw_free(p)
            s.raw_free(q)
        seen.add((p, q))
        del w
        gc.collect()
    assert len(seen) == 1 and fake.n_device_synchronize_calls == 0 and fake.n_malloc_calls == 2
    assert s.managed_stats(0).n_reclaims == 0


def test_managed_after_trim_still_takes_back_a_dead_streams_chunk_freed_later(fake):
    """trim() between two reclaims changes a dead arena's free bytes; a chunk of it that
    becomes wholly free afterwards is still taken back at the next miss."""
    s = cupy_memstrat.create("managed", backend=fake)
    A = fake.stream(non_blocking=True)
    with A:
        x1, x2 = s.raw_malloc(4096), s.raw_malloc(4096)
        y1, y2 = s.raw_malloc(8192), s.raw_malloc(8192)
        s.raw_free(x2)
        s.raw_free(y2)
    del A
    gc.collect()
    B = fake.stream(non_blocking=True)
    _alloc_on(s, B, 100_000)  # a miss: nothing of A's wholly free yet
    s.raw_free(x1)
    assert s.trim() == 2 * MiB  # A's 4 KiB chunk
    s.raw_free(y1)  # A's 8 KiB chunk now wholly free
    calls = fake.n_malloc_calls
    got = _alloc_on(s, B, 8192)  # B has no 8 KiB slot: A's chunk, after one synchronisation
    assert got & -(2 * MiB) == y1 & -(2 * MiB) and fake.n_malloc_calls == calls
    assert s.managed_stats(0).n_reclaims == 1


def test_fake_events_recorded_on_a_destroyed_stream_wait_for_its_own_work(fake):
    """A new stream that gets a destroyed stream's handle does not finish the old one's
    events: record_stream's block stays held until the old stream's kernel is done."""
    s = cupy_memstrat.create("managed", backend=fake)
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    p = _alloc_on(s, A, 4096)
    s.record_stream(p, B)
    fake.launch(B)  # B's kernel reads p
    with A:
        s.raw_free(p)
    b = B.ptr
    del B
    C = stream_on_handle(fake, b)
    fake.launch(C)
    C.synchronize()
    assert _alloc_on(s, A, 4096) != p and fake.busy_destroyed_streams() == 1
    fake.device_synchronize(0)
    assert _alloc_on(s, A, 4096) == p


def test_cupys_own_stream_objects_are_streams():
    """CuPy's Stream and ExternalStream (importable without a GPU: Stream.null, an ExternalStream of
    handle 0 made without CUDA) pass the type check; its first version asked for a class CuPy 14 does
    not have, and refused every real stream on an H200."""
    cs = pytest.importorskip("cupy.cuda.stream", reason="CuPy is not installed")
    from cupy_memstrat.strategies.base import check_stream

    check_stream(cs.Stream.null)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14: use Stream.from_external
        ext = cs.ExternalStream(0)
    check_stream(ext)
