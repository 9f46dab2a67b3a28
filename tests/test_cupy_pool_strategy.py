"""The 'pool' strategy (CuPy's default pool, measured) on the fake backend."""


import pytest

import cupy_memstrat
from cupy_memstrat import CuPyPoolStrategy
from cupy_memstrat.strategies import _support
from cupy_memstrat.strategies.pool_direct import DirectRoute
from cupy_memstrat.testing import FakeBackend
from helpers import stream_on_handle

MiB = 1 << 20


def test_registered_with_alias_and_description():
    assert "pool" in cupy_memstrat.available()
    assert "CuPy's default MemoryPool" in cupy_memstrat.available()["pool"]
    assert cupy_memstrat.validate("cupy") == ("pool", {"track_origins": False, "oom_snapshot": None, "route": "direct"})


def test_same_stats_as_every_strategy(fake):
    s = cupy_memstrat.create("pool", backend=fake)
    assert isinstance(s, CuPyPoolStrategy)
    a = s.raw_malloc(3 * MiB)
    b = s.raw_malloc(1 * MiB)
    st = s.stats()
    assert (st.bytes_in_use, st.peak_bytes_in_use, st.n_allocs, st.n_live) == (4 * MiB, 4 * MiB, 2, 2)
    assert st.bytes_reserved == st.bytes_in_use  # no CuPy pool here: nothing cached
    s.raw_free(a)
    st = s.stats()
    assert (st.bytes_in_use, st.peak_bytes_in_use, st.n_frees) == (1 * MiB, 4 * MiB, 1)
    assert not fake.is_allocated(a) and fake.is_allocated(b)
    s.reset_peak()
    assert s.stats().peak_bytes_in_use == 1 * MiB
    assert [x.size for x in s.live_allocations()] == [1 * MiB]
    s.raw_free(b)
    assert s.trim() == 0 and s.stats().n_live == 0


def test_live_sizes_is_a_snapshot_in_allocation_order(fake2):
    s = cupy_memstrat.create("pool", backend=fake2)
    a = s.raw_malloc(100)
    fake2.set_device(1)
    b = s.raw_malloc(200)
    c = s.raw_malloc(300)
    fake2.set_device(0)
    snap = s.live_sizes()
    assert snap == {a: 100, b: 200, c: 300}
    assert s.live_sizes(1) == {b: 200, c: 300} and s.live_sizes(0) == {a: 100}
    s.raw_free(b)
    assert b in snap  # a copy
    d = s.raw_free(a) or s.raw_malloc(50)
    assert s.live_sizes().items() - snap.items() == {(d, 50)}
    with pytest.raises(ValueError):
        s.live_sizes(2)


def test_track_origins_and_oom(fake):
    s = cupy_memstrat.create("cupy:track_origins=true", backend=fake)
    p = s.raw_malloc(MiB)
    (a,) = s.live_allocations()
    assert a.origin is not None and a.origin.function == "test_track_origins_and_oom"
    with pytest.raises(cupy_memstrat.OutOfMemoryError, match="pool strategy: out of memory"):
        s.raw_malloc(2 << 30)
    assert s.stats().n_failed == 1
    s.raw_free(p)


def test_trim_checks_its_arguments(fake):
    s = cupy_memstrat.create("pool", backend=fake)
    assert s.trim("10%") == 0 and s.trim(0, device=0) == 0
    with pytest.raises(ValueError):
        s.trim("lots")
    with pytest.raises(ValueError):
        s.trim(device=3)


def test_as_cupy_allocator(fake, restore_cupy_allocator):
    cupy = restore_cupy_allocator
    s = cupy_memstrat.use(cupy_memstrat.create("pool", backend=fake))
    mp = cupy.cuda.alloc(3000)
    assert mp.mem.size == 3072  # rounded up to 512 B, as CuPy's own pool reports it
    assert s.stats().bytes_in_use == 3072
    del mp
    assert s.stats().bytes_in_use == 0


# -- route="direct": the C side, against stand-ins for CuPy's pool ------------------------------
# CuPy's pool needs CUDA: these give PoolDirect objects shaped as CuPy 14.2's (a MemoryPointer
# with .mem, whose PooledMemory has ptr, size, device_id and a __dict__, gives its block back to
# the pool in its destructor before its __dict__ is cleared). tests/gpu/test_cupy_pool_gpu.py runs
# the route over CuPy's pool itself.

needs_c = pytest.mark.skipif(_support.c_hotpath is None, reason=_support.C_MISSING or "built")


class _PoolOOM(Exception):
    pass


class _StandInPool:
    """A stand-in for CuPy's MemoryPool (which needs CUDA), with its interface: blocks of
    512-byte multiples, each handed back to ``free`` when its memory object dies."""

    def __init__(self, oom=None):
        self.free, self.next, self.on_free, self.oom = [], 0x100000, None, oom

    def malloc(self, size):
        if size >= 1 << 40:
            raise _PoolOOM("pool out of memory") if self.oom is None else self.oom(size, 0)
        ptr = self.free.pop() if self.free else self.next
        self.next += 1 << 20
        return _MP(_Mem(self, ptr, (size + 511) & -512))

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


class _Mem:
    def __init__(self, pool, ptr, size):
        self.pool, self.ptr, self.size, self.device_id = pool, ptr, size, 0

    def __del__(self):  # the block is the pool's again before the __dict__ (and the token) goes
        self.pool.free.append(self.ptr)
        if self.pool.on_free is not None:
            self.pool.on_free()


class _SlotMem:
    __slots__ = ("ptr", "size", "device_id")

    def __init__(self, ptr, size):
        self.ptr, self.size, self.device_id = ptr, size, 0


