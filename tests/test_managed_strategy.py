"""The ``managed`` strategy and explicit prefetch / advice on the fake backend:
chunks and size classes, the cache and trim, policies, the oversubscription
guard, bad input."""

import gc
import warnings

import pytest

import cupy_memstrat
from cupy_memstrat import backends as C
from cupy_memstrat.strategies.managed import CHUNK_BYTES, SIZE_CLASSES
from cupy_memstrat.testing import FakeBackend
from helpers import assert_sole_live_origin

MiB = 1 << 20


@pytest.fixture
def s(fake):
    return cupy_memstrat.create("managed", backend=fake)


def test_spec_string_and_keywords_mean_the_same():
    assert cupy_memstrat.validate("managed:accessed_by=host+0,prefetch=on_alloc,headroom=2GiB") == (
        cupy_memstrat.validate("managed", accessed_by=["host", 0], prefetch="on_alloc", headroom="2GiB")
    )
    assert cupy_memstrat.validate("malloc_managed")[0] == "managed"


def test_a_thousand_small_arrays_share_one_chunk(fake, s):
    ptrs = [s.raw_malloc(1000) for _ in range(1000)]
    assert len(set(ptrs)) == 1000
    assert fake.n_malloc_calls == 1  # one cudaMallocManaged for all of them
    ms = s.managed_stats(0)
    assert ms.n_chunks == 1 and ms.reserved_bytes == CHUNK_BYTES
    st = s.stats(0)
    assert st.bytes_in_use == 1000 * 1000 and st.bytes_reserved == CHUNK_BYTES and st.n_live == 1000
    # slots of one class never overlap and keep CuPy's 512-byte alignment
    ordered = sorted(ptrs)
    assert all(b - a >= 1024 for a, b in zip(ordered, ordered[1:]))
    assert all(p % 512 == 0 for p in ptrs)
    for p in ptrs:
        s.raw_free(p)


def test_size_classes_are_512_multiples_at_most_25_percent_apart():
    assert SIZE_CLASSES[0] == 512 and SIZE_CLASSES[-1] == MiB
    assert all(c % 512 == 0 for c in SIZE_CLASSES)
    assert all(b <= a * 1.25 or b - a == 512 for a, b in zip(SIZE_CLASSES, SIZE_CLASSES[1:]))


def _chunk_base(s, ptr):
    """The address of the chunk (a segment of managed's memory_segments) that holds ``ptr``."""
    (base,) = [g["address"] for g in s.memory_segments(0) if g["address"] <= ptr < g["address"] + g["total_size"]]
    return base


def test_each_size_gets_a_slot_that_holds_it(fake, s):
    for size in (1, 511, 512, 513, 2047, 2049, 5000, 65536, 700_000, MiB):
        p = s.raw_malloc(size)
        base = _chunk_base(s, p)
        assert p + size <= base + CHUNK_BYTES  # the slot lies inside its chunk
        s.raw_free(p)


def test_large_requests_take_whole_chunks_2mib_aligned(fake, s):
    p = s.raw_malloc(MiB + 1)
    q = s.raw_malloc(5 * MiB)
    assert p % CHUNK_BYTES == 0 and q % CHUNK_BYTES == 0
    assert s.managed_stats(0).reserved_bytes == 2 * MiB + 6 * MiB
    assert s.stats(0).bytes_in_use == MiB + 1 + 5 * MiB
    s.raw_free(p)
    s.raw_free(q)


