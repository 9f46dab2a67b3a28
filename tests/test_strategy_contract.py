"""The strategy contract, checked for every strategy ``cupy_memstrat.available()`` lists:
the built-ins, and a third-party strategy once it is registered (docs/strategies.md,
"Writing your own strategy"). On the simulated GPU, each test once per hot path
(the ``fake`` fixture, tests/conftest.py)."""

import dataclasses
import pickle
import threading
import warnings

import numpy as np
import pytest

import cupy_memstrat
from cupy_memstrat.strategies import _support
from cupy_memstrat.testing import FakeBackend
from helpers import run_threads

STRATEGIES = sorted(cupy_memstrat.available())


@pytest.fixture(params=STRATEGIES)
def s(request, fake):
    return cupy_memstrat.create(request.param, backend=fake)


def test_every_built_in_strategy_is_checked():
    assert {"device", "pool", "managed", "async"} <= set(STRATEGIES)


def test_allocations_are_counted_listed_and_given_back(s):
    ptrs = [s.raw_malloc(n) for n in (1, 1000, 1 << 20)]
    st = s.stats()
    assert (st.n_allocs, st.n_frees, st.n_live) == (3, 0, 3) and len(set(ptrs)) == 3
    live = s.live_allocations()
    assert sorted(a.ptr for a in live) == sorted(ptrs)
    assert sum(a.size for a in live) == st.bytes_in_use >= 1 + 1000 + (1 << 20)
    assert st.peak_bytes_in_use == st.bytes_in_use and st.bytes_reserved >= st.bytes_in_use
    for p in ptrs:
        s.raw_free(p)
    st = s.stats()
    assert (st.n_frees, st.n_live, st.bytes_in_use, s.live_allocations()) == (3, 0, 0, [])
    assert st.peak_bytes_in_use >= 1 + 1000 + (1 << 20)


def test_eight_threads_keep_exact_counts_and_distinct_pointers(s):
    """CPython's atomic dict and list operations, no lock: the counts stay exact and no
    block is handed out twice (this replaced three per-strategy copies)."""
    n_threads, n_iter = 8, 600
    start = threading.Barrier(n_threads)
    errors, kept = [], []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            held = []
            start.wait()
            for i in range(n_iter):
                held.append(s.raw_malloc(int(rng.integers(1, 1 << 16))))
                if i % 3 == 2:
                    s.raw_free(held.pop(0))
            kept.append(held)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_threads(work, n_threads)
    assert not errors
    live = [p for held in kept for p in held]
    assert len(live) == len(set(live)) == n_threads * n_iter * 2 // 3  # no block handed out twice
    st = s.stats()
    assert (st.n_allocs, st.n_frees, st.n_live) == (n_threads * n_iter, n_threads * n_iter // 3, len(live))
    for p in live:
        s.raw_free(p)
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0 and st.n_invalid_frees == 0 and st.peak_bytes_in_use > 0


# -- a cache must be drop-in (docs/strategies.md, "Writing your own strategy") ------------------------
# Each check is a function, run on every strategy and, as the control, on a cache that breaks it.

MiB = 1 << 20


def check_a_busy_streams_block_reaches_no_other_stream(s, fake):
    """A block freed on stream A while A's work still uses it goes to no allocation on stream B
    until that work is done (docs/streams.md)."""
    A, B = fake.stream(non_blocking=True), fake.stream(non_blocking=True)
    with A:
        p = s.raw_malloc(MiB)
    fake.launch(A)  # a kernel on A still reads p
    with A:
        s.raw_free(p)
    with B:
        q = s.raw_malloc(MiB)
    assert q != p or not fake.stream_busy(A.ptr), "a block went to stream B while stream A still used it"
    fake.finish()
    with B:
        s.raw_free(q)


def check_the_cache_goes_back_before_out_of_memory(s, fake):
    """Memory the strategy caches is given back before it raises OutOfMemoryError, as CuPy's pool
    does: a request that fits once the cache is empty succeeds."""
    for p in [s.raw_malloc(256 * MiB) for _ in range(3)]:
        s.raw_free(p)
    big = s.raw_malloc(900 * MiB)  # of the simulated 1 GiB
    s.raw_free(big)


def check_trim_gives_the_cache_back(s, fake):
    for p in [s.raw_malloc(n) for n in (4096, MiB, 64 * MiB)]:
        s.raw_free(p)
    s.trim()
    st = s.stats()
    assert st.bytes_in_use == 0 and st.bytes_reserved == 0, st


CACHE_CHECKS = [check_a_busy_streams_block_reaches_no_other_stream, check_the_cache_goes_back_before_out_of_memory,
                check_trim_gives_the_cache_back]


@pytest.mark.parametrize("check", CACHE_CHECKS, ids=lambda f: f.__name__[6:])
def test_a_cache_is_drop_in(s, fake, check):
    check(s, fake)


class _NaiveCache(cupy_memstrat.Strategy):
    """The control: one free list per size for every stream, and no trim."""

    name = "naive-cache"
    reserved_is_in_use = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self.cached, self.sizes = {}, {}

    def allocate(self, size):
        lst = self.cached.get(size)
        ptr = lst.pop() if lst else None
        if ptr is None:
            ptr = self.backend.malloc(size)
            self.record_reserved(self.backend.get_device(), size)
        self.sizes[ptr] = size
        return ptr

    def deallocate(self, ptr):
        self.cached.setdefault(self.sizes.pop(ptr), []).append(ptr)


@pytest.mark.parametrize("check, error", [(CACHE_CHECKS[0], AssertionError),
                                          (CACHE_CHECKS[1], cupy_memstrat.OutOfMemoryError),
                                          (CACHE_CHECKS[2], AssertionError)], ids=lambda v: getattr(v, "__name__", ""))
def test_the_cache_checks_fail_on_a_cache_that_is_not_drop_in(fake, check, error):
    with pytest.raises(error):
        check(_NaiveCache(backend=fake), fake)


def test_a_subclass_may_keep_its_free_lists_in_self_free(fake):
    """The names a cache reaches for first are not the base class's (its hot path was
    self._malloc / self._free, and a subclass's self._free = {} broke its first allocation)."""

    class Mine(_NaiveCache):
        name = "mine"

        def __init__(self, **kw):
            super().__init__(**kw)
            self._free, self._malloc = {}, {}

    s = Mine(backend=fake)
    s.raw_free(s.raw_malloc(4096))
    assert s.raw_malloc(4096) and s._free == {} and s.stats().n_allocs == 2


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("10", TypeError), (1 << 64, ValueError), (2.0, TypeError),
                                        (True, TypeError), (None, TypeError)])
