"""The checking layer (cupy_memstrat.checks) on the fake backend: what each check
finds, what it must not find, its options and policies, and its accounting."""

import warnings

import pytest

import cupy_memstrat
from cupy_memstrat import checks
from cupy_memstrat.checks import CANARY_BYTE, POISON_BYTE, CheckError, CheckWarning, parse_checks
from cupy_memstrat.checks.layer import CheckedStrategy
from cupy_memstrat.strategies.reachable import REACHABLE
from cupy_memstrat.testing import FakeBackend


@pytest.fixture(autouse=True)
def _clean_findings():
    checks.clear()
    yield
    checks.clear()


def make(fake, check="all", strategy="device", **kw):
    kw.setdefault("on_finding", "record")
    return cupy_memstrat.create(strategy, backend=fake, check=check, **kw)


# -- options and specs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("streams", {"streams"}),
        ("streams,poison", {"streams", "poison"}),
        ("poison+redzone", {"poison", "redzone"}),
        ("all", {"streams", "poison", "redzone"}),
        (" Streams | REDZONE ", {"streams", "redzone"}),
        (["poison"], {"poison"}),
        ("off", set()),
        ("", set()),
        (None, set()),
    ],
)
def test_parse_checks(value, expected):
    assert parse_checks(value) == frozenset(expected)


@pytest.mark.parametrize("value, match", [("stream",
                                           "unknown check 'stream'.*valid: streams, poison, redzone, all or off"),
                                          ("poison,leaks", "unknown check 'leaks'")])
def test_parse_checks_names_the_bad_value(value, match):
    with pytest.raises(ValueError, match=match):
        parse_checks(value)


def test_parse_checks_refuses_non_strings():
    with pytest.raises(TypeError, match="check: expected"):
        parse_checks(3)


def test_spec_string_takes_comma_separated_checks(fake):
    s = cupy_memstrat.create("device:check=streams,poison,on_finding=warn", backend=fake)
    assert isinstance(s, CheckedStrategy)
    assert s.checks == {"streams", "poison"} and s.config["on_finding"] == "warn"
    assert s.name == "device" and s.inner.name == "device"
    name, opts = cupy_memstrat.validate("async:release_threshold=1GiB,check=all")
    assert name == "async" and opts["check"] == {"streams", "poison", "redzone"}


def test_no_checks_gives_the_plain_strategy(fake):
    s = cupy_memstrat.create("device", backend=fake, check="off")
    assert type(s) is cupy_memstrat.DeviceStrategy


@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(check="all", on_finding="explode"), "on_finding: expected 'raise', 'warn' or 'record', got 'explode'"),
        (dict(check="all", redzone_bytes=0), "redzone_bytes: expected bytes > 0, got 0"),
        (dict(check="all", redzone_bytes="10%"), "redzone_bytes: expected bytes, not a percentage"),
        (dict(check="all", quarantine_count=-1), "quarantine_count: expected a count >= 0, got -1"),
        (dict(check="all", quarantine_count="\u0661\u0662"), r"quarantine_count: expected an integer \(ASCII digits\)"),
        (dict(check="all", quarantine_count="1_000"), r"quarantine_count: expected an integer \(ASCII digits\)"),
        (dict(check="all", quarantine_bytes="lots"), "quarantine_bytes"),
        (dict(check="sanity"), "unknown check 'sanity'"),
        (dict(check="all,off"), "'off' stands alone"),
        (dict(on_finding="warn"), "option 'on_finding' needs checks"),
        (dict(check="streams", redzone_bytes=512),
         "option 'redzone_bytes' applies to the redzone check, which is not on"),
        (dict(check="redzone", quarantine_count=3), "option 'quarantine_count' applies to the poison check"),
    ],
)
def test_bad_check_options_are_refused_before_anything_is_made(fake, opts, match):
    with pytest.raises(ValueError, match=match):
        cupy_memstrat.create("device", backend=fake, **opts)
    with pytest.raises(ValueError, match=match):
        cupy_memstrat.validate("device", **opts)
    assert fake.n_malloc_calls == 0