def test_freed_memory_is_reused_without_a_cuda_call(fake, s):
    small, large = s.raw_malloc(3000), s.raw_malloc(8 * MiB)
    s.raw_free(small)
    s.raw_free(large)
    calls = fake.n_malloc_calls
    assert s.raw_malloc(3000) == small and s.raw_malloc(7 * MiB) == large  # same class, same chunk run
    assert fake.n_malloc_calls == calls
    assert s.managed_stats(0).cached_bytes == (CHUNK_BYTES // 3072 - 1) * 3072  # the class's other slots


def test_trim_gives_back_free_large_blocks_and_fully_free_chunks_only(fake, s):
    keep = s.raw_malloc(1000)  # one live slot pins its shared chunk
    other = [s.raw_malloc(100_000) for _ in range(3)]  # a chunk of another class
    big = s.raw_malloc(4 * MiB)
    for p in other + [big]:
        s.raw_free(p)
    before = s.managed_stats(0).reserved_bytes
    assert before == 3 * CHUNK_BYTES + 4 * MiB - 2 * MiB  # two shared chunks + a 4 MiB block
    released = s.trim()
    assert released == 4 * MiB + CHUNK_BYTES
    ms = s.managed_stats(0)
    assert ms.reserved_bytes == CHUNK_BYTES and s.stats(0).bytes_reserved == CHUNK_BYTES
    assert [seg["address"] for seg in s.memory_segments(0)] == [_chunk_base(s, keep)]
    assert fake.is_allocated(_chunk_base(s, keep))  # the pinned chunk is still CUDA's
    s.raw_free(keep)
    assert s.trim() == CHUNK_BYTES and s.managed_stats(0).n_chunks == 0


def test_trim_keep_bytes_keeps_some_cache(fake, s):
    for n in (2, 4, 8):
        s.raw_free(s.raw_malloc(n * MiB))
    assert s.trim("7MiB") == 8 * MiB  # the biggest block goes first, until at most 7 MiB stay
    assert s.managed_stats(0).cached_bytes == 6 * MiB
    assert s.trim("3MiB") == 4 * MiB and s.managed_stats(0).cached_bytes == 2 * MiB
    with pytest.raises(ValueError, match="keep_bytes"):
        s.trim("lots")


def test_trim_through_the_module(fake, restore_cupy_allocator):
    s = cupy_memstrat.use("managed", backend=fake)
    s.raw_free(s.raw_malloc(64 * MiB))
    assert cupy_memstrat.trim() == 64 * MiB


def test_advice_is_applied_once_per_chunk(fake):
    s = cupy_memstrat.create("managed", backend=fake, preferred_location="device", accessed_by="host")
    ptrs = [s.raw_malloc(4096) for _ in range(100)]  # one shared chunk
    base = min(ptrs)
    assert fake.advice(base) == [
        (CHUNK_BYTES, C.ADVISE_SET_PREFERRED_LOCATION, 0),
        (CHUNK_BYTES, C.ADVISE_SET_ACCESSED_BY, C.HOST),
    ]
    big = s.raw_malloc(3 * MiB)
    s.raw_free(big)
    s.raw_malloc(3 * MiB)  # reused: no new advice
    assert fake.advice(big) == [
        (4 * MiB, C.ADVISE_SET_PREFERRED_LOCATION, 0),
        (4 * MiB, C.ADVISE_SET_ACCESSED_BY, C.HOST),
    ]
    assert fake.n_advise_calls == 4


def test_preferred_location_host_and_read_mostly(fake):
    with pytest.warns(cupy_memstrat.ManagedMemoryWarning, match="harmful"):
        s = cupy_memstrat.create("managed", backend=fake, preferred_location="host", read_mostly=True)
    p = s.raw_malloc(3 * MiB)
    assert fake.advice(p) == [
        (4 * MiB, C.ADVISE_SET_PREFERRED_LOCATION, C.HOST),
        (4 * MiB, C.ADVISE_SET_READ_MOSTLY, 0),
    ]


def test_no_prefetch_leaves_pages_unpopulated_and_gpu_touch_faults(fake, s):
    p = s.raw_malloc(4 * MiB)
    assert fake.residency(p, 4 * MiB) == {None: 4 * MiB}
    fake.touch(p, 4 * MiB, "host")  # CPU initialisation
    fake.touch(p, 4 * MiB, 0)  # first GPU pass
    c = fake.uvm_counters()
    assert c["gpu_faults"] == 64 and c["bytes_htod"] == 4 * MiB


def test_prefetch_on_alloc_puts_large_blocks_and_new_chunks_on_the_device(fake):
    s = cupy_memstrat.create("managed", backend=fake, prefetch="on_alloc")
    big = s.raw_malloc(4 * MiB)
    small = s.raw_malloc(1000)
    base = _chunk_base(s, small)
    assert fake.residency(big, 4 * MiB) == {0: 4 * MiB}
    assert fake.residency(base, CHUNK_BYTES) == {0: CHUNK_BYTES}
    fake.touch(big, 4 * MiB, 0)
    assert fake.uvm_counters()["gpu_faults"] == 0
    # a reused large block is prefetched again: the host had pulled it back
    fake.touch(big, 4 * MiB, "host")
    s.raw_free(big)
    again = s.raw_malloc(4 * MiB)
    assert again == big and fake.residency(big, 4 * MiB) == {0: 4 * MiB}


def test_prefetch_on_new_prefetches_new_memory_but_not_what_the_cache_hands_back(fake):
    s = cupy_memstrat.create("managed", backend=fake, prefetch="on_new")
    big = s.raw_malloc(4 * MiB)
    small = s.raw_malloc(1000)
    base = _chunk_base(s, small)
    assert fake.residency(big, 4 * MiB) == {0: 4 * MiB}  # new: prefetched
    assert fake.residency(base, CHUNK_BYTES) == {0: CHUNK_BYTES}
    calls = fake.n_prefetch_calls
    fake.touch(big, 4 * MiB, "host")
    s.raw_free(big)
    s.raw_free(small)
    for hot_path_size in (4 * MiB, 1000):  # through the hot path, cached: no prefetch call
        p = s.malloc(hot_path_size)
        del p
    again = s.raw_malloc(4 * MiB)
    assert again == big and fake.n_prefetch_calls == calls
    assert fake.residency(big, 4 * MiB) == {"host": 4 * MiB}  # where its last user left it
    s.raw_malloc(4 * MiB)  # new again (the cached one is taken): prefetched
    assert fake.n_prefetch_calls == calls + 1


def test_prefetch_on_alloc_prefetches_every_large_allocation_cached_or_not(fake):
    s = cupy_memstrat.create("managed", backend=fake, prefetch="on_alloc")
    p = s.malloc(4 * MiB)
    del p
    calls = fake.n_prefetch_calls
    for _ in range(3):
        p = s.malloc(4 * MiB)  # the hot path, a cache hit each time
        del p
    assert fake.n_prefetch_calls == calls + 3


@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_a_failed_prefetch_on_alloc_fails_clearly_and_loses_nothing(fake, size):
    s = cupy_memstrat.create("managed", backend=fake, prefetch="on_alloc")
    st = fake.stream()
    st.destroy()
    with st, pytest.raises(RuntimeError, match=r"prefetch='on_alloc' .* on stream 0x[0-9a-f]+ failed "
                           r"\(cudaErrorInvalidResourceHandle\); the allocation of \d+ bytes was not made"):
        s.raw_malloc(size)  # the prefetch runs on the current stream: a destroyed one here
    assert fake.peek_last_error() == C.ERROR_SUCCESS
    st0 = s.stats(0)
    assert st0.n_failed == 1 and st0.n_live == 0
    assert s.managed_stats(0).cached_bytes == s.managed_stats(0).reserved_bytes > 0  # all of it cached
    assert s.trim() == s.stats(0).peak_bytes_reserved  # and so it can be given back
    st2 = fake.stream()
    with st2:
        p = s.raw_malloc(size)  # on a live stream it works
    s.raw_free(p)  # cached for st2: blocks are reused on their allocation stream
    st2.destroy()
    if size > MiB:  # a cached large block is prefetched again, and goes back to the cache if that fails
        with st2, pytest.raises(RuntimeError):
            s.raw_malloc(size)
        assert s.managed_stats(0).cached_bytes == s.managed_stats(0).reserved_bytes == size
    else:  # a cached slot of a shared chunk was prefetched with its chunk: no new prefetch
        with st2:
            assert s.raw_malloc(size) == p


@pytest.mark.parametrize("mode", ["on_alloc", "on_new"])
def test_prefetch_is_refused_without_concurrent_managed_access(mode):
    fake = FakeBackend(memory="1GiB", concurrent_managed_access=0)
    with pytest.raises(ValueError, match=f"prefetch='{mode}' needs concurrentManagedAccess, and device 0"):
        cupy_memstrat.create("managed", backend=fake, prefetch=mode)


def test_a_size_that_rounds_past_size_t_is_refused(fake):
    s = cupy_memstrat.create("managed", backend=fake, oversubscribe=True)
    with pytest.raises(ValueError, match="rounds up to 18446744073709551616 bytes"):
        s.raw_malloc((1 << 64) - 1)
    with pytest.raises(ValueError, match="does not fit in size_t"):
        s.malloc(1 << 80)
    assert fake.n_malloc_calls == 0


def test_the_guard_refuses_what_the_device_cannot_hold_and_loses_nothing(fake):
    # 1 GiB device; the default headroom is min(1 GiB, 5%) = 51.2 MiB
    s = cupy_memstrat.create("managed", backend=fake)
    a = s.raw_malloc(400 * MiB)
    b = s.raw_malloc(400 * MiB)  # not resident yet, but counted: 800 MiB of 972.8 usable
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="oversubscription guard") as info:
        s.raw_malloc(400 * MiB)
    err = info.value
    assert err.reason == "oversubscription_guard" and err.requested == 400 * MiB
    assert "1.0 GiB free" in str(err) and "400.0 MiB" in str(err) and "oversubscribe=True" in str(err)
    assert s.managed_stats(0).n_guard_refusals == 1 and s.stats(0).n_failed == 1
    assert fake.is_allocated(a) and fake.is_allocated(b) and s.stats(0).n_live == 2
    small = s.raw_malloc(100)  # the next allocation works
    s.raw_free(small)


