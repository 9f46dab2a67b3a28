"""The device strategy's logic on the fake backend: accounting, errors, threads."""

import sys
import warnings

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat import InvalidFreeWarning, Stats
from cupy_memstrat.backends import ERROR_SUCCESS
from cupy_memstrat.testing import FakeBackend


@pytest.fixture
def dev(fake):
    return cupy_memstrat.DeviceStrategy(backend=fake)


def test_one_cuda_malloc_and_free_per_allocation_and_exact_stats(dev, fake):
    ptrs = [dev.raw_malloc(n, 0) for n in (1000, 2000, 3000)]
    assert fake.n_malloc_calls == 3
    st = dev.stats(0)
    assert (st.bytes_in_use, st.bytes_reserved, st.n_allocs, st.n_live) == (6000, 6000, 3, 3)
    dev.raw_free(ptrs[1], 0)
    st = dev.stats(0)
    assert fake.n_free_calls == 1 and not fake.is_allocated(ptrs[1])
    assert (st.bytes_in_use, st.peak_bytes_in_use, st.n_frees, st.n_live) == (4000, 6000, 1, 2)
    assert st.peak_bytes_reserved == 6000 and st.bytes_reserved == 4000
    for p in (ptrs[0], ptrs[2]):
        dev.raw_free(p, 0)
    assert fake.used_bytes(0) == 0
    assert dev.stats(0) == Stats(
        device=0, strategy="device", peak_bytes_in_use=6000, peak_bytes_reserved=6000, n_allocs=3, n_frees=3,
        largest_free_block=0,  # caches nothing
    )


def test_reset_peak_sets_peaks_to_current(dev):
    a = dev.raw_malloc(5000, 0)
    b = dev.raw_malloc(7000, 0)
    dev.raw_free(b, 0)
    assert dev.stats(0).peak_bytes_in_use == 12000
    dev.reset_peak(0)
    st = dev.stats(0)
    assert st.peak_bytes_in_use == st.bytes_in_use == 5000
    assert st.peak_bytes_reserved == 5000
    dev.raw_free(a, 0)


def test_stats_default_to_current_device(fake2):
    s = cupy_memstrat.DeviceStrategy(backend=fake2)
    fake2.set_device(1)
    p = s.raw_malloc(4096)  # device read from the backend: 1
    assert s.stats().device == 1 and s.stats().bytes_in_use == 4096
    assert s.stats(0).bytes_in_use == 0
    s.raw_free(p)


def test_size_zero_is_the_null_pointer_and_allocates_nothing(dev, fake):
    assert dev.raw_malloc(0, 0) == 0
    assert fake.n_malloc_calls == 0
    assert dev.stats(0).n_allocs == 0
    dev.raw_free(0, 0)  # the null pointer frees nothing, silently
    assert dev.stats(0).n_invalid_frees == 0


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.5, TypeError), ("8", TypeError), (True, TypeError),
                                      (None, TypeError)])
def test_bad_sizes_raise_and_lose_nothing(dev, fake, bad, exc):
    keep = dev.raw_malloc(4096, 0)
    before = dev.stats(0)
    with pytest.raises(exc, match="size: expected") as info:
        dev.raw_malloc(bad, 0)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)
    assert dev.stats(0) == before and fake.is_allocated(keep)
    assert dev.live_allocations()[0].ptr == keep


def test_numpy_integer_sizes_are_accepted(dev):
    p = dev.raw_malloc(np.int64(2048), 0)
    assert dev.stats(0).bytes_in_use == 2048
    dev.raw_free(p, 0)


def test_out_of_memory_names_request_and_stats_and_keeps_everything(dev, fake):
    keep = dev.raw_malloc(512 * 2**20, 0)
    oom = cupy_memstrat.OutOfMemoryError
    with pytest.raises(oom) as info:
        dev.raw_malloc(600 * 2**20, 0)
    e = info.value
    msg = str(e)
    assert "out of memory allocating 600.0 MiB (629,145,600 bytes) on device 0" in msg
    assert "512.0 MiB in use in 1 allocation (" in msg
    assert "CUDA reports 512.0 MiB free of 1.0 GiB" in msg
    assert e.requested == 600 * 2**20 and e.device == 0 and e.stats.bytes_in_use == 512 * 2**20
    assert isinstance(e, MemoryError)
    # CUDA's sticky error is cleared; nothing was lost; the next request works.
    assert fake.peek_last_error() == ERROR_SUCCESS
    assert fake.is_allocated(keep)
    st = dev.stats(0)
    assert (st.n_failed, st.n_live, st.bytes_in_use) == (1, 1, 512 * 2**20)
    p = dev.raw_malloc(256 * 2**20, 0)
    assert dev.stats(0).n_live == 2
    dev.raw_free(p, 0)
    dev.raw_free(keep, 0)


