"""Where an async alloc+free pair's time goes (issue 18), on one GPU, side by side.

Interleaved rounds; median microseconds per alloc+free pair of 1 MiB on the
legacy default stream:

  raw/own, raw/default       cudaMallocFromPoolAsync + cudaFreeAsync from a Python loop (CuPy's
                             Cython wrappers), on an own pool (threshold max) / the default pool
  direct/c, direct/python    the strategy's hot path functions malloc(size, 0) / free(ptr, 0)
                             called from a Python loop (no CuPy), cache=0: C and Python paths
  direct/c+cache             the same, C path, with the default-stream cache
  pfa/own, pfa/default       cupy.cuda.alloc through a PythonFunctionAllocator whose functions
                             only call the raw pair (the floor of any Python-function allocator)
  alloc/c, alloc/python      cupy.cuda.alloc under use("async", cache=0), C / Python hot path
  alloc/c+cache              the same with the cache (the default)
  cupy-async                 cupy.cuda.alloc under CuPy's MemoryAsyncPool

Prints one JSON object (medians, and ratios to raw/own and pfa/own).
"""

import json
import os
import statistics
import sys
import time

import cupy

import cupy_memstrat
from cupy_memstrat.strategies import _support

SIZE = 1 << 20
N = 20000
ROUNDS = 7
rt = cupy.cuda.runtime
dev = cupy.cuda.Device()


def timed(fn):
    fn(500)
    t0 = time.perf_counter()
    fn(N)
    t = (time.perf_counter() - t0) / N * 1e6
    dev.synchronize()
    return t


def raw_loop(pool):
    m, f = rt.mallocFromPoolAsync, rt.freeAsync

    def run(n):
        for _ in range(n):
            f(m(SIZE, pool, 0), 0)
    return run


def direct(strategy):
    malloc, free = strategy._hot_malloc, strategy._hot_free  # built by strategy() under its own setting

    def run(n):
        for _ in range(n):
            free(malloc(SIZE, 0), 0)
    return run


def pfa(pool):
    m, f = rt.mallocFromPoolAsync, rt.freeAsync
    a = cupy.cuda.PythonFunctionAllocator(lambda size, d: m(size, pool, 0), lambda p, d: f(p, 0))
    return a.malloc


def through(allocator):
    alloc = cupy.cuda.alloc

    def run(n):
        cupy.cuda.set_allocator(allocator)
        for _ in range(n):
            alloc(SIZE)
        cupy.cuda.set_allocator(None)
    return run


def strategy(path, **opts):
    os.environ[_support.HOT_PATH_ENV] = path
    s = cupy_memstrat.create("async", **opts)
    s.raw_free(s.raw_malloc(1))
    return s


def main():
    s_c, s_py, s_cc = strategy("c", cache=0), strategy("python", cache=0), strategy("c")
    a_c, a_py, a_cc = strategy("c", cache=0), strategy("python", cache=0), strategy("c")
    own = s_c.pool_stats().handle
    default = rt.deviceGetDefaultMemPool(dev.id)
    cases = {
        "raw/own": raw_loop(own),
        "raw/default": raw_loop(default),
        "direct/c": direct(s_c),
        "direct/python": direct(s_py),
        "direct/c+cache": direct(s_cc),
        "pfa/own": through(pfa(own)),
        "pfa/default": through(pfa(default)),
        "alloc/c": through(a_c.cupy_allocator()),
        "alloc/python": through(a_py.cupy_allocator()),
        "alloc/c+cache": through(a_cc.cupy_allocator()),
        "cupy-async": through(cupy.cuda.MemoryAsyncPool().malloc),
    }
    hot = {k: getattr(s, "hot_path", None) for k, s in
           {"s_c": s_c, "s_py": s_py, "s_cc": s_cc, "a_c": a_c, "a_py": a_py, "a_cc": a_cc}.items()}
    times = {k: [] for k in cases}
    for r in range(ROUNDS):
        order = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]
        for k in order:
            times[k].append(timed(cases[k]))
        print(f"round {r + 1}/{ROUNDS}", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "probe": "async_hot_path", "size": SIZE, "n": N, "rounds": ROUNDS, "hot_paths": hot,
        "median_us": med,
        "ratio_to_raw_own": {k: v / med["raw/own"] for k, v in med.items()},
        "ratio_to_pfa_own": {k: v / med["pfa/own"] for k, v in med.items()},
        "stats_after": {"a_c": str(a_c.stats()), "n_oom_recoveries": a_c.stats().n_oom_recoveries},
        "gpu": cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(),
        "versions": {"cupy": cupy.__version__, "driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
