"""Fragmentation in the statistics on a real device: the bytes cached and the largest free block
of each strategy, and the out-of-memory error that shows them."""

import pytest

import cupy_memstrat

MiB = 1 << 20


def test_managed_knows_its_largest_free_block_and_serves_a_request_of_that_size_from_it(cp):
    s = cupy_memstrat.use("managed")
    a = cp.empty(7 * MiB, dtype=cp.uint8)  # a run of four 2 MiB chunks
    ptr = a.data.ptr
    del a
    st = s.stats()
    assert st.largest_free_block == 8 * MiB and st.bytes_cached == st.bytes_reserved - st.bytes_in_use
    reserved = st.bytes_reserved
    b = cp.empty(st.largest_free_block, dtype=cp.uint8)  # served from the cache: no new chunk
    assert b.data.ptr == ptr and s.stats().bytes_reserved == reserved and s.stats().largest_free_block == 0
    del b
    s.trim()


@pytest.mark.parametrize("spec, expected", [("device", 0), ("async", None), ("pool", None)])
def test_each_strategy_says_what_it_knows_of_its_largest_free_block(cp, spec, expected):
    s = cupy_memstrat.use(spec)
    x = cp.empty(16 * MiB, dtype=cp.uint8)
    del x
    st = s.stats()
    assert st.largest_free_block == expected
    assert st.bytes_cached == st.bytes_reserved - st.bytes_in_use >= 0
    s.trim()


def test_the_out_of_memory_error_names_the_largest_free_block(cp):
    s = cupy_memstrat.use("managed")
    keep = cp.ones(4 * MiB, dtype=cp.uint8)
    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        cp.empty(2 * total, dtype=cp.uint8)  # refused by the guard before any memory is asked for
    assert "largest free block" in str(info.value) and "reserved" in str(info.value)
    assert int(keep.sum()) == 4 * MiB
    del keep
    s.trim()
