"""The ``expandable`` strategy on the simulated GPU: its address space (no CUDA), the reserve
kept to what is in use on the fragmenting programs, stream order, trim, out of memory and bad
options."""

import pytest

import cupy_memstrat
from cupy_memstrat.bench import fragmentation
from cupy_memstrat.replay import replay
from cupy_memstrat.strategies.expandable.space import Space
from cupy_memstrat.testing import FakeBackend

MiB, PAGE = 1 << 20, 2 << 20


@pytest.fixture(autouse=True)
def _both_hot_paths(hot_path):
    """Each test runs on both allocation hot paths: the C one and its Python model."""


# -- the address space, no CUDA ---------------------------------------------------------------


def test_a_request_takes_the_smallest_hole_that_holds_it_and_a_freed_block_joins_its_neighbours():
    sp = Space(0, 64 * MiB, PAGE)
    a, b, c = sp.take(4 * MiB, 1), sp.take(1 * MiB, 1), sp.take(2 * MiB, 1)
    assert (a, b, c) == (0, 4 * MiB, 5 * MiB)
    sp.give(a, 4 * MiB, 1)
    assert sp.take(8 * MiB, 1) == 7 * MiB  # no hole holds it: the used part extends
    assert sp.take(3 * MiB, 1) == 0  # the 4 MiB hole, the smallest that holds it
    sp.give(b, 1 * MiB, 1)
    sp.give(0, 3 * MiB, 1)
    assert (0, 5 * MiB, 1) in sp.free_ranges()  # 3 MiB + the 1 MiB left + the 1 MiB block: one range


def test_a_free_range_is_its_streams_until_a_synchronisation():
    sp = Space(0, 64 * MiB, PAGE)
    a = sp.take(4 * MiB, 1)
    sp.take(1 * MiB, 1)
    sp.give(a, 4 * MiB, 1)
    assert sp.take(4 * MiB, 2) != a and sp.tagged_bytes() == 4 * MiB  # stream 2 does not get stream 1's block
    assert sp.settle() == 1 and sp.tagged_bytes() == 0
    assert sp.take(4 * MiB, 2) == a


def test_pages_no_block_touches_are_free_and_the_largest_free_block_is_mapped_throughout():
    sp = Space(0, 64 * MiB, PAGE)
    a = sp.take(5 * MiB, 1)  # touches pages 0, 2 MiB and 4 MiB
    assert sp.unmapped_pages(a, 5 * MiB) == [0, 2 * MiB, 4 * MiB]
    for p in (0, 2 * MiB, 4 * MiB):
        sp.map(p, 100 + p)
    assert sp.free_pages() == [] and sp.largest_free_mapped() == 1 * MiB  # the rest of the last page
    sp.give(a, 5 * MiB, 1)
    # the freed block is stream 1's until a synchronisation: apart from the rest of the range
    assert sp.free_pages() == [0, 2 * MiB, 4 * MiB] and sp.largest_free_mapped() == 5 * MiB
    sp.settle()
    assert sp.largest_free_mapped() == 6 * MiB
    sp.unmap(2 * MiB)
    assert sp.largest_free_mapped() == 2 * MiB


# -- the strategy ---------------------------------------------------------------------------------


def _s(fake=None, **options):
    fake = fake or FakeBackend(memory="8GiB")
    return fake, cupy_memstrat.create("expandable", backend=fake, **options)


@pytest.mark.parametrize("program", ["16-then-32", "32-then-16", "growing-buffer", "random-sizes",
                                     "alternating-batches"])
