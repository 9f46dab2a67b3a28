"""The ``async`` strategy on the fake backend: pools, stream-ordered frees,
release threshold, trim, OOM recovery, several devices, bad input."""

import gc
import warnings

import pytest

import cupy_memstrat
from cupy_memstrat import backends as C
from cupy_memstrat.testing import FakeBackend
from helpers import assert_sole_live_origin, run_threads

MiB = 1 << 20


@pytest.fixture
def s(fake):
    return cupy_memstrat.create("async", backend=fake)


def reserved(fake, s, device=0):
    return fake.pool_get_attribute(s.pool_stats(device).handle, C.POOL_ATTR_RESERVED_MEM_CURRENT)


def test_spec_string_and_keywords_mean_the_same():
    assert cupy_memstrat.validate("async:release_threshold=4GiB,pool=own") == cupy_memstrat.validate(
        "async", release_threshold="4GiB", pool="own"
    )
    assert cupy_memstrat.validate("malloc_async")[0] == "async"


def test_own_pool_is_made_on_first_use_and_leaves_the_devices_pools_alone(fake):
    default, current = fake.device_default_pool(0), fake.device_current_pool(0)
    s = cupy_memstrat.create("async", backend=fake)
    assert s.pool_stats(0).handle == 0  # nothing made before it is needed
    p = s.raw_malloc(1000)
    ps = s.pool_stats(0)
    assert ps.handle not in (0, default, current)
    assert fake.device_default_pool(0) == default and fake.device_current_pool(0) == current
    assert ps.release_threshold == C.RELEASE_THRESHOLD_MAX  # own pool: keep freed memory
    assert ps.reserved_bytes == 32 * MiB  # the pool reserves in 32 MiB steps
    s.raw_free(p)


@pytest.mark.parametrize("kind", ["default", "current"])
def test_shared_pools_are_used_as_they_are(fake, kind):
    other = fake.pool_create(0)
    fake.device_set_pool(0, other)  # what CuPy's MemoryAsyncPool() does
    fake.pool_set_attribute(other, C.POOL_ATTR_RELEASE_THRESHOLD, 123)
    s = cupy_memstrat.create("async", backend=fake, pool=kind)
    s.raw_free(s.raw_malloc(10))
    expect = fake.device_default_pool(0) if kind == "default" else other
    assert s.pool_stats(0).handle == expect
    assert fake.pool_get_attribute(other, C.POOL_ATTR_RELEASE_THRESHOLD) == 123  # untouched


def test_a_given_release_threshold_is_set_on_a_shared_pool(fake):
    s = cupy_memstrat.create("async", backend=fake, pool="default", release_threshold="64MiB")
    s.raw_free(s.raw_malloc(10))
    assert fake.pool_get_attribute(fake.device_default_pool(0), C.POOL_ATTR_RELEASE_THRESHOLD) == 64 * MiB


@pytest.mark.parametrize(
    "options, match",
    [
        ({"release_threshold": -1}, "release_threshold"),
        ({"release_threshold": "lots"}, "release_threshold.*'lots'"),
        ({"release_threshold": "2GiB"}, "release_threshold=2147483648 bytes.*above device 0's memory"),
        ({"release_threshold": "150%"}, "release_threshold"),
        ({"max_size": "-5MiB"}, "max_size"),
        ({"max_size": "3GB"}, "max_size=3000000000 bytes.*above device 0"),
        ({"pool": "mine"}, "pool.*'own', 'default', 'current'.*'mine'"),
        ({"pool": "default", "max_size": "1GiB"}, "max_size.*only to pool='own'"),
    ],
)
def test_bad_options_are_refused_at_creation(fake, options, match):
    keep = cupy_memstrat.create("async", backend=fake)
    p = keep.raw_malloc(4096)
    with pytest.raises(ValueError, match=match):
        cupy_memstrat.create("async", backend=fake, **options)
    assert keep.stats(0).n_live == 1 and fake.is_allocated(p)  # nothing lost
    keep.raw_free(p)