def test_a_bad_size_is_refused_by_name_before_anything_is_allocated(s, bad, error):
    keep = s.raw_malloc(4096)
    before = s.stats()
    with pytest.raises(error, match="size"):
        s.raw_malloc(bad)
    assert s.stats() == before and [a.ptr for a in s.live_allocations()] == [keep]
    s.raw_free(keep)


def test_out_of_memory_is_our_error_counted_and_loses_nothing(s):
    keep = s.raw_malloc(4096)
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match=r"out of memory allocating 1\.0 TiB"):
        s.raw_malloc(1 << 40)  # more than the simulated 1 GiB
    st = s.stats()
    assert (st.n_failed, st.n_live) == (1, 1) and [a.ptr for a in s.live_allocations()] == [keep]
    s.raw_free(s.raw_malloc(1 << 20))  # the strategy goes on allocating
    s.raw_free(keep)
    assert s.stats().bytes_in_use == 0


def test_out_of_memory_pickles_to_the_same_error(s):
    """A worker process's error reaches the client pickled (Dask): the same class and attributes."""
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        s.raw_malloc(1 << 40)
    e = info.value
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e)
    assert (again.requested, again.device, again.strategy, again.reason, again.snapshot, again.stats) == (
        e.requested, e.device, e.strategy, e.reason, e.snapshot, e.stats)


class _TaskOOM(cupy_memstrat.OutOfMemoryError):
    """A user's subclass, with an attribute of its own."""


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_a_subclass_of_out_of_memory_keeps_its_class_attributes_and_notes(how):
    import copy

    e = _TaskOOM("boom", requested=1, device=0, stats=None, strategy="device")
    e.task = "t1"
    e.add_note("while running t1")
    again = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "copy": copy.copy, "deepcopy": copy.deepcopy}[how](e)
    assert type(again) is _TaskOOM and str(again) == "boom" and again.task == "t1"
    assert again.__notes__ == ["while running t1"] and (again.requested, again.strategy) == (1, "device")


def test_stats_as_dict_is_every_field(s):
    st = s.stats()
    assert st.as_dict() == {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}


@pytest.mark.skipif(_support.c_hotpath is None, reason=_support.C_MISSING or "built")
@pytest.mark.parametrize("name", STRATEGIES)
def test_strategies_get_the_c_hot_path_by_default(monkeypatch, name):
    monkeypatch.delenv(_support.HOT_PATH_ENV, raising=False)
    assert cupy_memstrat.hot_path_status() == {"setting": "auto", "hot_path": "c",
                                               "reason": "compiled from csrc/hotpath.c"}
    s = cupy_memstrat.create(name, backend=FakeBackend())
    assert s.hot_path is None  # built on first use
    s.raw_free(s.raw_malloc(1000))
    assert s.hot_path == "c" and s.stats().n_allocs == 1


# -- the hooks a subclass provides ---------------------------------------------------------------


class Counting(cupy_memstrat.Strategy):
    """A third-party strategy as docs/strategies.md writes one: the two public hooks."""

    name = "counting-test"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def allocate(self, size):
        self.calls += 1
        return self.backend.malloc(size)

    def deallocate(self, ptr):
        self.backend.free(ptr)