def test_the_reserve_stays_within_5_percent_of_the_peak_in_use_rounded_up_to_pages(program):
    fake = FakeBackend(memory="80GiB")
    row = replay(fragmentation.program(program), backend=fake, strategies=["expandable"])["results"]["expandable"]
    pages = -(-row["peak_in_use"] // PAGE) * PAGE
    assert row["completed"] and row["peak_reserved"] <= 1.05 * pages
    assert fake.used_bytes(0) == 0  # the replay trimmed: every page released


def test_without_remap_a_growing_buffer_leaves_free_pages_behind():
    # the control of the test above: moving free pages is what keeps the reserve down
    fake = FakeBackend(memory="80GiB")
    trace = fragmentation.program("growing-buffer")
    row = replay(trace, backend=fake, strategies=["expandable:remap=false"])["results"]["expandable:remap=false"]
    assert row["peak_reserved"] > 1.5 * row["peak_in_use"]


def test_16_mib_then_32_mib_keeps_128_mib_and_moves_pages_instead_of_taking_more():
    fake, s = _s()
    small = [s.raw_malloc(16 * MiB) for _ in range(8)]
    for p in small:
        s.raw_free(p)
    big = [s.raw_malloc(32 * MiB) for _ in range(4)]
    st = s.stats(0)
    assert st.bytes_in_use == st.bytes_reserved == 128 * MiB and fake.used_bytes(0) == 128 * MiB
    for p in big:
        s.raw_free(p)
    assert s.stats(0).largest_free_block == 128 * MiB


def test_a_block_freed_on_one_stream_goes_to_another_only_after_a_synchronisation():
    fake, s = _s(remap=False)
    a, b = fake.stream(), fake.stream()
    with a:
        p = s.raw_malloc(4 * MiB)
        s.raw_malloc(MiB)  # keeps p's range from joining the rest of the space
    s.raw_free(p)
    with b:
        q = s.raw_malloc(4 * MiB)
    assert q != p  # b never gets a's block while a's work may still use it
    with a:
        assert s.raw_malloc(4 * MiB) == p  # a's own, at once
        s.raw_free(p)
    syncs = fake.n_device_synchronize_calls
    s.trim()
    assert fake.n_device_synchronize_calls == syncs + 1
    with b:
        assert s.raw_malloc(4 * MiB) == p  # ordered: any stream's


def test_trim_returns_unused_pages_to_the_device_and_keeps_live_blocks_where_they_are():
    fake, s = _s()
    keep = s.raw_malloc(3 * MiB)
    tmp = [s.raw_malloc(8 * MiB) for _ in range(4)]
    for p in tmp:
        s.raw_free(p)
    free0 = fake.mem_get_info(0)[0]
    released = s.trim()
    assert released == fake.mem_get_info(0)[0] - free0 == 32 * MiB
    assert s.stats(0).bytes_reserved == 4 * MiB  # the two pages the live 3 MiB block touches
    assert fake.vmm_accessible(keep, 3 * MiB)
    s.raw_free(keep)
    assert s.trim() == 4 * MiB and fake.used_bytes(0) == 0


def test_max_size_refuses_clearly_and_loses_nothing():
    fake, s = _s(max_size="64MiB")
    live = s.raw_malloc(48 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match=r"max_size 64.0 MiB reached") as info:
        s.raw_malloc(32 * MiB)
    assert "largest free block" in str(info.value)
    assert s.stats(0).n_live == 1 and fake.vmm_accessible(live, 48 * MiB)
    s.raw_free(live)
    s.raw_free(s.raw_malloc(64 * MiB))  # the limit holds what it says


def test_the_devices_memory_used_up_is_said_and_the_strategy_works_after():
    fake, s = _s(FakeBackend(memory="256MiB"))
    live = s.raw_malloc(200 * MiB)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="the device's memory is used up"):
        s.raw_malloc(100 * MiB)
    assert fake.used_bytes(0) == 200 * MiB  # nothing half made stays behind
    s.raw_free(live)
    s.raw_free(s.raw_malloc(250 * MiB))  # the pages move, more are made: it fits now


@pytest.mark.parametrize("options, message", [
    ({"max_size": "lots"}, "max_size: cannot parse 'lots'"),
    ({"max_size": "150%"}, "max_size"),
    ({"remap": "maybe"}, "remap"),
    ({"release_threshold": "-1MiB"}, "release_threshold"),
    ({"release_threshold": "lots"}, "release_threshold: cannot parse 'lots'"),
    ({"release_threshold": "200%"}, "release_threshold"),
    ({"page": "4MiB"}, "unknown option"),
    ({"max_size": "0%"}, r"max_size: expected a percentage above 0%, got '0%' \(0 or None: no limit\)"),
    ({"max_size": "2GiB"}, r"option max_size=2147483648 bytes \(2.0 GiB\) is above device 0's memory \(1.0 GiB\)"),
    ({"release_threshold": "2GiB"}, "option release_threshold=2147483648 bytes .* is above device 0's memory"),
])
def test_bad_options_are_refused_before_anything_is_reserved(options, message):
    fake = FakeBackend(memory="1GiB")
    with pytest.raises((ValueError, TypeError), match=message):
        cupy_memstrat.create("expandable", backend=fake, **options)
    assert fake.n_vmm_calls == 0