def test_percentages_resolve_against_device_memory(fake):
    s = cupy_memstrat.create("async", backend=fake, release_threshold="25%", max_size="50%")
    s.raw_free(s.raw_malloc(10))
    ps = s.pool_stats(0)
    assert ps.release_threshold == 256 * MiB and ps.max_size == 512 * MiB


def test_a_device_without_pool_support_is_refused():
    with pytest.raises(RuntimeError, match="does not support stream-ordered memory pools"):
        cupy_memstrat.create("async", backend=FakeBackend(memory_pools_supported=0))


def test_a_block_is_freed_on_the_stream_it_was_allocated_on(fake, s):
    a, b = fake.stream(), fake.stream()
    with a:
        p = s.raw_malloc(4096)
    with b:
        s.raw_free(p)  # stream b is current: the free must still be ordered on a
        q = s.raw_malloc(4096)
    assert q != p  # b may not reuse a's block before a sync orders the free
    with a:
        r = s.raw_malloc(4096)
    assert r == p  # a reuses it at once, in stream order
    for x in (q, r):
        s.raw_free(x)
    st = s.stats(0)
    assert st.n_live == 0 and st.bytes_in_use == 0


def test_after_a_sync_another_stream_reuses_the_block(fake):
    s = cupy_memstrat.create("async", backend=fake, cache=0)  # the CUDA pool's own reuse
    a, b = fake.stream(), fake.stream()
    with a:
        p = s.raw_malloc(4096)
        s.raw_free(p)
    a.synchronize()
    with b:
        assert s.raw_malloc(4096) == p


def test_free_after_the_stream_was_destroyed_is_safe_and_counted(fake, s):
    st = fake.stream()
    with st:
        p = s.raw_malloc(1 * MiB)
    del st  # the stream object dies: its handle is destroyed (as cupy.cuda.Stream does)
    gc.collect()
    syncs = fake.n_device_synchronize_calls
    s.raw_free(p)  # the fake fails any use of a destroyed handle: this would raise
    assert fake.n_device_synchronize_calls == syncs + 1
    assert s.pool_stats(0).n_frees_after_stream_destroyed == 1
    assert s.pool_stats(0).used_bytes == 0 and s.stats(0).n_live == 0
    assert fake.peek_last_error() == C.ERROR_SUCCESS


@pytest.mark.parametrize("cache", [0, None])
def test_a_handle_cuda_refuses_is_treated_as_destroyed(fake, cache):
    s = cupy_memstrat.create("async", backend=fake, cache=cache)
    st = fake.stream()
    with st:
        p = s.raw_malloc(1000)
    st.destroy()  # e.g. an ExternalStream whose owner destroyed the handle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.raw_free(p)  # cache=0: freed at once; else kept in st's cache ...
        s.trim()  # ... until a trim, which finds the handle refused
    assert s.pool_stats(0).n_frees_after_stream_destroyed == 1 and s.pool_stats(0).used_bytes == 0


def test_default_threshold_keeps_memory_and_zero_releases_it_at_sync(fake):
    keep = cupy_memstrat.create("async", backend=fake)
    give = cupy_memstrat.create("async", backend=fake, release_threshold=0)
    for strat in (keep, give):
        strat.raw_free(strat.raw_malloc(64 * MiB))
    fake.device_synchronize(0)
    assert reserved(fake, keep) == 64 * MiB
    assert reserved(fake, give) == 0
    assert keep.stats(0).bytes_reserved == 64 * MiB and keep.stats(0).bytes_in_use == 0


def test_trim_releases_idle_memory_down_to_keep_bytes(fake, s):
    ptrs = [s.raw_malloc(64 * MiB) for _ in range(3)]
    for p in ptrs:
        s.raw_free(p)
    assert reserved(fake, s) == 192 * MiB
    assert s.trim(keep_bytes="64MiB") == 128 * MiB
    assert reserved(fake, s) == 64 * MiB
    assert s.trim() == 64 * MiB and reserved(fake, s) == 0
    assert s.trim() == 0  # nothing left: harmless