class _MP:
    def __init__(self, mem):
        self.mem, self.ptr, self.device_id = mem, mem.ptr, mem.device_id


def _direct(pool_malloc=None, failed=None, recorded_freed=None):
    s = cupy_memstrat.create("pool", backend=FakeBackend())
    s.raw_free(s.raw_malloc(512))  # builds the hot path (hooks mode)
    acc = s.hot_path_functions()[0].__self__  # the C hot path's tables
    pool = _StandInPool()
    calls = []

    def default_failed(size, exc):
        calls.append(("failed", size, exc))
        raise MemoryError(f"strategy out of memory for {size}")

    d = _support.c_hotpath.PoolDirect(
        acc, pool_malloc or pool.malloc, _PoolOOM, failed or default_failed,
        recorded_freed or (lambda *a: calls.append(("recorded", *a))), {},
    )
    return s, d, pool, calls


@needs_c
def test_route_direct_hands_out_the_pools_object_and_counts_its_free():
    s, d, pool, _ = _direct()
    mp = d(1000)
    assert isinstance(mp, _MP) and mp.mem.size == 1024
    st = s.stats()
    assert st.bytes_in_use == 1024 and st.n_live == 1 and st.n_allocs == 2
    assert s.live_sizes() == {mp.ptr: 1024}
    ptr = mp.ptr
    del mp
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_frees == 2 and pool.free == [ptr]
    assert d.generations == {}


@needs_c
def test_route_direct_counts_a_block_the_pool_gave_out_again_before_its_free_was_seen_once():
    s, d, pool, _ = _direct()
    a = d(4096)
    ptr = a.ptr
    got = []
    pool.on_free = lambda: got.append(d(4096))  # between the pool's free and the token: the same block
    del a
    pool.on_free = None
    (b,) = got
    assert b.ptr == ptr
    st = s.stats()
    assert st.bytes_in_use == 4096 and st.n_live == 1 and d.generations == {ptr: 2}  # b counted, not a
    assert st.n_allocs == 3 and st.n_frees == 2
    got.clear()
    del b
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0 and st.n_frees == 3 and st.peak_bytes_in_use == 4096


@needs_c
def test_route_direct_counts_thousands_of_blocks_freed_in_random_order():
    """The route's table of the block counted at each pointer (a C hash table
    that grows and closes the gaps its deletions leave) stays exact through
    growth and random frees."""
    import random

    s, d, pool, _ = _direct()
    rng = random.Random(15)
    live, expected, gen = {}, {}, 0
    for step in range(20_000):
        if live and (rng.random() < 0.45 or len(live) > 3000):
            ptr = rng.choice(list(live)) if step % 7 else next(iter(live))
            del live[ptr], expected[ptr]
        else:
            mp = d(rng.choice((512, 4096, 1 << 20)))
            gen += 1
            assert mp.ptr not in live
            live[mp.ptr], expected[mp.ptr] = mp, gen
        if step % 997 == 0:
            assert d.generations == expected
    assert d.generations == expected
    st = s.stats()
    assert st.n_live == len(live) and st.bytes_in_use == sum(m.mem.size for m in live.values())
    mp = None
    live.clear()
    assert d.generations == {} and s.stats().bytes_in_use == 0


@needs_c
def test_route_direct_out_of_memory_goes_to_the_strategys_recovery_and_other_errors_pass():
    s, d, pool, calls = _direct()
    with pytest.raises(MemoryError, match="strategy out of memory for 1099511627776"):
        d(1 << 40)
    assert calls[0][:2] == ("failed", 1 << 40) and isinstance(calls[0][2], _PoolOOM)
    assert s.stats().bytes_in_use == 0

    def broken(size):
        raise ZeroDivisionError("not an OOM")

    s2, d2, _, calls2 = _direct(pool_malloc=broken)
    with pytest.raises(ZeroDivisionError):
        d2(100)
    assert calls2 == []
    recovered = _MP(_Mem(pool, 0x777000, 512))
    s3, d3, _, _ = _direct(pool_malloc=lambda size: (_ for _ in ()).throw(_PoolOOM("x")),
                           failed=lambda size, exc: recovered)
    mp = d3(512)
    assert mp is recovered and s3.stats().bytes_in_use == 512


@needs_c
def test_route_direct_refuses_a_memory_object_it_cannot_watch_and_counts_nothing():
    s, d, _, _ = _direct(pool_malloc=lambda size: _MP(_SlotMem(0x5000, 512)))
    with pytest.raises(AttributeError):
        d(512)
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0


@needs_c
def test_route_direct_accounts_nothing_for_cupys_empty_memory_and_passes_recorded_frees_on():
    s, d, pool, calls = _direct(pool_malloc=lambda size: _MP(_SlotMem(0, 0)))
    mp = d(0)
    assert mp.ptr == 0 and s.stats().n_live == 0
    s, d, pool, calls = _direct()
    mp = d(2048)
    ptr = mp.ptr
    s.deferred.recorded[ptr] = [("stream", 7, 0, None)]  # as record_stream leaves it
    del mp
    assert calls == [("recorded", ptr, 2048, 0, False)] and s.stats().bytes_in_use == 0


