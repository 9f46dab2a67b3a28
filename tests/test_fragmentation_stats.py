"""Fragmentation in the statistics, on the simulated GPU: every strategy's Stats carries the bytes
cached (reserved, not in use) and the largest free block it can serve without asking CUDA for
more, or None where the memory behind it does not tell; the out-of-memory error shows them."""

import dataclasses
import json

import pytest

import cupy_memstrat
from cupy_memstrat import Stats, checks
from cupy_memstrat.strategies.managed.slab import CHUNK_BYTES, SIZE_CLASSES, SMALL_MAX, Slab, class_index
from cupy_memstrat.testing import FakeBackend

MiB = 1 << 20


def test_bytes_cached_is_reserved_less_in_use_and_follows_a_replaced_record():
    st = Stats(device=0, strategy="x", bytes_in_use=10 * MiB, bytes_reserved=30 * MiB, largest_free_block=3 * MiB)
    assert st.bytes_cached == 20 * MiB
    assert st.as_dict()["bytes_cached"] == 20 * MiB and st.as_dict()["largest_free_block"] == 3 * MiB
    assert dataclasses.replace(st, bytes_reserved=50 * MiB).bytes_cached == 40 * MiB
    assert st.fragmentation() == "reserved 30.0 MiB, in use 10.0 MiB, largest free block 3.0 MiB"
    assert "largest free block 3.0 MiB" in str(st)
    unknown = dataclasses.replace(st, largest_free_block=None)
    assert unknown.fragmentation() == "reserved 30.0 MiB, in use 10.0 MiB" and "largest" not in str(unknown)
    with pytest.raises(TypeError):
        Stats(device=0, strategy="x", bytes_cached=5)  # computed, not passed


def test_device_caches_nothing_so_its_largest_free_block_is_zero(fake):
    s = cupy_memstrat.create("device", backend=fake)
    p = s.raw_malloc(5 * MiB)
    s.raw_free(p)
    st = s.stats(0)
    assert (st.bytes_cached, st.largest_free_block) == (0, 0)


def test_managed_reports_its_largest_free_run_slot_or_spare_chunk(fake):
    s = cupy_memstrat.create("managed", backend=fake)
    assert s.stats(0).largest_free_block == 0
    big = s.raw_malloc(7 * MiB)  # a run of four chunks
    small = s.raw_malloc(3000)  # a slot of a shared chunk
    st = s.stats(0)
    cls = SIZE_CLASSES[class_index(3000)]
    assert st.largest_free_block == cls  # the rest of the shared chunk: slots of that class
    assert st.bytes_reserved == 8 * MiB + CHUNK_BYTES and st.bytes_cached == st.bytes_reserved - st.bytes_in_use
    s.raw_free(big)
    assert s.stats(0).largest_free_block == 8 * MiB  # the freed run serves requests up to its size
    s.trim()
    s.raw_free(small)
    assert s.stats(0).largest_free_block == cls
    s.trim()
    assert s.stats(0).largest_free_block == 0 and s.stats(0).bytes_reserved == 0


def test_a_strategy_whose_memory_hides_its_free_lists_says_none_not_a_guess(fake):
    s = cupy_memstrat.create("async", backend=fake)
    p = s.raw_malloc(4 * MiB)
    s.raw_free(p)
    assert s.stats(0).largest_free_block is None


def test_the_checking_layer_reports_the_wrapped_strategys_figure(fake):
    inner = cupy_memstrat.create("managed", backend=fake)
    layer = checks.checked(inner, check="streams")
    p = layer.raw_malloc(5 * MiB)
    layer.raw_free(p)
    assert layer.stats(0).largest_free_block == inner.stats(0).largest_free_block == 6 * MiB
    assert layer.largest_free_block(0) == 6 * MiB
    layer.close()
    inner.close()


def test_the_out_of_memory_error_and_its_snapshot_show_the_largest_free_block_where_known(tmp_path):
    fake = FakeBackend(memory="64MiB")
    snap = tmp_path / "oom.json"
    s = cupy_memstrat.create("managed", backend=fake, headroom=0, oom_snapshot=str(snap))
    p = s.raw_malloc(20 * MiB)
    s.raw_free(p)  # a free 20 MiB run, kept while a larger request fails
    keep = s.raw_malloc(20 * MiB)  # reuses it
    q = s.raw_malloc(10 * MiB)
    s.raw_free(q)
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        s.raw_malloc(60 * MiB)
    assert "largest free block" in str(info.value)
    (st,) = json.loads(snap.read_text())["oom"]["stats"]
    assert st["largest_free_block"] == s.stats(0).largest_free_block and st["bytes_cached"] >= 0
    s.raw_free(keep)
    a = cupy_memstrat.create("async", backend=FakeBackend(memory="64MiB"))
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        a.raw_malloc(100 * MiB)
    assert "largest free block" not in str(info.value) and "reserved" in str(info.value)


def test_the_slab_alone_finds_the_largest_free_piece():
    slab = Slab(1)
    base = 0x7F00_0000_0000
    assert slab.largest_free(0) == 0
    ci = class_index(1000)
    slab.add_chunk(0, base, CHUNK_BYTES, ci)
    slab.carve(0, 7, base, ci)  # the rest of the chunk: free slots of that class
    assert slab.largest_free(0) == SIZE_CLASSES[ci]
    slab.spare_small[0].append(base + CHUNK_BYTES)  # a spare chunk serves any slot class
    assert slab.largest_free(0) == SMALL_MAX
    slab.spare_large[0][6 * MiB] = [base + 2 * CHUNK_BYTES]
    assert slab.largest_free(0) == 6 * MiB
