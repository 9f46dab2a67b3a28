"""Probe: where the managed strategy's alloc+free time goes on the GPU host.

Per pair, median of 7 rounds of 100 000, microseconds:
  cupy-default       cupy.cuda.alloc(512) under CuPy's pool
  managed/alloc      cupy.cuda.alloc(512) under the managed strategy (C hot path)
  managed/direct     the strategy's own malloc(512, 0) / free(ptr, 0), no CuPy memory object
  managed/int        the same with the stream read through a trivial C callable (int())
                     instead of CuPy's get_current_stream_ptr: what reading the stream costs
  device/direct      the device strategy's hot path (cudaMalloc / cudaFree), for scale
Prints one JSON line.
"""

import json
import statistics
import time

import cupy as cp

import cupy_memstrat
from cupy_memstrat.strategies.managed import ManagedStrategy


class _IntStream(ManagedStrategy):
    def _stream_source(self):
        return None, int


def pairs(fn, n=100_000, rounds=7):
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(out), 3)


def direct(s):
    m, f = s._hot_malloc, s._hot_free

    def one():
        f(m(512, 0), 0)

    return one


res = {}
cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
res["cupy-default"] = pairs(lambda: cp.cuda.alloc(512))
s = cupy_memstrat.use("managed")
res["managed/alloc"] = pairs(lambda: cp.cuda.alloc(512))
res["managed/direct"] = pairs(direct(s))
res["hot_path"] = s.hot_path
t = _IntStream()
t.raw_free(t.raw_malloc(512))
res["managed/int"] = pairs(direct(t))
d = cupy_memstrat.create("device")
d.raw_free(d.raw_malloc(512))
res["device/direct"] = pairs(direct(d), n=20_000)
cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
print(json.dumps(res))