def test_the_guard_counts_resident_chunks_once(fake):
    s = cupy_memstrat.create("managed", backend=fake, prefetch="on_alloc")
    s.raw_malloc(400 * MiB)  # resident: the device's free memory already shows it
    s.raw_malloc(400 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError):
        s.raw_malloc(200 * MiB)  # 1 GiB - 800 MiB - headroom < 200 MiB
    s.raw_malloc(150 * MiB)


def test_the_guard_sees_other_users_of_the_device(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    fake.malloc(900 * MiB)  # someone else's cudaMalloc
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="guard"):
        s.raw_malloc(100 * MiB)


def test_the_guard_lowers_its_baseline_when_others_give_memory_back(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    other = fake.malloc(400 * MiB)
    s.raw_malloc(100 * MiB)  # the baseline: 400 MiB used by someone else
    fake.free(other)
    s.raw_malloc(100 * MiB)  # sees the lower baseline (0 used), counts both chunks as not resident
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="200.0 MiB of this strategy's chunks not yet resident"):
        s.raw_malloc(800 * MiB)


def test_the_guard_takes_a_new_baseline_whenever_it_holds_no_chunk(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    s.raw_free(s.raw_malloc(100 * MiB))  # the first baseline: nothing used by others
    s.trim()  # no chunk held
    fake.malloc(800 * MiB)  # someone else's cudaMalloc, after the baseline
    s.raw_malloc(100 * MiB)  # the guard holds nothing: the 800 MiB are others', not its chunks made resident
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="100.0 MiB of this strategy's chunks not yet resident"):
        s.raw_malloc(100 * MiB)  # 200 MiB not resident > 224 MiB free less 51.2 MiB headroom


