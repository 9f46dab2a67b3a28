"""The expandable strategy on the GPU: CuPy's kernels on blocks that span pages, the reserve on
the fragmenting programs, stream order, a trim that gives memory back to the device
(cudaMemGetInfo before and after) and out of memory."""

import gc

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat.bench import fragmentation
from cupy_memstrat.replay import replay

MiB, PAGE = 1 << 20, 2 << 20


@pytest.fixture
def made(cp):
    """Strategies a test makes; CuPy's allocator is restored, then they are trimmed and closed."""
    out = []
    yield out
    gc.collect()
    for s in out:
        s.trim()
        s.close()


def test_cupy_computes_the_same_results_on_blocks_that_span_pages(cp, made):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1500, 1300)), rng.standard_normal((1300, 900))
    want = (a @ b, np.fft.fft(a[:, :1024]).real.sum())
    s = cupy_memstrat.create("expandable")
    made.append(s)
    with cupy_memstrat.using(s):
        x, y = cp.asarray(a), cp.asarray(b)  # 15.6 MiB and 9.4 MiB: several pages each
        got = ((x @ y).get(), float(cp.fft.fft(x[:, :1024]).real.sum()))
        del x, y
    assert np.allclose(got[0], want[0]) and np.isclose(got[1], want[1])
    assert s.stats(0).n_live == 0


@pytest.mark.parametrize("program", ["16-then-32", "32-then-16", "growing-buffer", "random-sizes",
                                     "alternating-batches"])
def test_the_reserve_stays_within_5_percent_of_the_peak_in_use_rounded_up_to_pages(cp, program):
    # the same bound as tests/test_expandable.py's on the simulated GPU
    row = replay(fragmentation.program(program), strategies=["expandable"], cupy_paths=[])["results"]["expandable"]
    pages = -(-row["peak_in_use"] // PAGE) * PAGE
    assert row["completed"] and row["peak_reserved"] <= 1.05 * pages


def test_a_block_freed_on_one_stream_goes_to_another_only_after_a_synchronisation(cp, made):
    s = cupy_memstrat.create("expandable", remap=False)
    made.append(s)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with cupy_memstrat.using(s):
        with a:
            x = cp.ones(MiB, dtype=cp.float32)  # 4 MiB
            guard = cp.ones(1, dtype=cp.uint8)  # keeps x's range apart from the rest
            p = x.data.ptr
            del x
        with b:
            y = cp.zeros(MiB, dtype=cp.float32)
            assert y.data.ptr != p  # b never gets a's block while a's work may use it
        with a:
            z = cp.zeros(MiB, dtype=cp.float32)
            assert z.data.ptr == p  # a's own, at once
            del z
        s.trim()  # synchronises the device: every free is ordered
        with b:
            w = cp.zeros(MiB, dtype=cp.float32)
            assert w.data.ptr == p
            assert float(w.sum()) == 0.0
        del y, w, guard


def _a_freed_gigabyte_beside_a_live_block(cp):
    """A live 3 MiB array and 1 GiB allocated and freed after it: (the array, the device's free
    memory then)."""
    keep = cp.ones(3 * MiB, dtype=cp.uint8)
    tmp = [cp.ones(256 * MiB, dtype=cp.uint8) for _ in range(4)]
    del tmp
    cp.cuda.Device().synchronize()
    return keep, cp.cuda.runtime.memGetInfo()[0]


@pytest.mark.gpu_exclusive  # reads the device's free memory: run alone (ci/gpu.sh)
def test_trim_gives_the_unused_pages_back_to_the_device(cp, made):
    s = cupy_memstrat.create("expandable")
    made.append(s)
    with cupy_memstrat.using(s):
        keep, free0 = _a_freed_gigabyte_beside_a_live_block(cp)
        released = s.trim()
        free1 = cp.cuda.runtime.memGetInfo()[0]
        assert released == 1024 * MiB and free1 - free0 >= released
        assert s.stats(0).bytes_reserved == 4 * MiB
        assert int(keep.sum()) == 3 * MiB  # the live block stays where it was, mapped
        del keep


@pytest.mark.gpu_exclusive  # reads the device's free memory: no other test may allocate meanwhile
@pytest.mark.parametrize("threshold", [None, "64MiB"])
def test_the_release_threshold_gives_unused_pages_back_at_the_next_allocation(cp, made, threshold):
    # None, the default, is the control: the freed gigabyte stays mapped
    s = cupy_memstrat.create("expandable", release_threshold=threshold)
    made.append(s)
    with cupy_memstrat.using(s):
        keep, free0 = _a_freed_gigabyte_beside_a_live_block(cp)
        small = cp.ones(MiB, dtype=cp.uint8)  # the next allocation trims down to the threshold
        free1 = cp.cuda.runtime.memGetInfo()[0]
        st = s.stats(0)
        if threshold is None:
            assert st.bytes_reserved >= 1024 * MiB and abs(free1 - free0) < 64 * MiB
        else:
            assert st.bytes_reserved - st.bytes_in_use <= 64 * MiB + 2 * MiB
            assert free1 - free0 >= 1024 * MiB - 64 * MiB - 2 * MiB
        assert int(keep.sum()) == 3 * MiB and int(small.sum()) == MiB
        del keep, small


@pytest.mark.gpu_exclusive  # asks for more than the device has (physical memory, not managed: refused at once)
def test_out_of_memory_says_what_ran_out_and_loses_nothing(cp, made):
    s = cupy_memstrat.create("expandable", max_size="64MiB")
    made.append(s)
    with cupy_memstrat.using(s):
        x = cp.ones(48 * MiB, dtype=cp.uint8)
        with pytest.raises(cupy_memstrat.OutOfMemoryError, match="max_size 64.0 MiB reached"):
            cp.empty(32 * MiB, dtype=cp.uint8)
        assert int(x.sum()) == 48 * MiB
        del x
    t = cupy_memstrat.create("expandable")
    made.append(t)
    free, total = cp.cuda.runtime.memGetInfo()
    with cupy_memstrat.using(t):
        y = cp.ones(16 * MiB, dtype=cp.uint8)
        need = free + (total - free) // 2  # more than is free, less than the device has
        with pytest.raises(cupy_memstrat.OutOfMemoryError, match="the device's memory is used up"):
            cp.empty(need, dtype=cp.uint8)
        with pytest.raises(cupy_memstrat.OutOfMemoryError, match="the request is larger than the device's memory"):
            cp.empty(total + (1 << 30), dtype=cp.uint8)
        assert int(y.sum()) == 16 * MiB
        del y