@needs_c
def test_route_direct_is_refused_over_anything_but_a_hooks_mode_accounting():
    m = cupy_memstrat.create("managed", backend=FakeBackend())
    m.raw_free(m.raw_malloc(512))
    with pytest.raises(TypeError, match="hooks mode"):
        _support.c_hotpath.PoolDirect(m.hot_path_functions()[0].__self__, print, _PoolOOM, print, print, {})
    s, d, pool, _ = _direct()
    with pytest.raises(TypeError, match="expected"):
        _support.c_hotpath.PoolDirect(d.__self__, print, 3, print, print, {})
    with pytest.raises(TypeError, match="one argument"):
        d(1, 2)
    with pytest.raises(TypeError, match=r"free_early\(ptr\): expected an int pointer, got '0x10'"):
        d.free_early("0x10")
    assert d.free_early(0x10) is False and d.reap() == []  # nothing counted there, nothing held
    with pytest.raises(TypeError, match="not initialised"):
        _support.c_hotpath.PoolDirect.__new__(_support.c_hotpath.PoolDirect).reap()
    with pytest.raises(TypeError, match="argument 6 must be dict, not list"):  # the held table
        _support.c_hotpath.PoolDirect(d.__self__, print, _PoolOOM, print, print, [])


def test_route_is_an_option_checked_by_name():
    pytest.importorskip("cupy", reason="CuPy is not installed")  # malloc returns a CuPy MemoryPointer
    s = cupy_memstrat.create("pool", route="direct", backend=FakeBackend())
    assert s.config["route"] == "direct"
    mp = s.malloc(100)  # without CUDA, the default route runs
    assert s.stats().bytes_in_use == 512
    del mp
    with pytest.raises(ValueError, match=r"pool: option route: expected one of 'wrap', 'direct', got 'fast'"):
        cupy_memstrat.create("pool", route="fast", backend=FakeBackend())


@needs_c
def test_route_direct_keeps_each_block_apart_when_the_pool_reuses_a_pointer_early():
    """The pool takes a block back while its memory
    object lives (PooledMemory.free() called by hand), hands the pointer out
    again, and that newer block dies first: it is the newer one's free that
    is counted, and a recorded stream of the old block is waited for then."""
    s, d, pool, calls = _direct()
    a = d(4096)
    ptr = a.ptr
    s.deferred.recorded[ptr] = [("stream A", 7, 0, None)]
    pool.free.append(ptr)  # as PooledMemory.free() while `a` lives
    b = d(4096)
    assert b.ptr == ptr and calls == [("recorded", ptr, 4096, 0, False)]  # a's free, counted at b's malloc
    del s.deferred.recorded[ptr]  # as the strategy's recorded_freed does once it has waited
    assert s.live_sizes() == {ptr: 4096} and s.stats().bytes_in_use == 4096
    del b
    assert s.live_sizes() == {} and s.stats().bytes_in_use == 0
    del a  # its free was counted already
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_frees == st.n_allocs == 3 and len(calls) == 1


@needs_c
def test_route_direct_refuses_a_block_that_is_not_ints_and_a_second_init():
    class M:
        def __init__(self, ptr, size):
            self.ptr, self.size, self.device_id = ptr, size, 0

    for ptr, size in ((0x3000, None), ("abc", 512), (0x3000, -512)):
        s, d, _, _ = _direct(pool_malloc=lambda n, p=ptr, z=size: _MP(M(p, z)))
        with pytest.raises(TypeError, match="not ints >= 0"):
            d(512)
        assert s.stats().n_live == 0
    s, d, pool, _ = _direct()
    with pytest.raises(TypeError, match="already initialised"):
        d.__init__(d.__self__, pool.malloc, _PoolOOM, print, print, {})


