"""Small helpers the tests share (tests/ is on sys.path: pytest puts it there for tests/conftest.py)."""

import gc
import threading


def run_threads(target, n):
    """Run ``target(0)`` ... ``target(n - 1)``, each in its own thread, all started before
    any is joined; return once every one has finished."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def assert_sole_live_origin(s, filename, size):
    """``s`` (made with ``track_origins=True``) has one live allocation, of ``size`` bytes, made
    from ``filename``. The allocation itself stays in the test: the origin is the first frame
    outside CuPy and cupy_memstrat, so an allocation made here would be recorded as this file's."""
    (row,) = s.live_allocations()
    assert row.origin.filename == filename and row.size == size, (row.origin, row.size)


def stream_on_handle(fake, handle, still_running=None):
    """The next non-blocking stream of ``fake``, checked to have ``handle``, a destroyed stream's:
    CUDA gives a destroyed stream's handle to the next new stream (the fake always does), the step
    the dead-stream tests build on. Garbage is collected first, so that the old stream is gone; the
    caller drops its own reference to it before (``del A``), which a helper cannot do for it. With
    ``still_running``, also checks how many destroyed streams still have work running on the fake
    (the old stream's kernel outlives its handle)."""
    gc.collect()
    stream = fake.stream(non_blocking=True)
    assert stream.ptr == handle, (stream.ptr, handle)
    if still_running is not None:
        assert fake.busy_destroyed_streams() == still_running, (fake.busy_destroyed_streams(), still_running)
    return stream


def dead_stream_allocation(fake, s, size):
    """The dead-stream pattern on ``fake`` under strategy ``s``: ``size`` bytes allocated on a
    stream A, written by a long kernel there, freed on A; A dies while its kernel runs, and a new
    stream B, which gets A's handle, allocates ``size`` bytes. Returns ``(p, q, B)``: A's block,
    B's block, and B (alive)."""
    A = fake.stream(non_blocking=True)
    with A:
        p = s.raw_malloc(size)
    fake.launch(A)  # a long kernel writing p
    with A:
        s.raw_free(p)
    a = A.ptr
    del A
    B = stream_on_handle(fake, a, still_running=1)
    with B:
        q = s.raw_malloc(size)
    return p, q, B