def test_oom_is_cupys_error_class_when_cupy_is_present():
    cupy = pytest.importorskip("cupy")
    assert issubclass(cupy_memstrat.OutOfMemoryError, cupy.cuda.memory.OutOfMemoryError)


def test_unknown_and_double_frees_warn_count_and_never_reach_cuda(dev, fake):
    p = dev.raw_malloc(4096, 0)
    dev.raw_free(p, 0)
    calls = fake.n_free_calls
    with pytest.warns(InvalidFreeWarning, match="does not own"):
        dev.raw_free(p, 0)  # double free
    with pytest.warns(InvalidFreeWarning, match=r"0xdead"):
        dev.raw_free(0xDEAD, 0)  # never allocated
    assert fake.n_free_calls == calls
    assert dev.stats(0).n_invalid_frees == 2
    assert dev.stats(0).n_frees == 1


def test_allocates_on_current_device_and_frees_for_the_owner(fake2):
    s = cupy_memstrat.DeviceStrategy(backend=fake2)
    fake2.set_device(1)
    p = s.raw_malloc(10_000, 1)
    assert fake2.owner_device(p) == 1
    fake2.set_device(0)  # another device is current when the array dies
    s.raw_free(p, 1)
    assert not fake2.is_allocated(p)
    assert s.stats(1).bytes_in_use == 0 and s.stats(1).n_frees == 1
    assert s.stats(0).n_frees == 0


def test_bad_device_arguments(dev):
    with pytest.raises(ValueError, match=r"expected 0 <= device < 1, got 3"):
        dev.stats(3)
    with pytest.raises(TypeError, match="expected an int device ordinal"):
        dev.stats("0")


def test_live_allocations_largest_first_with_origins(fake):
    s = cupy_memstrat.DeviceStrategy(backend=fake, track_origins=True)
    small = s.raw_malloc(100, 0)
    big, line = s.raw_malloc(10_000, 0), sys._getframe().f_lineno
    rows = s.live_allocations()
    assert [r.ptr for r in rows] == [big, small]
    assert rows[0].origin.filename == __file__
    assert rows[0].origin.function == "test_live_allocations_largest_first_with_origins"
    assert rows[0].origin.lineno == line
    assert str(rows[0]).startswith("9.8 KiB on device 0") and f"test_device_strategy.py:{line}" in str(rows[0])
    s.raw_free(small, 0)
    s.raw_free(big, 0)
    assert s.live_allocations() == []


def test_origins_are_off_by_default(dev):
    p = dev.raw_malloc(100, 0)
    assert dev.live_allocations()[0].origin is None
    dev.raw_free(p, 0)


def test_free_failure_in_cuda_is_a_warning_not_a_crash(dev, fake):
    p = dev.raw_malloc(4096, 0)
    fake.free(p)  # someone else freed it behind the strategy's back
    with pytest.warns(RuntimeWarning, match="failed: cudaErrorInvalidValue"):
        dev.raw_free(p, 0)
    fake.clear_last_error()
    assert dev.stats(0).n_live == 0


def test_no_gpu_gives_a_clear_error_naming_cuda():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        n = 0
    if n:
        pytest.skip("a GPU is present")
    with pytest.raises(cupy_memstrat.NoDeviceError, match="no CUDA device is available"):
        cupy_memstrat.create("device")


def test_a_normal_alloc_and_free_emit_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = cupy_memstrat.DeviceStrategy(backend=FakeBackend())
        s.raw_free(s.raw_malloc(1, 0), 0)


def test_raw_malloc_refuses_a_device_that_is_not_current(fake2):
    s = cupy_memstrat.DeviceStrategy(backend=fake2)
    with pytest.raises(ValueError, match=r"allocates on the current device \(0\), got device=1"):
        s.raw_malloc(4096, 1)
    assert fake2.used_bytes(0) == fake2.used_bytes(1) == 0 and s.stats(1).n_allocs == 0
    p = s.raw_malloc(4096, np.int64(0))  # numpy ints are device ordinals too
    assert s.stats(0).n_live == 1
    s.raw_free(p)