def test_a_hopeless_request_keeps_the_cache(fake, s):
    s.raw_free(s.raw_malloc(64 * MiB))
    with pytest.raises(cupy_memstrat.OutOfMemoryError):
        s.raw_malloc(4 << 30)  # more than the whole device: nothing given back could make room, keep it
    assert s.managed_stats(0).cached_bytes == 64 * MiB


class _HeldByACycle:
    """A block freed only when the garbage collector breaks this object's cycle."""

    def __init__(self, s, size):
        self.me, self.s, self.ptr = self, s, s.raw_malloc(size)

    def __del__(self):
        self.s.raw_free(self.ptr)


def test_the_guard_collects_reference_cycles_before_refusing(fake, s):
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):  # 4 x 300 MiB on a 1 GiB device, each block dropped in a cycle
            _HeldByACycle(s, 300 * MiB)
        st = s.stats(0)
        assert st.n_oom_recoveries == 1 and st.n_failed == 0  # the 4th fit once the collector ran
        assert st.n_live == 1
    finally:
        gc.enable()
        gc.collect()


def test_the_guard_gives_the_cache_back_before_refusing(fake, s):
    p = s.raw_malloc(600 * MiB)
    s.raw_free(p)  # cached
    q = s.raw_malloc(800 * MiB)  # fits only once the cached block is freed
    assert s.managed_stats(0).reserved_bytes == 800 * MiB and not fake.is_allocated(p) or p == q