def test_existing_strategy_can_be_wrapped_but_not_twice(fake):
    inner = cupy_memstrat.DeviceStrategy(backend=fake)
    kept = inner.raw_malloc(1000)
    s = cupy_memstrat.create(inner, check="redzone")
    assert isinstance(s, CheckedStrategy) and s.inner is inner
    with pytest.raises(TypeError, match="already checked"):
        checks.checked(s)
    with pytest.raises(TypeError, match="expected a cupy_memstrat.Strategy"):
        checks.checked("device")
    with pytest.raises(ValueError, match="given with an existing strategy object"):
        cupy_memstrat.create(inner, track_origins=True)
    assert inner.live_sizes() == {kept: 1000}  # nothing lost


# -- redzone -----------------------------------------------------------------------------------------


def test_redzone_catches_a_write_past_the_end_with_both_sites(fake):
    s = make(fake, "redzone")
    p = s.raw_malloc(1000)
    assert p % 256 == 0
    assert fake.read(p + 1000, 3) == [CANARY_BYTE] * 3  # the canary starts right after the array
    fake.write(p + 1000 + 4, b"\x00\x00")  # two bytes, five bytes past the end
    s.raw_free(p)
    (f,) = checks.collect()
    assert f.kind == "out-of-bounds write" and f.check == "redzone"
    assert (f.ptr, f.size, f.bad_bytes, f.first_bad_offset) == (p, 1000, 2, 1004)
    assert f.alloc_site.function == f.free_site.function == "test_redzone_catches_a_write_past_the_end_with_both_sites"
    assert f.free_site.lineno == f.alloc_site.lineno + 4
    assert "byte 5 past the end" in f.message
    assert checks.findings() == [f]


def test_redzone_ignores_writes_inside_the_array(fake):
    s = make(fake, "redzone")
    p = s.raw_malloc(1000)
    fake.write(p, b"\x07" * 1000)
    s.raw_free(p)
    assert checks.collect() == []


def test_redzone_keeps_blocks_256_aligned_and_pads_to_multiples_of_256(fake):
    s = make(fake, "redzone", redzone_bytes=300)  # rounded up to 512
    assert s.config["redzone_bytes"] == 512
    ptrs = [s.raw_malloc(n) for n in (1, 255, 256, 257)]
    assert all(p % 256 == 0 for p in ptrs)
    inner_sizes = sorted(s.inner.live_sizes().values())
    assert inner_sizes == [256 + 512, 256 + 512, 256 + 512, 512 + 512]
    st = s.stats()
    assert st.bytes_in_use == 1 + 255 + 256 + 257  # what the program asked for
    assert st.bytes_reserved == sum(inner_sizes)


# -- poison --------------------------------------------------------------------------------------------


def test_poison_fills_freed_blocks_and_catches_a_write_after_free(fake):
    s = make(fake, "poison")
    p = s.raw_malloc(4096)
    s.raw_free(p)
    assert set(fake.read(p, 4096)) == {POISON_BYTE}
    assert fake.is_allocated(p)  # held in quarantine, not given back yet
    fake.write(p + 100, b"\x01")
    (f,) = checks.collect()
    assert f.kind == "write after free" and f.first_bad_offset == 100 and f.bad_bytes == 1
    assert not fake.is_allocated(p)  # collect() emptied the quarantine


def test_intact_poison_gives_no_finding(fake):
    s = make(fake, "poison")
    for n in (10, 1000, 1 << 20):
        s.raw_free(s.raw_malloc(n))
    assert checks.collect() == []