def _direct_strategy(fake, guard=True):
    """A pool strategy on the fake backend over a stand-in pool, on its route "direct" (the C
    hot path), installed as CuPy's allocator as use() installs it. ``guard=False``: the route
    without its dead-stream guard (the control of the guard's tests). Returns (s, the route's
    allocator, the pool)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    pool = _StandInPool(oom=cupy.cuda.memory.OutOfMemoryError)
    s = CuPyPoolStrategy(backend=fake, memory_pool=pool, route="direct")
    if not guard:
        s.direct_route = DirectRoute(s, pool.malloc, cupy.cuda.memory.OutOfMemoryError, None)
        return s, s.direct_route.allocator, pool
    cupy_memstrat.use(s)
    assert s.route == "direct"
    return s, s.cupy_allocator(), pool


def _direct_strategy_and_stream():
    """``_direct_strategy`` over a new fake backend, and a non-blocking stream B on it: what the
    tests of the held path below start from (they record blocks on B and run kernels there).
    Returns (fake, s, d, pool, B)."""
    fake = FakeBackend()
    s, d, pool = _direct_strategy(fake)
    return fake, s, d, pool, fake.stream(non_blocking=True)


def test_a_memory_pool_without_the_pools_interface_is_refused_by_name():
    import types

    half = types.SimpleNamespace(malloc=_StandInPool().malloc)  # no total_bytes, no free_all_blocks
    for bad, lacks in ((3, "malloc, total_bytes, free_all_blocks"), (half, "total_bytes, free_all_blocks")):
        with pytest.raises(TypeError, match=f"memory_pool: expected a cupy.cuda.MemoryPool .* which lacks {lacks}$"):
            CuPyPoolStrategy(backend=FakeBackend(), memory_pool=bad)


def test_route_says_which_route_cupys_arrays_take():
    fake = FakeBackend()
    assert cupy_memstrat.create("pool", route="direct", backend=fake).route == "wrap"  # the fake backend's fallback
    assert cupy_memstrat.create("pool", route="wrap", backend=fake).route == "wrap"


@needs_c
def test_route_is_direct_once_cupy_gets_the_pools_own_objects():
    s, _d, _pool = _direct_strategy(FakeBackend())
    assert s.route == "direct"


@pytest.fixture(autouse=True)
def _cupy_allocator_back():
    """Tests here install stand-in allocators as CuPy's: put CuPy's back."""
    try:
        import cupy
    except ImportError:
        yield
        return
    prev = cupy.cuda.get_allocator()
    yield
    cupy.cuda.set_allocator(prev)


@needs_c
@pytest.mark.parametrize("through", ["record_stream", "Strategy.record_stream"])
def test_route_direct_keeps_a_recorded_block_from_the_pool_until_the_recorded_stream_is_done(through):
    """cupy#8068 under threads: the block must not reach CuPy's pool (where
    another thread on the same stream would get it) while the recorded stream
    still reads it. cupy_memstrat.record_stream holds the memory object; the
    control, Strategy.record_stream with the pointer alone, has the pool take
    the block back at once, while B still runs (its free then waits)."""
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    ptr = x.ptr
    if through == "record_stream":
        assert cupy_memstrat.record_stream(x, B) is True
        assert list(s.direct_route.held) == [ptr]
    else:
        assert s.record_stream(ptr, B) is True and s.direct_route.held == {}
    fake.launch(B)  # B still reads the block
    busy = []
    pool.on_free = lambda: busy.append(fake.stream_busy(B.ptr))
    del x
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_live == 0  # freed for the program either way
    if through == "Strategy.record_stream":
        assert busy == [True] and pool.free == [ptr]  # the control: the pool had it back while B ran
        return
    assert busy == [] and pool.free == [] and s.direct_route.held == {}
    assert len(s.deferred.pending[0]) == 5  # kept while B runs, with its memory object
    y = d(4096)
    assert y.ptr != ptr  # B still runs: the block is out of reach
    fake.finish(B)
    z = d(4096)  # B is done: the block goes back to the pool, and is handed out again
    assert busy == [False] and z.ptr == ptr and s.direct_route.held == {} and not s.deferred.pending
    del y, z
    st = s.stats()
    assert st.bytes_in_use == 0 and st.n_allocs == st.n_frees == 3


@needs_c
def test_route_direct_held_block_whose_array_lives_stays_live_and_close_lets_it_go():
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(2048)
    assert cupy_memstrat.record_stream(x, B) is True
    fake.launch(B)
    st = s.stats()
    assert st.bytes_in_use == 2048 and s.live_sizes() == {x.ptr: 2048}  # alive: not reaped
    s.close()
    assert s.direct_route.held == {}
    fake.finish(B)
    del x  # the ptr-only path now: the free is counted and waits for B
    assert s.stats().bytes_in_use == 0 and pool.free


# -- the held path: stale reaps, allocations inside the reap, letting go ----------------------------


@needs_c
def test_route_direct_a_stale_reap_never_frees_the_newer_block_at_the_same_pointer():
    """Thread A lists P, thread B's allocation gets P back (its old block's wait
    done) and records it; A's free_early(P) then must count nothing."""
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    P = x.ptr
    cupy_memstrat.record_stream(x, B)
    fake.launch(B)
    del x
    stale = d.reap()
    assert stale == [P]
    assert d.free_early(P) is True and d.reap() == []  # counted once; not listed again while it waits
    fake.finish(B)
    y = d(4096)
    assert y.ptr == P and cupy_memstrat.record_stream(y, B) is True
    assert [d.free_early(p) for p in stale] == [False]  # y lives: nothing counted
    assert s.live_sizes() == {P: 4096} and s.stats().bytes_in_use == 4096
    fake.launch(B)
    del y
    z = d(4096)
    assert z.ptr != P  # y's block waits for B
    del z


@needs_c
def test_route_direct_an_allocation_inside_the_reap_is_counted():
    """A finaliser allocating while the held blocks are reaped (here: at the
    event the deferral makes)."""
    fake, s, d, pool, B = _direct_strategy_and_stream()
    C = fake.stream(non_blocking=True)
    x, w = d(4096), d(4096)
    Q = w.ptr
    cupy_memstrat.record_stream(x, B)
    cupy_memstrat.record_stream(w, C)
    fake.launch(B)
    del x, w
    got, create = [], fake.event_create

    def event_create():
        fake.event_create = create
        got.append(d(4096))
        return create()

    fake.event_create = event_create
    s.stats()  # reaps
    (v,) = got
    assert v.ptr == Q and s.live_sizes() == {Q: 4096} and s.stats().bytes_in_use == 4096


@needs_c
def test_route_direct_holds_only_its_own_memory_object():
    """record_stream through another memory object at the block's pointer (as
    cupy.cuda.UnownedMemory) holds nothing: the block's free then waits."""
    fake, s, d, pool, B = _direct_strategy_and_stream()

    class Unowned:
        def __init__(self, ptr, size):
            self.ptr, self.size, self.device_id = ptr, size, 0

    x = d(4096)
    P = x.ptr
    other = _MP(Unowned(P, 4096))
    assert cupy_memstrat.record_stream(other, B) is True and s.direct_route.held == {}
    fake.launch(B)
    del x  # the pool has the block now; the free synchronises before it returns
    assert not fake.stream_busy(B.ptr)
    y = d(4096)
    assert y.ptr == P and s.live_sizes() == {P: 4096}
    del other
    assert s.stats().bytes_in_use == 4096
    del y


@needs_c
def test_route_direct_raw_malloc_reaps_first_so_the_peak_is_right():
    fake, s, d, pool, B = _direct_strategy_and_stream()
    s.reset_peak()
    x = d(1 << 20)
    cupy_memstrat.record_stream(x, B)
    del x
    p = s.raw_malloc(1 << 20)
    assert s.stats().peak_bytes_in_use == 1 << 20
    s.raw_free(p)


@needs_c
def test_route_direct_use_of_another_strategy_lets_go_of_held_blocks():
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    P = x.ptr
    assert cupy_memstrat.current() is s  # installed by _direct_strategy, as use(s) does on CUDA
    cupy_memstrat.record_stream(x, B)
    assert list(s.direct_route.held) == [P]
    other = cupy_memstrat.use("device", backend=fake)
    assert cupy_memstrat.current() is other and s.direct_route.held == {}
    fake.launch(B)
    del x  # no longer held: the free waits for B before it returns
    assert not fake.stream_busy(B.ptr) and P in pool.free and s.stats().bytes_in_use == 0