@pytest.mark.parametrize("threshold, kept", [(None, 256 * MiB), ("0", 2 * MiB), ("64MiB", 64 * MiB),
                                              ("1GiB", 256 * MiB)])
def test_the_release_threshold_gives_unused_pages_back_at_the_next_allocation(threshold, kept):
    # None, the default, is the control: everything freed stays mapped until a trim
    fake, s = _s(release_threshold=threshold)
    keep = s.raw_malloc(2 * MiB)
    big = [s.raw_malloc(64 * MiB) for _ in range(4)]
    for p in big:
        s.raw_free(p)
    free_before = fake.mem_get_info(0)[0]
    syncs = fake.n_device_synchronize_calls
    small = s.raw_malloc(MiB)  # the next allocation trims, once
    assert s.stats(0).bytes_reserved - s.stats(0).bytes_in_use <= kept + 2 * MiB
    released = fake.mem_get_info(0)[0] - free_before
    assert released == (0 if kept == 256 * MiB else 256 * MiB - kept)
    assert fake.n_device_synchronize_calls == syncs + (0 if kept == 256 * MiB else 1)
    s.raw_free(small)
    syncs = fake.n_device_synchronize_calls
    for _ in range(20):  # churn within a page: no synchronisation each time
        s.raw_free(s.raw_malloc(MiB))
    assert fake.n_device_synchronize_calls - syncs <= 1
    assert fake.vmm_accessible(keep, 2 * MiB)  # the live block never moved or lost its page


def test_a_max_size_below_one_page_is_refused_before_anything_is_reserved():
    fake = FakeBackend(memory="1GiB")
    with pytest.raises(ValueError, match=r"max_size=1.0 KiB is below one page \(2.0 MiB, device 0's allocation "
                                         r"granularity\): no block would fit"):
        cupy_memstrat.create("expandable", backend=fake, max_size="1KiB")
    assert fake.used_bytes(0) == 0 and fake.vmm_mapped_bytes() == 0


def test_a_request_larger_than_the_device_says_so():
    fake, s = _s(FakeBackend(memory="1GiB"))
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match=r"the request is larger than the device's memory "
                                                             r"\(1.0 GiB\)"):
        s.raw_malloc(1536 * MiB)
    fake, s = _s(FakeBackend(memory="1GiB"), max_size="4MiB")
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match=r"max_size 4.0 MiB reached: 0 B mapped, 6.0 MiB more "
                                                             "needed"):
        s.raw_malloc(5 * MiB)


def test_close_gives_every_page_and_the_addresses_back():
    fake, s = _s()
    s.raw_free(s.raw_malloc(10 * MiB))
    s.close()
    assert fake.used_bytes(0) == 0 and fake.vmm_mapped_bytes() == 0
    assert s.stats(0).bytes_reserved == 0  # the statistics say what close gave back


def test_the_strategy_works_again_after_close_with_a_release_threshold():
    fake, s = _s(release_threshold=0)
    s.raw_free(s.raw_malloc(3 * MiB))  # leaves a trim due
    s.close()
    p = s.raw_malloc(MiB)
    assert fake.vmm_accessible(p, MiB) and s.stats(0).bytes_reserved == 2 * MiB
    s.raw_free(p)


def test_a_zero_byte_request_through_the_hot_path_gets_a_block_of_its_own():
    fake, s = _s()
    malloc, free = s.hot_path_functions()
    z = malloc(0, 0)
    p = malloc(MiB, 0)
    assert z != p and not (z <= p < z + 512)
    free(z, 0)
    free(p, 0)
    s.trim()
    assert fake.used_bytes(0) == 0


@pytest.mark.parametrize("device, error", [(-1, ValueError), (1, ValueError), ("0", TypeError), (1.0, TypeError)])
def test_largest_free_block_refuses_a_bad_device(device, error):
    fake, s = _s()
    with pytest.raises(error, match="device"):
        s.largest_free_block(device)


