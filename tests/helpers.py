"""Small helpers the tests share (tests/ is on sys.path: pytest puts it there for tests/conftest.py)."""

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