@needs_c
def test_route_direct_letting_go_never_hands_a_waiting_block_to_the_pool_early():
    """A held block whose array died (its free counted, its stream still
    running) when the strategy stops being CuPy's allocator: it reaches the
    pool only after that stream's work, not when the strategy lets go."""
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    P = x.ptr
    assert cupy_memstrat.current() is s  # installed by _direct_strategy, as use(s) does on CUDA
    cupy_memstrat.record_stream(x, B)
    fake.launch(B)
    del x
    assert s.stats().bytes_in_use == 0 and P not in pool.free  # counted; waits for B
    busy = []
    pool.on_free = lambda: busy.append(fake.stream_busy(B.ptr))
    cupy_memstrat.use("device", backend=fake)
    assert busy == [False] and P in pool.free and s.direct_route.held == {} and not s.deferred.pending


def test_on_the_fake_backend_blocks_that_wait_for_recorded_streams_are_reserved_and_trimmed():
    """Nothing is cached there, but a block freed while its recorded stream still works stays
    allocated: reserved, not in use (it read 0 B reserved), until trim gives it back."""
    fake = FakeBackend()
    s = cupy_memstrat.create("pool", backend=fake)
    B = fake.stream(non_blocking=True)
    p = s.raw_malloc(1 << 20)
    assert s.record_stream(p, B) is True
    fake.launch(B)
    s.raw_free(p)
    st = s.stats()
    assert (st.bytes_in_use, st.bytes_reserved, st.peak_bytes_reserved) == (0, 1 << 20, 1 << 20)
    assert len(s.deferred.pending) == 1
    assert s.trim() == 1 << 20 and not s.deferred.pending
    assert s.trim() == 0
    assert (s.stats().bytes_in_use, s.stats().bytes_reserved) == (0, 0)
    s.reset_peak()
    assert s.stats().peak_bytes_reserved == 0


@needs_c
def test_route_direct_a_pointer_only_free_left_pending_never_gives_back_what_is_at_its_pointer_later():
    """A block recorded by pointer alone is CuPy's pool's
    at its free; if another thread holds the poll, its pending entry stays,
    and giving it back later must not free whatever is at that pointer by
    then (here a raw_malloc block, live)."""
    fake = FakeBackend()
    s, d, pool = _direct_strategy(fake)
    B = fake.stream(non_blocking=True)
    x = d(4096)
    P = x.ptr
    s.record_stream(P, B)
    fake.launch(B)
    s.deferred.lock.acquire()  # another thread is polling
    del x  # the pool has P; the free synchronised; its entry stays pending
    p = s.raw_malloc(4096)
    s.deferred.lock.release()
    assert p == P and s.live_sizes() == {P: 4096}
    s.deferred.poll()
    assert P not in pool.free and s.live_sizes() == {P: 4096}  # the raw block lives on
    s.raw_free(p)
    assert P in pool.free


@needs_c
def test_route_direct_record_stream_holds_only_while_the_route_is_cupys_allocator(restore_cupy_allocator):
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    restore_cupy_allocator.cuda.set_allocator(None)  # another allocator (here CuPy's own, no pool)
    assert cupy_memstrat.record_stream(x, B) is True and s.direct_route.held == {}  # recorded, not held
    fake.launch(B)
    del x  # the free waits for B before it returns
    assert not fake.stream_busy(B.ptr) and s.stats().bytes_in_use == 0


@needs_c
def test_route_direct_letting_go_never_raises_when_the_synchronisation_fails():
    fake, s, d, pool, B = _direct_strategy_and_stream()
    x = d(4096)
    cupy_memstrat.record_stream(x, B)
    fake.launch(B)
    del x
    s.stats()  # counted; waits for B

    def broken(device):
        raise RuntimeError("device lost")

    fake.device_synchronize = broken
    with pytest.warns(RuntimeWarning, match="device lost"):
        s.direct_route.stop_holding()
    assert s.direct_route.held == {}


# -- the dead-stream guard ---------------------------------------------------------------------
# CuPy's pool finds a stream's free blocks by the stream's handle; CUDA gives a destroyed stream's
# handle to the next new stream while the old one's kernel may still run (the fake does the same):
# measured on the H200, 3 145 728 wrong elements under pool:route=wrap in one run (docs/streams.md).

def _a_stream_dies_while_its_kernel_runs(fake, alloc, free):
    """A allocates, runs a long kernel, frees and dies; B (with A's handle) allocates.
    Returns the number of destroyed streams still busy once B's allocation returned, and B
    (alive: its death would make the next allocation wait again)."""
    A = fake.stream(non_blocking=True)
    with A:
        p = alloc()
    fake.launch(A)  # a long kernel on A writing p
    with A:
        free(p)
    a = A.ptr
    del A
    B = stream_on_handle(fake, a, still_running=1)
    with B:
        q = alloc()
    busy = fake.busy_destroyed_streams()
    with B:
        free(q)
    return busy, B


def test_after_a_stream_that_allocated_dies_the_next_allocation_waits_for_its_work():
    fake = FakeBackend()
    s = cupy_memstrat.create("pool", backend=fake)
    busy, B = _a_stream_dies_while_its_kernel_runs(fake, lambda: s.raw_malloc(MiB), s.raw_free)
    assert busy == 0 and s.guard.n_syncs == [1]
    s.raw_free(s.raw_malloc(MiB))  # no stream died since: no more waiting
    assert s.guard.n_syncs == [1]
    del B  # B allocated: after its death the next allocation waits once
    s.raw_free(s.raw_malloc(MiB))
    assert s.guard.n_syncs == [2]