@pytest.mark.parametrize("value", [".4", "0.00000001%"])
def test_a_max_size_that_rounds_to_nothing_is_refused_not_taken_as_no_limit(value):
    fake = FakeBackend(memory="4GiB")
    with pytest.raises(ValueError, match="max_size"):
        cupy_memstrat.create("expandable", backend=fake, max_size=value)
    assert fake.vmm_mapped_bytes() == 0


def test_a_freed_block_serves_its_streams_next_request_of_its_size_and_is_counted_cached():
    fake, s = _s()
    p = s.raw_malloc(3 * MiB)
    s.raw_free(p)
    calls = fake.n_vmm_calls
    assert s.raw_malloc(3 * MiB) == p and fake.n_vmm_calls == calls  # no CUDA call
    s.raw_free(p)
    st = s.stats(0)
    assert st.bytes_in_use == 0 and st.bytes_reserved == 4 * MiB and st.largest_free_block >= 3 * MiB


def test_a_block_cut_again_for_another_stream_goes_back_to_that_streams_blocks():
    """The C hot path remembers where the last freed block went; once its address is cut
    again for another stream, a free there must go to the new stream's blocks, or the first
    stream would take it back while the other's work may still use it."""
    fake, s = _s()
    a, b = fake.stream(), fake.stream()
    with a:
        p = s.raw_malloc(4 * MiB)
        s.raw_free(p)  # kept for a
    s.trim()  # ordered: the address is any stream's again
    with b:
        assert s.raw_malloc(4 * MiB) == p  # cut again, for b
        s.raw_free(p)  # kept for b
    with a:
        assert s.raw_malloc(4 * MiB) != p  # a never gets b's block before a synchronisation
    with b:
        assert s.raw_malloc(4 * MiB) == p  # b's own, at once


def test_threads_allocating_and_freeing_never_share_a_live_block():
    import threading
    fake, s = _s()
    live: set[int] = set()
    clash: list[int] = []
    guard = threading.Lock()

    def work(seed):
        mine = []
        for i in range(400):
            if mine and (i + seed) % 3 == 0:
                p = mine.pop()
                with guard:
                    live.discard(p)
                s.raw_free(p)
            else:
                p = s.raw_malloc((1 + (i + seed) % 4) * MiB)
                with guard:
                    if p in live:
                        clash.append(p)
                    live.add(p)
                mine.append(p)
        for p in mine:
            with guard:
                live.discard(p)
            s.raw_free(p)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clash == [] and s.stats(0).bytes_in_use == 0
    s.trim()
    assert fake.used_bytes(0) == 0


def test_without_remap_alternating_batches_synchronise_far_less_and_reserve_more():
    """remap=False is the option for programs whose sizes change each iteration: growth maps new
    memory instead of moving pages after a device synchronisation (docs/expandable.md, Cost)."""
    runs = {}
    for spec in ("expandable", "expandable:remap=false"):
        fake = FakeBackend(memory="80GiB")
        syncs = fake.n_device_synchronize_calls
        row = replay(fragmentation.program("alternating-batches"), backend=fake, strategies=[spec])["results"][spec]
        runs[spec] = (fake.n_device_synchronize_calls - syncs, row["reserved_over_in_use"])
    (moved_syncs, moved_ratio), (kept_syncs, kept_ratio) = runs["expandable"], runs["expandable:remap=false"]
    assert kept_syncs * 3 < moved_syncs and moved_ratio <= 1.05 < kept_ratio


@pytest.mark.parametrize("size", [4096, 4 * MiB])
def test_a_new_stream_at_a_destroyed_streams_handle_gets_none_of_its_blocks_unsynchronised(size):
    """CUDA may give a new stream the handle of a destroyed one while the destroyed one's kernel
    still runs, and does not order the new stream after it (docs/streams.md). A cache found by
    handle would hand the new stream a block that kernel still writes."""
    import gc

    from helpers import dead_stream_allocation

    fake, s = _s()
    for _ in range(3):
        p, q, B = dead_stream_allocation(fake, s, size)
        assert q != p or fake.busy_destroyed_streams() == 0  # A's block only once A's kernel is done
        fake.device_synchronize(0)
        with B:
            s.raw_free(q)
        del B
        gc.collect()
    st = s.stats(0)
    assert st.bytes_in_use == 0 and st.bytes_reserved <= 4 * max(size, PAGE)
