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