def _capsule_of(fn):
    """A capsule named "intptr_t (int)" over a Python function, as CuPy's get_stream_ptr is
    exported (the fake has no C function of its own)."""
    import ctypes

    proto = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)
    c_fn = proto(fn)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"intptr_t (int)")
    capsule = new(ctypes.cast(c_fn, ctypes.c_void_p), name, None)
    return capsule, (c_fn, name)  # keep the callback and the name alive with the capsule


@needs_c
@pytest.mark.parametrize("stream_fn", ["capsule", "none"])
def test_route_direct_waits_for_a_dead_streams_work_before_cupy_gets_its_block(monkeypatch, stream_fn):
    """The direct route calls the guard only when the current stream changed or a watched one
    died (with CuPy's stream function; without it, at every malloc); the control, PoolDirect
    without the guard, hands B its block while A's kernel still runs."""
    fake = FakeBackend()
    keep = None
    if stream_fn == "capsule":
        capsule, keep = _capsule_of(lambda device: fake.current_stream_ptr(device))
        monkeypatch.setattr(fake, "current_stream_ptr_capsule", lambda: capsule)
    s, d, pool = _direct_strategy(fake)
    calls = []
    before = s.guard.before_allocation
    monkeypatch.setattr(s.guard, "before_allocation", lambda st, dev: calls.append(st.ptr) or before(st, dev))
    s.direct_route = DirectRoute(s, pool.malloc, _PoolOOM, s.guard)  # with the counting guard
    d = s.direct_route.allocator
    held = []
    busy, B = _a_stream_dies_while_its_kernel_runs(fake, lambda: held.append(d(MiB)) or held[-1].ptr,
                                                   lambda p: held.clear())
    assert busy == 0 and s.guard.n_syncs == [1]
    n = len(calls)
    for _ in range(3):  # the same stream again: no call with the stream function, one each without
        d(4096)
    assert len(calls) == n + (0 if stream_fn == "capsule" else 3)
    other = fake.stream(non_blocking=True)
    with other:
        d(4096)  # another stream: watched
    assert calls[-1] == other.ptr and s.guard.n_syncs == [1]
    del B  # a watched stream died: the next malloc waits, whatever the stream
    d(4096)
    assert s.guard.n_syncs == [2]
    fake.keep_alive = keep  # the C callback stays alive while the route may still be called

    # the control: no guard
    fake2 = FakeBackend()
    s2, bare, pool2 = _direct_strategy(fake2, guard=False)
    held2 = []
    assert _a_stream_dies_while_its_kernel_runs(fake2, lambda: held2.append(bare(MiB)) or held2[-1].ptr,
                                                lambda p: held2.clear())[0] == 1


@needs_c
def test_route_direct_refuses_a_guard_without_its_flags_and_a_bad_capsule():
    s, _d, pool = _direct_strategy(FakeBackend())
    r = s.direct_route
    args = (s.hot_path_functions()[0].__self__, pool.malloc, _PoolOOM, r.pool_failed, r.recorded_freed, r.held)
    with pytest.raises(TypeError, match="expected guard\\(device\\) and the guard's lists of deaths and waits"):
        _support.c_hotpath.PoolDirect(*args, lambda device: None, None, [0])
    with pytest.raises(TypeError, match="capsule must hold a C function intptr_t \\(int\\)"):
        _support.c_hotpath.PoolDirect(*args, lambda device: None, [0], [0], object())


# The guard's corner cases: streams that die while the direct route caches their state.

def _direct_with_capsule(monkeypatch):
    """The direct route with a stream function, as CuPy's get_stream_ptr: the C check caches."""
    fake = FakeBackend()
    capsule, keep = _capsule_of(lambda device: fake.current_stream_ptr(device))
    monkeypatch.setattr(fake, "current_stream_ptr_capsule", lambda: capsule)
    s, d, pool = _direct_strategy(fake)
    fake.keep_alive = keep  # the C callback stays alive while the route may still be called
    return fake, s, d, pool


def _dies_with_its_kernel_running(fake, alloc, stream):
    """``stream`` allocates, runs a long kernel on that block, frees it and dies."""
    import gc

    held = []
    with stream:
        held.append(alloc(MiB))
    fake.launch(stream)
    with stream:
        held.clear()
    del stream
    gc.collect()


def _a_new_stream_at_h_allocates_dies_then_the_next_one_waits(fake, d, h):
    """B gets handle ``h``, allocates through ``d`` and dies with its kernel running; C gets
    ``h`` too: C's allocation must wait for B's kernel (B must have been watched)."""
    B = fake.stream(non_blocking=True)
    assert B.ptr == h
    _dies_with_its_kernel_running(fake, d, B)
    del B
    C = fake.stream(non_blocking=True)
    assert C.ptr == h and fake.busy_destroyed_streams() == 1
    with C:
        d(MiB)
    assert fake.busy_destroyed_streams() == 0


@needs_c
def test_route_direct_watches_a_new_stream_on_a_cached_handle_when_the_wait_came_from_elsewhere(monkeypatch):
    """A allocates through the route (its handle cached), dies; a raw_malloc (the same guard)
    waits; B gets A's handle and allocates: B must be watched, or C (the handle again) gets
    B's block while B's kernel runs."""
    import gc

    fake, s, d, pool = _direct_with_capsule(monkeypatch)
    A = fake.stream(non_blocking=True)
    with A:
        m = d(MiB)
    h = A.ptr
    del m, A
    gc.collect()
    s.raw_free(s.raw_malloc(MiB))  # on the null stream: waits, covers A's death
    assert s.guard.pending == [False]
    _a_new_stream_at_h_allocates_dies_then_the_next_one_waits(fake, d, h)