def test_quarantine_limits_release_the_oldest_block_first(fake):
    s = make(fake, "poison", quarantine_count=2, quarantine_bytes="1GiB")
    ptrs = [s.raw_malloc(1000) for _ in range(3)]
    for p in ptrs[:2]:
        s.raw_free(p)
    assert fake.n_free_calls == 0
    s.raw_free(ptrs[2])
    assert fake.n_free_calls == 1 and not fake.is_allocated(ptrs[0]) and fake.is_allocated(ptrs[1])
    s2 = make(fake, "poison", quarantine_count=100, quarantine_bytes=4096)
    a, b = s2.raw_malloc(3000), s2.raw_malloc(3000)  # 3072 B blocks
    s2.raw_free(a)
    assert fake.is_allocated(a)
    s2.raw_free(b)  # 6 KiB held > 4 KiB: a leaves
    assert not fake.is_allocated(a) and fake.is_allocated(b)


def test_quarantined_blocks_count_as_reserved_not_in_use(fake):
    s = make(fake, "poison")
    p = s.raw_malloc(10_000)
    s.raw_free(p)
    st = s.stats()
    assert (st.bytes_in_use, st.n_live, st.n_frees) == (0, 0, 1)
    assert st.bytes_reserved == 10_240 and s.live_allocations() == []
    s.trim()  # trim gives the quarantine back too
    assert s.stats().bytes_reserved == 0


def test_quarantine_is_given_back_when_memory_runs_out(fake):
    fake_small = FakeBackend(memory="1MiB")
    s = make(fake_small, "poison", quarantine_bytes="1GiB")
    p = s.raw_malloc(700 << 10)
    s.raw_free(p)
    q = s.raw_malloc(700 << 10)  # only fits once the quarantined block is verified and freed
    assert q and not checks.collect()


def test_out_of_memory_still_fails_clearly_and_keeps_live_blocks(fake):
    s = make(FakeBackend(memory="1MiB"), "all")
    keep = s.raw_malloc(100)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="out of memory"):
        s.raw_malloc(2 << 20)
    assert s.live_sizes() == {keep: 100}


# -- streams ----------------------------------------------------------------------------------------


def _streams(fake, non_blocking=False):
    return fake.stream(non_blocking=non_blocking), fake.stream(non_blocking=non_blocking)


def test_cross_stream_reuse_is_found_when_the_other_stream_is_still_busy(fake):
    s = make(fake, "streams")
    A, B = _streams(fake)
    with A:
        x = s.raw_malloc(4096)
    with B:
        y = s.raw_malloc(64)  # the program used B while x was alive
        fake.launch(B)  # a long kernel on B (reading x)
    with A:
        s.raw_free(x)  # back to A for reuse, nothing orders B before A
    (f,) = checks.findings()
    assert f.kind == "cross-stream reuse"
    assert (f.alloc_stream, f.free_stream, f.other_stream) == (A.ptr, A.ptr, B.ptr)
    assert f.alloc_thread == f.free_thread == "MainThread" and f.free_site is not None
    assert f"stream 0x{B.ptr:x} still had work queued" in f.message
    s.raw_free(y)


def test_a_free_while_another_busy_stream_is_current_is_found(fake):
    s = make(fake, "streams")
    A, C = _streams(fake)
    with A:
        x = s.raw_malloc(4096)
    fake.launch(C)
    with C:
        s.raw_free(x)
    (f,) = checks.findings()
    assert (f.alloc_stream, f.free_stream, f.other_stream) == (A.ptr, C.ptr, C.ptr)


@pytest.mark.parametrize("case", ["other idle", "synchronised", "used only before", "legacy orders blocking"])
def test_no_cross_stream_finding_when_the_streams_are_ordered(fake, case):
    s = make(fake, "streams")
    A, B = _streams(fake)
    if case == "used only before":
        with B:
            s.raw_free(s.raw_malloc(64))
            fake.launch(B)
    if case == "legacy orders blocking":
        A = fake.current_stream()  # the legacy default stream; B is a blocking stream
    with A:
        x = s.raw_malloc(4096)
    if case != "used only before":
        with B:
            y = s.raw_malloc(64)
            if case != "other idle":
                fake.launch(B)
        if case == "synchronised":
            B.synchronize()
    with A:
        s.raw_free(x)
    assert checks.findings() == []