def test_a_subclass_with_the_public_hooks_is_counted_on_both_hot_paths(fake):
    s = Counting(backend=fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the hooks cost no warning
        ptrs = [s.raw_malloc(100 * (i + 1)) for i in range(5)]
        for p in ptrs:
            s.raw_free(p)
    st = s.stats()
    assert s.calls == 5 and (st.n_allocs, st.n_frees, st.bytes_in_use, st.peak_bytes_in_use) == (5, 5, 0, 1500)
    assert fake.used_bytes(0) == 0


@pytest.mark.parametrize("base", ["strategy", "device", "pool"])
@pytest.mark.parametrize("wrong, hook", [("_allocate", "allocate"), ("_deallocate", "deallocate")])
def test_a_hook_under_an_underscore_name_is_refused_at_the_class_statement(fake, base, wrong, hook):
    parent = cupy_memstrat.Strategy if base == "strategy" else type(cupy_memstrat.create(base, backend=fake))
    with pytest.raises(TypeError) as info:
        type("Mistaken", (parent,), {"name": f"mistaken-{base}-test", wrong: lambda self, x: None})
    assert str(info.value) == (f"Mistaken.{wrong} is not a hook: name it {hook} "
                               "(docs/strategies.md, 'Writing your own strategy')")


def test_a_helper_named_like_a_hook_is_allowed_beside_the_hook_and_is_not_called_by_the_hot_path(fake):
    calls = []

    class Helped(cupy_memstrat.Strategy):
        name = "helped-test"
        reserved_is_in_use = False

        def allocate(self, size):
            calls.append("allocate")
            return self._allocate(size)

        def _allocate(self, size):
            calls.append("_allocate")
            return self.backend.malloc(size)

        def deallocate(self, ptr):
            self.backend.free(ptr)

    class Sub(Helped):  # its helper of that name overrides the helper, not the hook
        name = "helped-sub-test"

        def _allocate(self, size):
            calls.append("sub _allocate")
            return self.backend.malloc(size)

    for cls in (Helped, Sub):
        s = cls(backend=fake)
        s.raw_free(s.raw_malloc(100))
        assert s.stats().n_frees == 1
    assert calls == ["allocate", "_allocate", "allocate", "sub _allocate"]


def test_the_contract_has_no_underscore_names_of_its_hooks_or_of_record_reserved():
    for old in ("_allocate", "_deallocate", "_record_reserved"):
        assert not hasattr(cupy_memstrat.Strategy, old)


def test_the_most_derived_hook_wins(fake):
    calls = []

    class Base(cupy_memstrat.Strategy):
        name = "base-hooks-test"

        def allocate(self, size):
            calls.append("base")
            return self.backend.malloc(size)

        def deallocate(self, ptr):
            self.backend.free(ptr)

    class New(Base):
        name = "new-over-base-test"

        def allocate(self, size):
            calls.append("new")
            return self.backend.malloc(size)

    s = New(backend=fake)
    s.raw_free(s.raw_malloc(100))
    assert calls == ["new"] and s.stats().n_frees == 1


@pytest.mark.parametrize("base", ["device", "pool", "torch", "rmm"])
def test_a_subclass_of_a_built_in_can_override_a_hook_and_call_the_built_in_one(fake, base):
    calls = []
    cls = type(cupy_memstrat.create(base, backend=fake))

    class Logged(cls):
        name = f"logged-{base}-test"

        def allocate(self, size):
            calls.append(size)
            return super().allocate(size)

    s = Logged(backend=fake)
    s.raw_free(s.raw_malloc(123))
    st = s.stats()
    assert calls == [123] and (st.n_allocs, st.n_frees, st.bytes_in_use) == (1, 1, 0)


@pytest.mark.parametrize("base", ["managed", "async"])
def test_hooks_on_a_strategy_with_its_own_hot_path_are_refused_at_the_class_statement(fake, base):
    cls = type(cupy_memstrat.create(base, backend=fake))
    with pytest.raises(TypeError, match=r"Mine: allocate would never be called: .* builds a hot path of its own"):
        class Mine(cls):
            def allocate(self, size):
                return 0
    with pytest.raises(NotImplementedError, match=r"has no allocate hook: allocate with raw_malloc\(size\)"):
        cupy_memstrat.create(base, backend=fake).allocate(64)


@pytest.mark.parametrize("device, delta, error, match", [
    (0, 1.5, TypeError, "delta: expected an int, got float 1.5"), (0, True, TypeError, "delta: expected an int"),
    (0, "10", TypeError, "delta: expected an int, got str"), (0, None, TypeError, "delta"),
    (5, 10, ValueError, r"device: expected 0 <= device < 1, got 5"), (-1, 10, ValueError, "got -1"),
    (True, 10, TypeError, "device: expected an int")])
def test_record_reserved_refuses_bad_values_by_name_and_counts_nothing(fake, device, delta, error, match):
    s = cupy_memstrat.create("device", backend=fake)
    before = s.stats()
    with pytest.raises(error, match=match):
        s.record_reserved(device, delta)
    assert s.stats() == before


def test_a_subclass_without_hooks_says_which_one_is_missing(fake):
    class Empty(cupy_memstrat.Strategy):
        name = "empty-test"

    with pytest.raises(NotImplementedError, match=r"Empty defines no allocate\(size\) -> ptr"):
        Empty(backend=fake).raw_malloc(100)