@needs_c
def test_route_direct_switches_between_a_few_watched_streams_without_asking_the_guard(monkeypatch):
    """A pipeline over four streams asks the guard once per stream; once a watched stream dies
    each is asked again, and a new stream at the dead one's handle is watched (the next one
    there waits for its work). More streams than the route remembers are asked again."""
    import gc

    fake, s, d, pool = _direct_with_capsule(monkeypatch)
    calls = []
    before = s.guard.before_allocation
    monkeypatch.setattr(s.guard, "before_allocation", lambda st, dev: calls.append(st.ptr) or before(st, dev))
    s.direct_route = DirectRoute(s, pool.malloc, _PoolOOM, s.guard)  # with the counting guard
    d = s.direct_route.allocator
    streams = [fake.stream(non_blocking=True) for _ in range(4)]
    keep = []
    for _ in range(5):
        for st in streams:
            with st:
                keep.append(d(4096))
    assert sorted(calls) == sorted(st.ptr for st in streams)  # once each, then in C
    keep.clear()
    A = streams.pop()
    h = A.ptr
    del A, st
    gc.collect()
    n = len(calls)
    for st in streams:
        with st:
            keep.append(d(4096))
    assert sorted(calls[n:]) == sorted(x.ptr for x in streams) and s.guard.n_syncs == [1]
    keep.clear()
    _a_new_stream_at_h_allocates_dies_then_the_next_one_waits(fake, d, h)

    many = [fake.stream(non_blocking=True) for _ in range(10)]
    n = len(calls)
    for _ in range(3):
        for st in many:
            with st:
                keep.append(d(4096))
    assert len(calls) - n > len(many)  # the route remembers 8: the others are asked again
    assert s.stats().n_live == len(keep)


@needs_c
def test_route_direct_does_not_cache_a_wrapper_of_a_stream_owned_elsewhere(monkeypatch):
    """An ExternalStream wrapper is not watched (its owner destroys the handle): the route must
    not take its handle for a watched one when an owned stream gets it later."""
    import gc

    fake, s, d, pool = _direct_with_capsule(monkeypatch)
    owner = fake.stream(non_blocking=True)
    ext = fake.external_stream(owner)
    with ext:
        m = d(MiB)
    h = owner.ptr
    del m, ext, owner
    gc.collect()
    _a_new_stream_at_h_allocates_dies_then_the_next_one_waits(fake, d, h)


def _b_at_a_dead_streams_handle(monkeypatch, route):
    """A allocates through the route (or raw_malloc), dies with its kernel running; B gets
    A's handle. Returns (fake, strategy, the allocation function, B)."""
    fake, s, d, pool = _direct_with_capsule(monkeypatch)
    alloc = d if route == "direct" else s.raw_malloc
    A = fake.stream(non_blocking=True)
    h = A.ptr
    _dies_with_its_kernel_running(fake, alloc, A)
    del A
    B = stream_on_handle(fake, h)
    return fake, s, alloc, B


@needs_c
@pytest.mark.parametrize("route", ["direct", "wrap"])
def test_a_wait_that_raises_is_made_again_at_the_next_allocation(monkeypatch, route):
    fake, s, alloc, B = _b_at_a_dead_streams_handle(monkeypatch, route)
    real = fake.device_synchronize

    def interrupted(device):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(fake, "device_synchronize", interrupted)
    with B, pytest.raises(RuntimeError, match="interrupted"):
        alloc(MiB)
    assert fake.busy_destroyed_streams() == 1 and s.guard.pending == [True]
    monkeypatch.setattr(fake, "device_synchronize", real)
    with B:
        alloc(MiB)
    assert fake.busy_destroyed_streams() == 0


@needs_c
@pytest.mark.parametrize("route", ["direct", "wrap"])
def test_an_allocation_while_another_waits_for_the_device_waits_too(monkeypatch, route):
    """CuPy releases the GIL in cudaDeviceSynchronize: another thread allocating meanwhile must
    not find the death covered before the wait has returned (simulated: the allocation runs from
    inside the first one's wait)."""
    fake, s, alloc, B = _b_at_a_dead_streams_handle(monkeypatch, route)
    real, seen = fake.device_synchronize, []

    def wait(device):
        if not seen:  # the other thread, on B, while this wait has not returned yet
            seen.append(None)
            with B:
                keep = alloc(MiB)
            seen.append(fake.busy_destroyed_streams())
            del keep
        real(device)

    monkeypatch.setattr(fake, "device_synchronize", wait)
    alloc(MiB)  # on the null stream: the first wait
    assert seen == [None, 0]


def test_pool_strategies_over_one_pool_share_one_guard():
    """use("pool") and using("pool") make a new strategy each time over CuPy's one pool (here,
    one fake backend): a stream watched by the first is still watched by the next."""
    fake = FakeBackend()
    s1 = cupy_memstrat.create("pool", backend=fake)
    s2 = cupy_memstrat.create("pool:route=wrap", backend=fake)
    assert s1.guard is s2.guard
    assert cupy_memstrat.create("pool", backend=FakeBackend()).guard is not s1.guard
    busy, B = _a_stream_dies_while_its_kernel_runs(fake, lambda: s1.raw_malloc(MiB), s1.raw_free)
    assert busy == 0
    del B
    s2.raw_free(s2.raw_malloc(MiB))  # B died, watched through s1: s2's allocation waits
    assert s2.guard.n_syncs == [2]


# The guard's corner cases with CuPy's stream function: new streams at dead handles.