def test_legacy_stream_does_not_order_non_blocking_streams(fake):
    s = make(fake, "streams")
    B = fake.stream(non_blocking=True)
    x = s.raw_malloc(4096)  # on the legacy default stream
    with B:
        y = s.raw_malloc(64)
        fake.launch(B)
    s.raw_free(x)
    assert [f.kind for f in checks.findings()] == ["cross-stream reuse"]


@pytest.mark.parametrize("first, finding", [("A", True), ("B", False)])
def test_both_streams_busy_is_decided_by_which_finishes_first(fake, first, finding):
    s = make(fake, "streams")
    A, B = _streams(fake)
    with A:
        x = s.raw_malloc(4096)
    with B:
        y = s.raw_malloc(64)
        fake.launch(B)
    fake.launch(A)
    with A:
        s.raw_free(x)
    assert checks.findings() == []  # undecided: both streams still busy
    fake.finish(A if first == "A" else B)
    with A:
        s.raw_malloc(8)  # the next allocation looks at the events
    assert [f.kind for f in checks.findings()] == (["cross-stream reuse"] if finding else [])


def test_expect_stream_reports_allocations_on_the_legacy_stream_once_per_site(fake):
    s = make(fake, "streams")
    F = fake.stream(non_blocking=True)
    with checks.expect_stream(F):
        with F:
            s.raw_malloc(8)  # on the expected stream: fine
        for _ in range(3):
            s.raw_malloc(8)  # the legacy stream is current: one finding for this line
    s.raw_malloc(8)  # outside expect_stream: fine
    (f,) = checks.findings()
    assert f.kind == "legacy stream" and f.other_stream == F.ptr and f.alloc_stream == 0
    with pytest.raises(TypeError, match="stream: expected a stream object"):
        with checks.expect_stream("s"):
            pass


def test_fresh_stream_is_current_non_blocking_and_expected(fake):
    with checks.fresh_stream(backend=fake) as F:
        assert fake.current_stream() is F and F.non_blocking
        assert checks._expected
    assert fake.current_stream().ptr == 0 and not checks._expected


# -- policies ------------------------------------------------------------------------------------------


def test_raise_policy_raises_at_the_next_allocation_and_loses_nothing(fake):
    s = make(fake, "redzone", on_finding="raise")
    keep = s.raw_malloc(100)
    p = s.raw_malloc(100)
    fake.write(p + 100, b"\x00")
    s.raw_free(p)  # a free cannot raise (CuPy calls it from a finaliser)
    n = s.stats().n_allocs
    with pytest.raises(CheckError, match="out-of-bounds write") as exc:
        s.raw_malloc(100)  # the kernel's flag is seen here
    assert exc.value.findings[0].ptr == p
    assert s.stats().n_allocs == n and s.live_sizes() == {keep: 100}
    q = s.raw_malloc(100)  # raised once; the next allocation works
    assert q


def test_raise_policy_raises_from_collect(fake):
    s = make(fake, "poison", on_finding="raise")
    p = s.raw_malloc(100)
    s.raw_free(p)
    fake.write(p, b"\x00")
    with pytest.raises(CheckError, match="write after free"):
        checks.collect()
    assert checks.collect() == []  # raised once


def test_warn_policy_warns_where_found(fake):
    s = make(fake, "streams", on_finding="warn")
    A, B = _streams(fake)
    with A:
        x = s.raw_malloc(4096)
    with B:
        s.raw_malloc(64)
        fake.launch(B)
    with pytest.warns(CheckWarning, match="cross-stream reuse"):
        with A:
            s.raw_free(x)