def test_oversubscribe_true_turns_the_guard_off(fake):
    s = cupy_memstrat.create("managed", backend=fake, oversubscribe=True)
    p = s.raw_malloc(1536 * MiB)  # more than the device: CUDA allows it
    assert s.managed_stats(0).reserved_bytes == 1536 * MiB
    s.raw_free(p)


def test_a_cuda_failure_is_an_out_of_memory_error_and_clears_the_sticky_error(fake):
    s = cupy_memstrat.create("managed", backend=fake, oversubscribe=True)
    keep = s.raw_malloc(4 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        s.raw_malloc(64 << 30)  # beyond what the fake's host and device can back
    assert info.value.reason == "cuda"
    assert fake.peek_last_error() == C.ERROR_SUCCESS
    assert fake.is_allocated(keep) and s.stats(0).n_live == 1


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(preferred_location="gpu"), "preferred_location: expected 'device', 'host'"),
        (dict(preferred_location=-1), "preferred_location: expected a device ordinal >= 0"),
        (dict(preferred_location=3), "preferred_location: device 3 does not exist"),
        (dict(accessed_by="host+7"), "accessed_by: device 7 does not exist"),
        (dict(accessed_by=[True]), "accessed_by: expected"),
        (dict(accessed_by="host+\u0661"), "accessed_by: expected"),  # an Arabic-Indic digit is not an ordinal
        (dict(preferred_location="\u00b2"), "preferred_location: expected"),
        (dict(headroom="100%"), "headroom=.*leaves nothing of device 0's memory"),
        (dict(prefetch="always"), "prefetch: expected 'on_alloc', 'on_new' or None, got 'always'"),
        (dict(read_mostly="maybe"), "read_mostly: expected true or false, got 'maybe'"),
        (dict(headroom="-1GiB"), "headroom"),
        (dict(headroom="2TiB"), "headroom=.*2.0 TiB.*leaves nothing of device 0's memory"),
        (dict(oversubscribe="sometimes"), "oversubscribe"),
        (dict(chunk="4MiB"), "unknown option 'chunk'"),
    ],
)
def test_bad_options_are_refused_at_creation(fake, options, match):
    with pytest.raises(ValueError, match=match):
        cupy_memstrat.create("managed", backend=fake, **options)
    assert fake.n_malloc_calls == 0


def test_a_device_without_concurrent_managed_access_warns():
    fake = FakeBackend(memory="1GiB", concurrent_managed_access=0)
    with pytest.warns(cupy_memstrat.ManagedMemoryWarning, match="concurrentManagedAccess = 0"):
        cupy_memstrat.create("managed", backend=fake)


