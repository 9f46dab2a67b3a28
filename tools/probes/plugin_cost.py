"""Probe: where pytest_gpumem's per-test time goes on a real suite.

Load with ``-p plugin_cost`` (``PYTHONPATH=tools/probes``) next to ``--gpumem``.
It wraps the plugin's per-test pieces (the measuring windows, the verdict,
the allocator check) and ``gc.collect`` with timers, and at the end of the
session writes one JSON per process to ``$PLUGIN_COST_DIR`` (seconds spent in
each piece, call counts, and the allocations and frees the measured strategy
made), so the per-test work can be set against the allocation count times the
per-allocation cost that ``bench alloc`` measures.
"""
import functools
import gc
import json
import os
import time

import pytest

T: dict = {}
_t_start = time.perf_counter()


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = T.setdefault(name, [0, 0.0])
            rec[0] += 1
            rec[1] += time.perf_counter() - t0
    return wrapper


def pytest_configure(config):
    from pytest_gpumem import measure, plugin

    for cls, names in ((measure.Meter, ("open", "close", "leaks", "largest_new")),
                       (plugin._State, ("verdict", "follow_allocator"))):
        for n in names:
            setattr(cls, n, _timed(f"{cls.__name__}.{n}", getattr(cls, n)))
    real_collect = gc.collect

    def collect(generation=2):
        return _timed(f"gc.collect({generation})", real_collect)(generation)

    gc.collect = collect


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    import cupy_memstrat

    out = os.environ.get("PLUGIN_COST_DIR")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    s = cupy_memstrat.current()
    allocs = frees = 0
    if s is not None:
        for d in range(s.backend.device_count()):
            st = s.stats(d)
            allocs += st.n_allocs
            frees += st.n_frees
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{worker}.json"), "w") as f:
        json.dump({"worker": worker, "session_seconds": time.perf_counter() - _t_start,
                   "strategy": getattr(s, "name", None), "n_allocs": allocs, "n_frees": frees,
                   "timers": {k: {"calls": v[0], "seconds": round(v[1], 4)} for k, v in sorted(T.items())}}, f)