def test_record_policy_only_records(fake):
    s = make(fake, "poison", on_finding="record")
    p = s.raw_malloc(100)
    s.raw_free(p)
    fake.write(p, b"\x00")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = checks.collect()
    assert [f.kind for f in found] == ["write after free"]
    checks.clear()
    assert checks.findings() == []


# -- the kernels' result slots -----------------------------------------------------------------------------


def test_running_out_of_result_slots_collects_first(fake, monkeypatch):
    from cupy_memstrat.testing import FakeCheckKernels

    monkeypatch.setattr(FakeCheckKernels, "SLOTS", 4)
    s = make(fake, "redzone")
    ptrs = [s.raw_malloc(100) for _ in range(6)]
    fake.write(ptrs[0] + 100, b"\x00")
    syncs = fake.n_device_synchronize_calls
    for p in ptrs:
        s.raw_free(p)
    assert fake.n_device_synchronize_calls == syncs + 1  # the fifth check waited for the first four
    assert [f.ptr for f in checks.findings()] == [ptrs[0]]
    assert checks.collect() == []


# -- over every strategy, and third-party ones -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["device", "async", "managed"])
def test_every_built_in_strategy_can_be_checked(fake, name):
    s = make(fake, "all", strategy=name)
    A, B = _streams(fake)
    ptrs = [s.raw_malloc(n) for n in (1, 1000, 3 << 20)]
    with A:
        ptrs.append(s.raw_malloc(4096))
    for p in ptrs:
        s.raw_free(p)
    assert checks.collect() == []
    st = s.stats()
    assert (st.n_allocs, st.n_frees, st.bytes_in_use) == (4, 4, 0)
    if name == "async":
        assert s.pool_stats().device == 0  # the wrapped strategy's own methods
    s.close()


def test_a_third_party_strategy_can_be_checked(fake):
    class Bump(cupy_memstrat.Strategy):
        name = "bump-test"

        def __init__(self, **kw):
            super().__init__(**kw)
            self.allocate = self.backend.malloc
            self.deallocate = self.backend.free

    s = checks.checked(Bump(backend=fake), check="redzone,poison", on_finding="record")
    p = s.raw_malloc(10)
    fake.write(p + 10, b"\x00")
    s.raw_free(p)
    assert [f.kind for f in checks.collect()] == ["out-of-bounds write"]
    assert checks.findings()[0].strategy == "bump-test"


def test_collect_returns_findings_whatever_layer_read_them(fake):
    """Layers on one backend share the kernels' result slots: the first layer
    to collect reads every layer's checks, and collect() still returns them."""
    first = make(fake, "redzone", strategy="device")
    second = make(fake, "redzone", strategy="async")
    p = second.raw_malloc(100)
    fake.write(p + 100, b"\x00")
    second.raw_free(p)
    (f,) = checks.collect()
    assert f.ptr == p and f.strategy == "async"
    first.close()
    second.close()


def test_streams_of_other_devices_are_not_candidates(fake2):
    """Handle 0 names each device's own legacy stream. Work queued on device
    1's does not make a free on device 0 a finding: it reaches the block only
    through peer access, and CuPy's multi-GPU copies keep it busy with
    unrelated work (false findings in CuPy's own tests on the H200). A stream
    of the block's own device still is a candidate."""
    s = make(fake2, "streams")
    x = s.raw_malloc(4096)  # device 0, its legacy stream
    fake2.set_device(1)
    y = s.raw_malloc(64)  # device 1's legacy stream is in use while x is alive
    fake2.launch(fake2.null_stream(1))
    fake2.set_device(0)
    B = fake2.stream(0, non_blocking=True)
    with B:
        z = s.raw_malloc(64)
    s.raw_free(x)
    assert checks.findings() == []
    x = s.raw_malloc(4096)
    with B:
        z2 = s.raw_malloc(64)
        fake2.launch(B)
    s.raw_free(x)
    (f,) = checks.findings()
    assert f.other_stream == B.ptr and f.device == 0