def test_trim_never_releases_memory_in_use(fake, s):
    p = s.raw_malloc(40 * MiB)
    s.trim()
    assert reserved(fake, s) == 64 * MiB and fake.is_allocated(p)
    s.raw_free(p)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), ("x", ValueError), (1.5, TypeError)])
def test_trim_bad_keep_bytes(s, bad, exc):
    with pytest.raises(exc, match="keep_bytes"):
        s.trim(bad)


def test_trim_through_the_module_and_as_a_no_op_for_device(fake, restore_cupy_allocator):
    s = cupy_memstrat.use("async", backend=fake)
    s.raw_free(s.raw_malloc(64 * MiB))
    assert cupy_memstrat.trim() == 64 * MiB
    cupy_memstrat.use("device", backend=fake)
    assert cupy_memstrat.trim() == 0  # caches nothing: documented no-op
    with pytest.raises(ValueError, match="keep_bytes"):
        cupy_memstrat.trim("lots")


def test_a_pool_serves_a_larger_request_from_idle_blocks_without_recovery(fake_small):
    """As measured on the H200: idle pool memory of another size is reused."""
    fake = fake_small
    s = cupy_memstrat.create("async", backend=fake)
    with fake.stream():
        s.raw_free(s.raw_malloc(100 * MiB))  # idle in the pool
    ballast = fake.malloc(120 * MiB)
    s.raw_free(s.raw_malloc(120 * MiB))
    assert s.pool_stats(0).n_oom_recoveries == 0
    fake.free(ballast)


def test_oom_recovery_gives_the_cache_back_synchronizes_trims_and_retries(fake_small):
    fake = fake_small
    s = cupy_memstrat.create("async", backend=fake, cache="256MiB")
    s.raw_free(s.raw_malloc(100 * MiB))  # cached: still used memory to the pool
    ballast = fake.malloc(120 * MiB)
    p = s.raw_malloc(120 * MiB)  # needs the cached block's memory back
    ps = s.pool_stats(0)
    assert ps.n_oom_recoveries == 1 and ps.cached_bytes == 0 and s.stats(0).n_failed == 0
    assert fake.peek_last_error() == C.ERROR_SUCCESS
    s.raw_free(p)
    fake.free(ballast)


def test_oom_recovery_trims_other_strategies_holding_memory_on_the_device(fake_small):
    fake = fake_small
    other = cupy_memstrat.create("async", backend=fake)  # e.g. the session's strategy
    other.raw_free(other.raw_malloc(150 * MiB))  # idle in its pool, kept (threshold max)
    s = cupy_memstrat.create("async", backend=fake, release_threshold=0)
    p = s.raw_malloc(150 * MiB)
    assert s.pool_stats(0).n_oom_recoveries == 1 and other.pool_stats(0).reserved_bytes == 0
    s.raw_free(p)
    other.close()


@pytest.fixture
def fake_small():
    return FakeBackend(memory="256MiB")