@pytest.mark.parametrize("bad", ["fake", 42, FakeBackend])
def test_a_bad_backend_is_a_clear_type_error(bad):
    with pytest.raises(TypeError, match=r"backend: expected a CUDA backend object"):
        cupy_memstrat.create("device", backend=bad)


@pytest.mark.parametrize("bad", [1.5, "0x10", float("nan"), [1], -4])
def test_raw_free_of_a_non_pointer_warns_and_never_raises(dev, bad):
    keep = dev.raw_malloc(64, 0)
    with pytest.warns(InvalidFreeWarning, match="does not own"):
        dev.raw_free(bad)
    assert dev.stats(0).n_invalid_frees == 1 and dev.stats(0).n_live == 1
    dev.raw_free(keep)


def test_invalid_free_warning_points_at_the_caller_and_can_be_an_error(dev):
    with pytest.warns(InvalidFreeWarning) as rec:
        dev.raw_free(0xBAD)
    assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InvalidFreeWarning):
            dev.raw_free(0xBAD)


@pytest.mark.parametrize("spec", ["device", "managed", "async", "pool", "device:check=all", "managed:check=streams"])
def test_every_strategys_invalid_free_warning_names_the_users_line(fake, spec):
    s = cupy_memstrat.create(spec, backend=fake)
    p = s.raw_malloc(1000, 0)
    s.raw_free(p, 0)
    with pytest.warns(InvalidFreeWarning) as rec:
        s.raw_free(p, 0)  # double free, through the hot path CuPy calls
    with pytest.warns(InvalidFreeWarning) as rec2:
        s.raw_free(1.5)  # not a pointer: refused before the hot path
    assert [(w.filename, w.lineno) for w in rec] == [(__file__, rec[0].lineno)]
    assert rec[0].filename == __file__ and rec2[0].filename == __file__, (rec[0], rec2[0])
    s.close()


def test_close_twice_is_harmless_and_the_strategy_still_works(dev):
    dev.close()
    dev.close()
    p = dev.raw_malloc(10, 0)
    dev.raw_free(p, 0)
    assert dev.stats(0).n_frees == 1


def test_a_user_strategy_without_a_cache_reports_reserved_as_in_use(fake):
    class Plain(cupy_memstrat.Strategy):
        name = "plain"

        def allocate(self, size):
            return self.backend.malloc(size)

        def deallocate(self, ptr):
            self.backend.free(ptr)

    s = Plain(backend=fake)
    p = s.raw_malloc(4096)
    assert s.stats().bytes_reserved == 4096
    s.raw_free(p)


def test_a_caching_strategy_reports_what_it_holds_from_cuda(fake):
    class Hoarder(cupy_memstrat.Strategy):
        """Takes 1 MiB from CUDA once and never gives it back (a toy pool)."""

        name = "hoarder"
        reserved_is_in_use = False

        def allocate(self, size):
            ptr = self.backend.malloc(1 << 20)
            self.record_reserved(0, 1 << 20)
            return ptr

        def deallocate(self, ptr):
            self.backend.free(ptr)
            self.record_reserved(0, -(1 << 20))

    s = Hoarder(backend=fake)
    p = s.raw_malloc(10)
    st = s.stats()
    assert (st.bytes_in_use, st.bytes_reserved, st.peak_bytes_reserved) == (10, 1 << 20, 1 << 20)
    s.raw_free(p)
    assert s.stats().bytes_reserved == 0 and s.stats().peak_bytes_reserved == 1 << 20


def test_sizes_beyond_size_t_are_a_value_error_and_lose_nothing(dev):
    keep = dev.raw_malloc(64, 0)
    for huge in (2**64, 2**70):
        with pytest.raises(ValueError, match="does not fit in size_t"):
            dev.raw_malloc(huge, 0)
    assert dev.stats(0).n_live == 1 and dev.stats(0).n_failed == 0
    dev.raw_free(keep)


def test_a_size_just_below_size_t_is_an_out_of_memory_error(dev):
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="out of memory allocating 16.0 EiB"):
        dev.raw_malloc(2**64 - 1, 0)


def test_stats_read_as_english(dev):
    dev.raw_free(dev.raw_malloc(4096, 0), 0)
    assert "0 live, 1 alloc, 1 free, 0 failed" in str(dev.stats(0))