def test_no_deadlock_when_the_garbage_collector_frees_inside_the_checks(fake, monkeypatch):
    """CuPy frees from finalisers, which the garbage collector runs inside any
    Python allocation, the checks' own code included: nothing there may hold
    a lock that a nested free needs (a pytest-xdist worker hung in CuPy's
    suite on the H200). Here a collection runs while findings() copies the
    findings, and each free it causes records a finding and queues kernels."""
    import faulthandler
    import gc

    import importlib

    C = importlib.import_module("cupy_memstrat.checks.findings")  # the module (checks.findings is the function)

    s = make(fake, "all", quarantine_count=2)
    A, B = _streams(fake)

    class Holder:  # frees its block when collected, as CuPy's memory objects do
        def __init__(self, ptr):
            self.ptr, self.me = ptr, self  # a reference cycle: only the collector frees it

        def __del__(self):
            s.raw_free(self.ptr)

    class CollectingList(list):  # copying it runs the collector, as any allocation may
        def __iter__(self):
            gc.collect()
            return super().__iter__()

    def garbage(n):
        with A:
            for _ in range(n):
                Holder(s.raw_malloc(64))
        with B:
            fake.launch(B)  # B in use and busy while the blocks die: each free is a finding

    with B:
        keep = s.raw_malloc(8)
    monkeypatch.setattr(C, "_findings", CollectingList())
    faulthandler.dump_traceback_later(30, exit=True)  # a deadlock ends the run loudly
    gc.disable()  # only the collections this test runs free the blocks
    try:
        garbage(10)
        with B:
            s.raw_malloc(8)  # B seen after the blocks
        checks.findings()  # copies the findings under the lock; the collection frees the blocks
        garbage(10)
        with B:
            s.raw_malloc(8)
        assert len(checks.findings()) == 20
    finally:
        gc.enable()
        faulthandler.cancel_dump_traceback_later()
    gc.collect()
    checks.collect()
    assert len([f for f in checks.findings() if f.kind == "cross-stream reuse"]) == 20


def test_a_deferred_stream_check_is_decided_before_collect_synchronises(fake):
    """Both streams busy at the free: decided by events, which a
    synchronisation would finish together. A quarantined block whose stream
    is gone makes collect() synchronise; the stream check is decided first."""
    s = make(fake, "all")
    C = fake.stream()
    with C:
        s.raw_free(s.raw_malloc(64))  # quarantined; its stream dies next
    del C
    A, B = _streams(fake, non_blocking=True)
    with A:
        p = s.raw_malloc(1 << 20)
    with B:
        fake.launch(B)
        s.raw_malloc(16)
    with A:
        fake.launch(A)
        s.raw_free(p)
    fake.finish(A)  # A's queue passes the free point while B still works
    assert [f.kind for f in checks.collect()] == ["cross-stream reuse"]


def test_trim_counts_the_quarantine_it_gives_back(fake):
    s = make(fake, "poison")
    s.raw_free(s.raw_malloc(10_000))
    assert s.stats().bytes_reserved == 10_240
    assert s.trim() == 10_240 and s.stats().bytes_reserved == 0


# -- corner cases: checks that must lose no finding and no block ---------------------------------------------


def test_clear_reports_legacy_sites_again(fake):
    s = make(fake, "streams")
    F = fake.stream(non_blocking=True)

    def helper():
        with fake.null_stream():
            s.raw_malloc(64)

    for _ in range(2):
        checks.clear()
        with checks.expect_stream(F):
            helper()
        assert [f.kind for f in checks.findings()] == ["legacy stream"]


def test_expect_stream_applies_to_its_own_device_only(fake2):
    s = make(fake2, "streams")
    F = fake2.stream(0, non_blocking=True)
    with checks.expect_stream(F), F:
        s.raw_malloc(100)
        fake2.set_device(1)
        s.raw_malloc(100)  # device 1's current stream is its legacy stream: another device, not a finding
        fake2.set_device(0)
    assert checks.findings() == []