def test_oom_names_request_in_use_and_reserved_and_loses_nothing(fake_small):
    fake = fake_small
    s = cupy_memstrat.create("async", backend=fake)
    keep = s.raw_malloc(40 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        s.raw_malloc(300 * MiB)
    msg = str(info.value)
    assert "out of memory allocating 300.0 MiB" in msg and "after synchronizing the device and trimming" in msg
    assert "40.0 MiB in use" in msg and "reserved 64.0 MiB" in msg
    assert info.value.requested == 300 * MiB
    assert fake.peek_last_error() == C.ERROR_SUCCESS  # the sticky error is cleared
    assert fake.is_allocated(keep) and s.stats(0).n_failed == 1 and s.stats(0).n_live == 1
    s.raw_free(s.raw_malloc(10 * MiB))  # the next allocation works
    s.raw_free(keep)


def test_max_size_limits_the_pool_and_the_error_says_so(fake):
    s = cupy_memstrat.create("async", backend=fake, max_size="33MiB")  # acts as 64 MiB
    p = s.raw_malloc(60 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="max_size is 33.0 MiB"):
        s.raw_malloc(10 * MiB)
    s.raw_free(p)


def test_reset_peak_resets_the_pools_high_water_marks(fake, s):
    s.raw_free(s.raw_malloc(100 * MiB))
    s.trim()
    assert s.pool_stats(0).peak_reserved_bytes == 128 * MiB and s.stats(0).peak_bytes_reserved == 128 * MiB
    s.reset_peak(0)
    ps = s.pool_stats(0)
    assert ps.peak_reserved_bytes == 0 and ps.peak_used_bytes == 0
    assert s.stats(0).peak_bytes_in_use == 0


def test_pools_per_device_and_frees_on_the_owning_device(fake2):
    s = cupy_memstrat.create("async", backend=fake2, cache=0)  # every free goes to CUDA
    fake2.set_device(1)
    p = s.raw_malloc(4096)
    assert s.pool_stats(1).handle and s.pool_stats(0).handle == 0
    fake2.set_device(0)
    s.raw_free(p, 1)  # device 0 is current: must go to device 1's null stream
    fake2.set_device(1)
    assert s.raw_malloc(4096) == p  # device 1's null stream reuses it in stream order
    assert s.stats(1).n_allocs == 2 and s.stats(0).n_allocs == 0


def test_eight_threads_on_their_own_streams_keep_exact_counts(fake):
    s = cupy_memstrat.create("async", backend=fake)
    errors = []

    def work(i):
        try:
            with fake.stream():
                for k in range(300):
                    p = s.raw_malloc(256 * (1 + (i + k) % 7))
                    s.raw_free(p)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_threads(work, 8)
    assert not errors
    st = s.stats(0)
    assert st.n_allocs == st.n_frees == 2400 and st.bytes_in_use == 0 and st.n_live == 0
    ps = s.pool_stats(0)
    assert ps.used_bytes == ps.cached_bytes  # the dead streams' caches wait for a synchronisation
    s.trim()
    assert s.pool_stats(0).used_bytes == 0 == s.pool_stats(0).cached_bytes


def test_track_origins_records_where_and_frees_normally(fake):
    s = cupy_memstrat.create("async", backend=fake, track_origins=True)
    p = s.raw_malloc(1234)
    assert_sole_live_origin(s, __file__, 1234)
    s.raw_free(p)
    ps = s.pool_stats(0)
    assert s.live_allocations() == [] and ps.used_bytes == ps.cached_bytes == 1536


def test_invalid_free_is_warned_and_counted(s):
    with pytest.warns(cupy_memstrat.InvalidFreeWarning):
        s.raw_free(0xBAD)
    assert s.stats(0).n_invalid_frees == 1


def test_close_destroys_the_pool_and_cuda_releases_it_after_the_last_free(fake):
    idle = cupy_memstrat.create("async", backend=fake)
    idle.raw_free(idle.raw_malloc(10))
    idle.close()
    assert idle.pool_stats(0).handle == 0 and fake.mem_get_info(0)[0] == 1 << 30
    busy = cupy_memstrat.create("async", backend=fake)
    big, small = busy.raw_malloc(512 * MiB), busy.raw_malloc(1000)
    busy.raw_free(big)  # cached
    busy.close()
    busy.raw_free(small)  # a free after close still works and is counted ...
    assert busy.stats(0).n_live == 0 and busy.stats(0).n_frees == 2
    assert fake.mem_get_info(0)[0] == 1 << 30  # ... and nothing stays reserved
    fresh = cupy_memstrat.create("async", backend=fake)
    fresh.raw_free(fresh.raw_malloc(600 * MiB))


def test_zero_bytes_is_null_and_touches_no_pool(s):
    assert s.raw_malloc(0) == 0 and s.pool_stats(0).handle == 0


def test_default_stream_blocks_are_reused_without_a_cuda_call(fake, s):
    p = s.raw_malloc(100)
    s.raw_free(p)
    calls = fake.n_malloc_calls, fake.n_free_calls
    q = s.raw_malloc(500)  # same 512-byte class
    assert q == p and (fake.n_malloc_calls, fake.n_free_calls) == calls
    assert s.stats(0).bytes_in_use == 500 and s.pool_stats(0).cached_bytes == 0
    s.raw_free(q)
    assert s.pool_stats(0).cached_bytes == 512 and s.stats(0).bytes_in_use == 0


def test_each_stream_reuses_its_own_blocks_without_a_cuda_call_and_never_another_streams(fake, s):
    a, b = fake.stream(), fake.stream()
    with a:
        p = s.raw_malloc(100)
    s.raw_free(p)  # whatever stream is current: into a's cache
    assert s.pool_stats(0).cached_bytes == 512 and fake.n_free_calls == 0
    calls = fake.n_malloc_calls
    with b:
        q = s.raw_malloc(100)  # another stream: a new block, never a's
    assert q != p and fake.n_malloc_calls == calls + 1
    s.raw_malloc(100)  # the legacy default stream: neither
    assert fake.n_malloc_calls == calls + 2
    with a:
        assert s.raw_malloc(300) == p and fake.n_malloc_calls == calls + 2  # a's own, no CUDA call
    assert s.pool_stats(0).cached_bytes == 0 and s.stats(0).bytes_in_use == 300 + 100 + 100


def test_a_dead_streams_cached_blocks_wait_for_one_device_synchronisation(fake):
    s = cupy_memstrat.create("async", backend=fake, cache="8KiB")
    a = fake.stream()
    with a:
        p = s.raw_malloc(4096)
    s.raw_free(p)
    del a  # the stream dies with p cached: work it queued may still use p
    gc.collect()
    syncs = fake.n_device_synchronize_calls
    q = s.raw_malloc(4096)  # on the default stream: never p; p waits (4 KiB, below the limit)
    assert q != p and fake.n_device_synchronize_calls == syncs
    assert s.pool_stats(0).cached_bytes == 4096 and s.pool_stats(0).n_frees_after_stream_destroyed == 0
    for _ in range(2):  # two more dead streams' blocks: 12 KiB waiting, over the 8 KiB limit
        t = fake.stream()
        with t:
            s.raw_free(s.raw_malloc(4096))
        del t
    gc.collect()
    s.raw_free(s.raw_malloc(100))
    assert fake.n_device_synchronize_calls == syncs + 1  # one synchronisation frees them all
    st = s.pool_stats(0)
    assert st.n_frees_after_stream_destroyed == 3 and st.cached_bytes == 512  # the default stream's block
    s.raw_free(q)
    s.close()
    assert fake.mem_get_info(0)[0] == fake.mem_get_info(0)[1]


def test_trim_gives_back_every_streams_cache(fake, s):
    a = fake.stream()
    with a:
        s.raw_free(s.raw_malloc(MiB))
    d = fake.stream()
    with d:
        s.raw_free(s.raw_malloc(MiB))
    del d
    gc.collect()
    assert s.pool_stats(0).cached_bytes == 2 * MiB
    assert s.trim() == 32 * MiB and s.pool_stats(0).cached_bytes == 0
    assert s.pool_stats(0).n_frees_after_stream_destroyed == 1  # d's block, after a synchronisation
    with a:
        s.raw_free(s.raw_malloc(MiB))
    s.close()
    assert s.pool_stats(0).cached_bytes == 0 and fake.mem_get_info(0)[0] == fake.mem_get_info(0)[1]


def test_the_cache_keeps_at_most_its_bytes_per_size_class(fake):
    s = cupy_memstrat.create("async", backend=fake, cache="1MiB")
    ptrs = [s.raw_malloc(512 << 10) for _ in range(3)]
    for p in ptrs:
        s.raw_free(p)
    assert s.pool_stats(0).cached_bytes == 1 << 20 and fake.n_free_calls == 1
    big = s.raw_malloc(2 << 20)  # above the limit: never cached
    s.raw_free(big)
    assert s.pool_stats(0).cached_bytes == 1 << 20 and fake.n_free_calls == 2


def test_a_release_threshold_turns_the_cache_off_unless_asked(fake):
    off = cupy_memstrat.create("async", backend=fake, release_threshold="1GiB")
    off.raw_free(off.raw_malloc(4096))
    assert off.pool_stats(0).cached_bytes == 0  # the pool keeps freed memory itself: no cache of ours
    on = cupy_memstrat.create("async", backend=fake, release_threshold=0, cache="1MiB")
    on.raw_free(on.raw_malloc(4096))
    assert on.pool_stats(0).cached_bytes == 4096
    with pytest.raises(ValueError, match="cache"):
        cupy_memstrat.create("async", backend=fake, cache="2GiB")


def test_trim_and_close_give_the_cache_back(fake):
    s = cupy_memstrat.create("async", backend=fake)
    s.raw_free(s.raw_malloc(10 * MiB))
    assert s.pool_stats(0).cached_bytes == 10 * MiB
    assert s.trim() == 32 * MiB and s.pool_stats(0).cached_bytes == 0
    s.raw_free(s.raw_malloc(10 * MiB))
    s.close()
    assert fake.mem_get_info(0)[0] == 1 << 30


def test_a_cached_block_freed_while_another_device_is_current(fake2):
    s = cupy_memstrat.create("async", backend=fake2)
    fake2.set_device(1)
    p = s.raw_malloc(4096)
    fake2.set_device(0)
    s.raw_free(p, 1)
    assert s.pool_stats(1).cached_bytes == 4096 and s.pool_stats(0).cached_bytes == 0
    fake2.set_device(1)
    assert s.raw_malloc(4096) == p


def test_own_pools_grant_peer_devices_access(fake2):
    s = cupy_memstrat.create("async", backend=fake2)
    s.raw_free(s.raw_malloc(10))
    assert fake2.pool_access(s.pool_stats(0).handle) == {1}
    off = cupy_memstrat.create("async", backend=fake2, peer_access=False)
    off.raw_free(off.raw_malloc(10))
    assert fake2.pool_access(off.pool_stats(0).handle) == set()


@pytest.mark.parametrize("bad", [1.0, True])
def test_a_float_or_bool_equal_to_a_pointer_is_not_freed(fake, bad):
    s = cupy_memstrat.create("async", backend=fake)
    p = s.raw_malloc(1000)
    with pytest.warns(cupy_memstrat.InvalidFreeWarning):
        s.raw_free(float(p) if bad == 1.0 else bad)
    assert s.stats(0).n_live == 1 and s.stats(0).n_invalid_frees == 1
    s.raw_free(p)
    assert type(s.raw_malloc(1000)) is int


@pytest.mark.parametrize("hint", [-1, True, 7, "1"])
def test_a_bad_device_hint_still_frees_the_block_for_its_owner(fake2, hint):
    s = cupy_memstrat.create("async", backend=fake2, cache=0)
    fake2.set_device(1)
    p = s.raw_malloc(4096)
    fake2.set_device(0)
    s.raw_free(p, hint)
    assert not fake2.is_allocated(p) and s.stats(1).n_live == 0


def test_validate_refuses_max_size_with_a_shared_pool_as_create_does():
    with pytest.raises(ValueError, match="only to pool='own'"):
        cupy_memstrat.validate("async", max_size="1GiB", pool="default")


def test_the_cache_limit_is_exact(fake):
    s = cupy_memstrat.create("async", backend=fake, cache=1)  # less than one 512-byte block
    s.raw_free(s.raw_malloc(100))
    assert s.pool_stats(0).cached_bytes == 0


def test_close_with_a_live_block_destroys_the_pool_at_its_last_free(fake):
    """cudaMemPoolDestroy is not called on a pool still in use (a process that did so died with
    SIGFPE in a later cudaMallocFromPoolAsync on the H200, docs/streams.md)."""
    s = cupy_memstrat.create("async", backend=fake)
    p, q = s.raw_malloc(MiB), s.raw_malloc(MiB)
    handle = s.pool_stats(0).handle
    s.close()
    assert s.pool_stats(0).handle == handle and not fake._pool(handle).destroyed  # still in use
    s.raw_free(p)
    assert s.pool_stats(0).handle == handle
    s.raw_free(q)  # the last one: now it goes
    assert s.pool_stats(0).handle == 0 and fake.used_bytes(0) == 0