@needs_c
@pytest.mark.parametrize("route", ["direct", "wrap"])
def test_a_stream_made_between_cudastreamdestroy_and_the_weakref_callback(monkeypatch, route):
    """CuPy destroys a stream's handle in Stream.__del__, before weak references are cleared:
    a stream B made at that moment (another thread) gets the handle before the death is
    counted. The wrap route counts it when B's allocation finds the handle watched for
    another stream; the direct route's C check, which knows handles only, cannot tell B from
    A in that window (documented: on a build with the GIL nothing runs there)."""
    import gc

    from cupy_memstrat.testing import FakeStream

    fake, s, d, pool = _direct_with_capsule(monkeypatch)
    alloc = d if route == "direct" else s.raw_malloc
    A = fake.stream(non_blocking=True)
    h = A.ptr
    held = []
    with A:
        held.append(alloc(MiB))
        held.append(alloc(MiB))
    fake.launch(A)
    with A:
        held.clear()
    seen = []
    orig = FakeStream.destroy

    def destroy(self):
        orig(self)
        if self.ptr == h and not seen:  # in the window between the handle's destruction and the callback
            B = fake.stream(non_blocking=True)
            assert B.ptr == h
            with B:
                keep = s.raw_malloc(MiB)  # the wrap route's allocation (the Python guard)
            seen.append(fake.busy_destroyed_streams())
            s.raw_free(keep)
            del B  # here, not with the patched function (its closure must not hold a stream)

    monkeypatch.setattr(FakeStream, "destroy", destroy)
    del A
    gc.collect()
    assert seen == [0]
    gc.collect()
    assert s.guard.deaths == [2]  # A's death once (its callback went with its entry), then B's
    s.raw_free(s.raw_malloc(512))
    assert s.guard.synced == [2]


@pytest.mark.parametrize("name", ["torch", "rmm", "pool"])
def test_strategies_over_one_process_wide_cache_share_their_guard(name):
    """PyTorch's caching allocator and RMM's current resource are process-wide, like CuPy's
    pool: a stream watched through one strategy dies; the next strategy (use() again, a
    using() block) must not hand its block to a new stream on that handle."""
    fake = FakeBackend()
    s1 = cupy_memstrat.create(name, backend=fake)
    A = fake.stream(non_blocking=True)
    h = A.ptr
    with A:
        p = s1.raw_malloc(MiB)
    fake.launch(A)
    with A:
        s1.raw_free(p)
    s2 = cupy_memstrat.create(name, backend=fake)  # e.g. cupy_memstrat.use(name) again
    assert s2.guard is s1.guard
    del A
    B = stream_on_handle(fake, h, still_running=1)
    with B:
        s2.raw_free(s2.raw_malloc(MiB))
    assert fake.busy_destroyed_streams() == 0


def test_a_simulated_backends_guards_go_with_it():
    import gc
    import weakref as _weakref

    fake = FakeBackend()
    s = cupy_memstrat.create("pool", backend=fake)
    s.raw_free(s.raw_malloc(512))
    s.close()
    ref = _weakref.ref(fake)
    del s, fake
    gc.collect()
    assert ref() is None


@needs_c
@pytest.mark.parametrize("method", ["stale", "reap", "free_early"])
def test_route_direct_python_code_in_the_token_lookup_that_drops_the_memory_object(method):
    """A key in the memory object's __dict__ with the token name's hash runs Python code during the
    token's lookup; here it drops the held table's reference, the memory object's last. The lookup
    holds the object and the token meanwhile (before, it read the freed token: valgrind showed
    invalid reads on all three paths), and the block is counted freed once."""
    import gc

    fake, s, d, pool, B = _direct_strategy_and_stream()
    n = s.stats().n_allocs
    x = d(4096)
    P = x.ptr
    assert cupy_memstrat.record_stream(x, B) is True
    fake.launch(B)
    mem, held = x.mem, s.direct_route.held
    (name,) = [k for k, v in vars(mem).items() if type(v).__name__ == "PoolToken"]

    class Drops:
        armed = False

        def __hash__(self):
            return hash(name)

        def __eq__(self, other):
            if Drops.armed:
                Drops.armed = False
                held.clear()
            return False

    tok = vars(mem).pop(name)
    vars(mem)[Drops()] = 1  # probed before the token
    vars(mem)[name] = tok
    del tok, mem, x
    gc.collect()
    Drops.armed = True
    if method == "free_early":
        d.free_early(P)
    else:
        getattr(d, method)()
    fake.finish(B)
    st = s.stats()
    assert (st.bytes_in_use, st.n_live, st.n_allocs, st.n_frees) == (0, 0, n + 1, n + 1)



def test_a_memory_pool_that_hands_out_a_bad_block_is_named_and_loses_nothing():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

    class Same(_StandInPool):  # the same pointer every time, as a broken pool would
        def malloc(self, size):
            return _MP(_SlotMem(0x5000, (size + 511) & -512))

    s = CuPyPoolStrategy(backend=FakeBackend(), memory_pool=Same(oom=cupy.cuda.memory.OutOfMemoryError),
                         route="wrap")
    p = s.raw_malloc(1000)
    with pytest.raises(RuntimeError, match=r"memory_pool: .* handed out 0x5000 again while it is still in use"):
        s.raw_malloc(2000)
    assert s.live_sizes() == {p: 1000} and s.stats().n_failed == 0  # the first block intact

    class FloatPtr(_StandInPool):
        def malloc(self, size):
            return _MP(_SlotMem(4096.0, 512))

    t = CuPyPoolStrategy(backend=FakeBackend(), memory_pool=FloatPtr(), route="wrap")
    with pytest.raises(TypeError, match=r"memory_pool: .*\.malloc returned .* whose \.ptr is 4096\.0: expected"):
        t.raw_malloc(100)
    assert t.live_sizes() == {} and t.stats().n_allocs == 0