def test_marks_survive_clear(fake):
    s = make(fake, "redzone")
    m = checks.mark()
    checks.clear()
    p = s.raw_malloc(10)
    fake.write(p + 10, b"\x00")
    s.raw_free(p)
    checks.collect()
    assert [f.ptr for f in checks.findings(since=m)] == [p]
    with pytest.raises(TypeError, match="since: expected an int from checks.mark"):
        checks.findings(since="x")


def test_warnings_as_errors_lose_no_block_and_no_finding(fake):
    s = make(fake, "all", on_finding="warn")
    A, B = _streams(fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with A:
            x = s.raw_malloc(4096)
        with B:
            s.raw_malloc(64)
            fake.launch(B)
        with A:
            s.raw_free(x)  # a cross-stream finding: the warning cannot leave a free...
        with pytest.raises(CheckError) as exc:  # ...so it is raised at the next allocation
            s.raw_malloc(10)
        assert [f.kind for f in exc.value.findings] == ["cross-stream reuse"]
        p, q = s.raw_malloc(10), s.raw_malloc(10)
        for ptr in (p, q):
            fake.write(ptr + 10, b"\x00")
            s.raw_free(ptr)
        with pytest.raises(CheckError) as exc:  # both kernels' findings, none lost
            s.raw_malloc(10)
    assert [f.kind for f in exc.value.findings] == ["out-of-bounds write"] * 2
    assert s.stats().n_live == 1
    s.trim()  # the quarantine's blocks go back to the inner strategy
    assert len(s.inner.live_sizes()) == 1  # B's block: nothing lost


def test_a_failed_canary_memset_gives_the_block_back(fake):
    s = make(fake, "redzone")
    S = fake.stream()
    S.destroy()
    with S, pytest.raises(Exception, match="cudaErrorInvalidResourceHandle"):
        s.raw_malloc(1000)
    assert s.inner.live_sizes() == {} and fake.used_bytes(0) == 0


def test_using_leaves_a_strategy_passed_in_open(fake):
    inner = cupy_memstrat.create("device", backend=fake)
    s = checks.checked(inner, check="poison", on_finding="record")
    keep = inner.raw_malloc(1000)
    s.close()
    assert inner in REACHABLE and inner.live_sizes() == {keep: 1000}  # not closed
    owned = make(fake, "poison")
    owned.inner.raw_free(owned.inner.raw_malloc(1000))  # reachable once it has allocated
    assert owned.inner in REACHABLE
    owned.close()
    assert owned.inner not in REACHABLE  # made for the layer: closed with it


def test_frees_after_close_are_not_quarantined(fake):
    s = make(fake, "poison")
    p = s.raw_malloc(1000)
    s.close()
    s.raw_free(p)
    assert not fake.is_allocated(p) and checks.collect() == []


def test_out_of_memory_names_the_requested_size_and_counts_once(fake):
    s = make(FakeBackend(memory="1MiB"), "all")
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as exc:
        s.raw_malloc(2 << 20)
    e = exc.value
    assert e.requested == 2 << 20 and "allocating 2.0 MiB (2,097,152 bytes)" in str(e)
    assert "with the checks' padding" in str(e) and s.stats().n_failed == 1
    p = s.raw_malloc(700 << 10)
    s.raw_free(p)
    s.raw_malloc(700 << 10)  # succeeds after the quarantine is given back: no failure counted
    assert s.stats().n_failed == 1


def test_both_busy_is_decided_when_another_device_is_current(fake2):
    s = make(fake2, "streams")
    A, B = fake2.stream(0, non_blocking=True), fake2.stream(0, non_blocking=True)
    with A:
        x = s.raw_malloc(4096)
    with B:
        s.raw_malloc(64)
        fake2.launch(B)
    fake2.launch(A)
    fake2.set_device(1)
    with A:
        s.raw_free(x)  # CuPy's finalisers run under whatever device is current
    fake2.set_device(0)
    fake2.finish(A)
    with A:
        s.raw_malloc(8)
    assert [f.kind for f in checks.findings()] == ["cross-stream reuse"]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda f: checks.collect(device="x"), TypeError, "device: expected an int device ordinal"),
        (lambda f: checks.collect(device=70), ValueError, r"device: expected 0 <= device < \d+, got 70"),
        (lambda f: checks.fresh_stream("fake").__enter__(), TypeError, "backend: expected a CUDA backend"),
        (lambda f: checks.expect_stream(0).__enter__(), ValueError, "a stream other than the default streams"),
        (lambda f: checks.checked(cupy_memstrat.create("device", backend=f), backend=f), TypeError,
         "the checks use the wrapped strategy's backend"),
        (lambda f: cupy_memstrat.create(make(f, "poison"), quarantine_count=1), ValueError, "already checked"),
        (lambda f: parse_checks({"streams": 1}), TypeError, "check: expected a str"),
        (lambda f: make(f, "all", on_finding="loud"), ValueError, "^on_finding: expected 'raise', 'warn' or 'record'"),
    ],
)
def test_bad_arguments_name_what_was_expected(fake, call, error, match):
    make(fake, "streams")  # a live layer, for collect()
    with pytest.raises(error, match=match):
        call(fake)