def test_no_warning_by_default(fake):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cupy_memstrat.create("managed", backend=fake)


def test_size_checks_and_zero_bytes(s, fake):
    assert s.raw_malloc(0) == 0 and fake.n_malloc_calls == 0
    with pytest.raises(ValueError, match="size"):
        s.raw_malloc(-1)
    with pytest.raises(TypeError, match="size"):
        s.raw_malloc(1.5)


def test_double_free_is_warned_and_never_hands_a_slot_out_twice(s):
    p = s.raw_malloc(1000)
    s.raw_free(p)
    with pytest.warns(cupy_memstrat.InvalidFreeWarning):
        s.raw_free(p)
    a, b = s.raw_malloc(1000), s.raw_malloc(1000)
    assert a != b and s.stats(0).n_invalid_frees == 1


def test_blocks_are_freed_for_their_device_whatever_is_current(fake2):
    s = cupy_memstrat.create("managed", backend=fake2)
    fake2.set_device(1)
    p = s.raw_malloc(5000)
    fake2.set_device(0)
    s.raw_free(p, 0)  # a wrong hint: still accounted to device 1
    assert s.stats(1).n_frees == 1 and s.stats(0).n_allocs == 0
    fake2.set_device(1)
    assert s.raw_malloc(5000) == p  # back in device 1's cache


def test_track_origins(fake):
    s = cupy_memstrat.create("managed", backend=fake, track_origins=True)
    p = s.raw_malloc(1234)
    assert_sole_live_origin(s, __file__, 1234)
    s.raw_free(p)