def test_expect_stream_takes_any_integer_handle(fake):
    import numpy as np

    with checks.expect_stream(np.int64(0x5000)):
        assert checks._expected
    assert not checks._expected


def test_trim_checks_its_argument_before_giving_anything_back(fake):
    s = make(fake, "poison")
    p = s.raw_malloc(1000)
    s.raw_free(p)
    with pytest.raises(ValueError, match="keep_bytes"):
        s.trim("lots")
    assert fake.is_allocated(p)  # still quarantined


def test_the_fake_contents_survive_threads(fake):
    import threading

    s = make(fake, "all")

    def work():
        for i in range(300):
            s.raw_free(s.raw_malloc(64 + i % 5))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert checks.collect() == [] and checks.findings() == []
    s.trim()
    assert s.stats().n_live == 0 and fake.used_bytes(0) == 0


def test_config_reports_the_wrapped_strategys_options_and_the_checks_as_a_spec(hot_path):
    """Issue 16: config said track_origins False for device:track_origins=yes,check=all, and the
    pytest JSON stored check as the string 'frozenset({...})'."""
    import json

    s = cupy_memstrat.create("device:track_origins=yes,check=all", backend=FakeBackend(memory="1GiB"))
    assert s.config["track_origins"] is True and s.config["check"] == "streams,poison,redzone"
    assert s.config["granule"] == 1 and s.config["on_finding"] == "raise"
    json.dumps(s.config)  # JSON-ready


def test_the_checked_class_is_the_one_made_after_the_layer_module_is_imported_again(monkeypatch):
    """pytester's runpytest_inprocess drops the modules an inner run imported: a CheckedStrategy
    class kept by the package from an earlier run was not the class use(..., check=...) made next,
    and the pytest plugin, whose isinstance then failed, judged no finding (seen when
    tests/test_plugin_gpumem.py ran in one process)."""
    import sys

    from cupy_memstrat.testing import FakeBackend

    assert checks.CheckedStrategy is sys.modules["cupy_memstrat.checks.layer"].CheckedStrategy
    monkeypatch.delitem(sys.modules, "cupy_memstrat.checks.layer")  # as pytester's snapshot restore does
    s = cupy_memstrat.create("device", backend=FakeBackend(), check="all")
    assert isinstance(s, checks.CheckedStrategy)


def test_record_stream_on_the_layer_refuses_a_pointer_that_is_not_an_int(fake):
    s = make(fake, "streams")
    for bad in (None, "0x10", 1.0):
        with pytest.raises(TypeError, match=r"ptr: expected an int pointer, got"):
            s.record_stream(bad, fake.stream())