def test_close_gives_the_cache_back_and_an_unreachable_strategy_frees_its_chunks(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    p = s.raw_malloc(1000)
    s.raw_free(s.raw_malloc(8 * MiB))
    s.close()
    assert s.managed_stats(0).reserved_bytes == CHUNK_BYTES  # the live slot's chunk stays
    s.raw_free(p)
    del s
    gc.collect()
    assert fake.used_bytes(0) == 0 and not fake._managed


# -- prefetch() and advise() -------------------------------------------------------


@pytest.fixture
def managed_ptr(fake, s):
    return s.raw_malloc(8 * MiB)


def test_prefetch_both_ways_moves_bytes_without_faults(fake, managed_ptr):
    p = managed_ptr
    fake.touch(p, 8 * MiB, "host")
    before = fake.uvm_counters()
    cupy_memstrat.prefetch(p, "device", nbytes=8 * MiB, backend=fake)
    cupy_memstrat.prefetch(p, 0, nbytes=8 * MiB, backend=fake)  # already there: nothing moves
    c = fake.uvm_counters()
    assert c["bytes_htod"] - before["bytes_htod"] == 8 * MiB and c["gpu_faults"] == before["gpu_faults"]
    cupy_memstrat.prefetch(p, "host", nbytes=8 * MiB, backend=fake)
    assert fake.uvm_counters()["bytes_dtoh"] - c["bytes_dtoh"] == 8 * MiB
    assert fake.residency(p, 8 * MiB) == {"host": 8 * MiB}


def test_prefetch_on_a_stream(fake, managed_ptr):
    st = fake.stream()
    cupy_memstrat.prefetch(managed_ptr, nbytes=MiB, stream=st, backend=fake)
    st.destroy()
    with pytest.raises(ValueError, match=r"the stream 0x[0-9a-f]+ is not a live stream \(destroyed\?\) "
                       r"\(cudaErrorInvalidResourceHandle\)"):
        cupy_memstrat.prefetch(managed_ptr, nbytes=MiB, stream=st, backend=fake)


def test_prefetch_takes_numpy_ints_and_digit_strings_as_ordinals(fake, managed_ptr):
    np = pytest.importorskip("numpy")
    cupy_memstrat.prefetch(managed_ptr, np.int64(0), nbytes=MiB, backend=fake)
    cupy_memstrat.prefetch(managed_ptr, "0", nbytes=MiB, backend=fake)
    assert fake.residency(managed_ptr, MiB) == {0: MiB}


def test_advise_accepts_the_strategy_option_forms(fake, managed_ptr):
    cupy_memstrat.advise(managed_ptr, accessed_by="host+0", preferred_location="none", nbytes=MiB, backend=fake)
    assert [a for _, a, _ in fake.advice(managed_ptr)[-3:]] == [
        C.ADVISE_UNSET_PREFERRED_LOCATION, C.ADVISE_SET_ACCESSED_BY, C.ADVISE_SET_ACCESSED_BY]


def test_prefetch_and_advise_refuse_memory_that_is_not_managed(fake):
    d = cupy_memstrat.create("device", backend=fake)
    p = d.raw_malloc(4096)
    with pytest.raises(ValueError, match="device memory, not managed memory"):
        cupy_memstrat.prefetch(p, nbytes=4096, backend=fake)
    with pytest.raises(ValueError, match="not managed memory"):
        cupy_memstrat.advise(p, preferred_location="device", nbytes=4096, backend=fake)
    with pytest.raises(ValueError, match="unregistered memory"):
        cupy_memstrat.prefetch(0x1234, nbytes=16, backend=fake)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(to="gpu"), ValueError, "to: expected 'device', 'host' or a device ordinal, got 'gpu'"),
        (dict(to=4), ValueError, "device 4 does not exist"),
        (dict(to=True), ValueError, "to: expected"),
        (dict(nbytes=None), TypeError, "nbytes: required with a raw pointer"),
        (dict(nbytes=-1), ValueError, "nbytes: expected bytes >= 0"),
        (dict(nbytes="1MiB"), TypeError, "nbytes: expected an int"),
        (dict(nbytes=64 * MiB), ValueError, "CUDA refused the range"),
        (dict(stream="fast"), TypeError, "stream: expected"),
        (dict(stream=-1), ValueError, "stream: a raw handle is a cudaStream_t from 0"),
        (dict(stream=2**64), ValueError, "stream: a raw handle is a cudaStream_t from 0"),
        (dict(stream=type("S", (), {"ptr": -1, "simulated_stream": True})()), ValueError, "which is no cudaStream_t"),
        (dict(stream=type("Q", (), {"ptr": "x", "simulated_stream": True})()), TypeError, "whose .ptr is an int"),
        (dict(stream=type("D", (), {"ptr": 5})()), TypeError, r"expected a cupy.cuda.Stream \(or Ext.*got "),
        (dict(stream=1.5), TypeError, "stream: expected"),
    ],
)
def test_prefetch_bad_input(fake, managed_ptr, kwargs, exc, match):
    kwargs = {"nbytes": MiB, **kwargs}
    with pytest.raises(exc, match=match):
        cupy_memstrat.prefetch(managed_ptr, backend=fake, **kwargs)
    assert fake.n_prefetch_calls == 0 or exc is ValueError


def test_prefetch_refuses_a_bad_stream_also_for_an_empty_range(fake, managed_ptr):
    with pytest.raises(TypeError, match="stream: expected"):
        cupy_memstrat.prefetch(managed_ptr, nbytes=0, stream="bogus", backend=fake)


def test_prefetch_bad_targets(fake, s):
    for bad in (1.5, True, "0x1000", None):
        with pytest.raises(TypeError, match="x: expected a CuPy array"):
            cupy_memstrat.prefetch(bad, nbytes=10, backend=fake)


def test_advise_sets_and_unsets(fake, managed_ptr):
    p, n = managed_ptr, 8 * MiB
    calls = fake.n_advise_calls
    cupy_memstrat.advise(p, preferred_location="host", accessed_by=[0, "host"], nbytes=n, backend=fake)
    cupy_memstrat.advise(p, preferred_location=None, unset_accessed_by="host", read_mostly=False, nbytes=n,
                         backend=fake)
    assert fake.advice(p)[-6:] == [
        (n, C.ADVISE_SET_PREFERRED_LOCATION, C.HOST),
        (n, C.ADVISE_SET_ACCESSED_BY, 0),
        (n, C.ADVISE_SET_ACCESSED_BY, C.HOST),
        (n, C.ADVISE_UNSET_PREFERRED_LOCATION, 0),
        (n, C.ADVISE_UNSET_ACCESSED_BY, C.HOST),
        (n, C.ADVISE_UNSET_READ_MOSTLY, 0),
    ]
    assert fake.n_advise_calls == calls + 6


def test_advise_read_mostly_warns(fake, managed_ptr):
    with pytest.warns(cupy_memstrat.ManagedMemoryWarning, match="harmful"):
        cupy_memstrat.advise(managed_ptr, read_mostly=True, nbytes=MiB, backend=fake)


def test_advise_checks_every_argument_before_the_first_call(fake, managed_ptr):
    calls = fake.n_advise_calls
    with pytest.raises(ValueError, match="accessed_by: expected"):
        cupy_memstrat.advise(managed_ptr, preferred_location="host", accessed_by="everyone", nbytes=MiB, backend=fake)
    with pytest.raises(TypeError, match="read_mostly: expected True or False"):
        cupy_memstrat.advise(managed_ptr, preferred_location="host", read_mostly="yes", nbytes=MiB, backend=fake)
    assert fake.n_advise_calls == calls


def test_prefetch_and_advise_take_cupy_arrays_and_views(fake, restore_cupy_allocator):
    cupy = restore_cupy_allocator
    import numpy as np

    s = cupy_memstrat.create("managed", backend=fake)
    mem = s.malloc(8 * MiB)
    x = cupy.ndarray((1024, 1024), dtype=np.float64, memptr=mem)  # 8 MiB, no kernel needed
    cupy_memstrat.prefetch(x, "host", backend=fake)
    assert fake.residency(mem.ptr, 8 * MiB) == {"host": 8 * MiB}
    cupy_memstrat.prefetch(x[64:], 0, backend=fake)  # a view: rows 64.. (from 512 KiB on)
    assert fake.residency(mem.ptr, 8 * MiB) == {"host": 512 * 1024, 0: 8 * MiB - 512 * 1024}
    cupy_memstrat.prefetch(x[:56:2, ::-1], 0, backend=fake)  # strided, reversed: rows 0..54, 440 KiB
    assert fake.residency(mem.ptr, 8 * MiB) == {"host": 64 * 1024, 0: 8 * MiB - 64 * 1024}
    cupy_memstrat.prefetch(mem, "host", backend=fake)  # a MemoryPointer: to its allocation's end
    assert fake.residency(mem.ptr, 8 * MiB) == {"host": 8 * MiB}
    with pytest.raises(TypeError, match="nbytes: only for a raw pointer"):
        cupy_memstrat.prefetch(x, nbytes=10, backend=fake)


def test_warnings_point_at_the_users_line(fake):
    with pytest.warns(cupy_memstrat.ManagedMemoryWarning) as rec:
        cupy_memstrat.create("managed", backend=fake, read_mostly=True)
    assert rec[0].filename == __file__


@pytest.mark.parametrize("off", [None, False, "false", "off", "none", ""])
def test_prefetch_is_switched_off_by_any_of_the_usual_spellings(off):
    assert cupy_memstrat.validate("managed", prefetch=off)[1]["prefetch"] is None


@pytest.mark.parametrize("device, error", [(-1, ValueError), (1, ValueError), ("0", TypeError)])
def test_largest_free_block_refuses_a_bad_device(fake, device, error):
    s = cupy_memstrat.create("managed", backend=fake)
    with pytest.raises(error, match="device"):
        s.largest_free_block(device)
