"""Destroyed streams' chunks under ``managed`` (issue 15), on one GPU, in one run.

1. The four-stream pipeline of ``bench workloads`` (new streams every run)
   under CuPy's pool and the pooling strategies: ``workloads.run(only=
   ["multi-stream"])``, the same code and report as ``bench workloads``.
2. The same pipeline run 20 times in a row under ``managed``: reserved bytes
   after each run, chunks reclaimed, and CuPy's pool's total bytes after the
   same 20 runs (it keeps each dead stream's blocks).
3. The ``dead-stream-reclaimed`` pattern of ``bench streams`` under every
   allocator of that bench: wrong elements over 5 rounds (0: safe).

Writes one JSON object to the path given (default: stdout).
"""

import json

import cupy

from cupy_memstrat.bench import streams as S
from cupy_memstrat.bench import workloads as W
from cupy_memstrat.info import collect

from _probe_report import write_report

out = {"machine": collect()}

# 1. the workload, side by side
rep = W.run(only=["multi-stream"], rounds=5, strategies=["managed", "managed:prefetch=on_new", "async", "pool"])
out["workloads"] = rep
print(W.format_table(rep), flush=True)

# 2. memory over 20 runs
pool = cupy.get_default_memory_pool()
growth = {}
for spec in ("cupy-default", "managed"):
    s = S.install(cupy, spec)
    seen = []
    try:
        for _ in range(20):
            W.multi_stream(cupy)
            cupy.cuda.Device().synchronize()
            seen.append(int(pool.total_bytes()) if s is None else s.managed_stats().reserved_bytes)
        if s is not None:
            ms = s.managed_stats()
            growth["managed_stats"] = {"n_reclaims": ms.n_reclaims, "reclaimed_bytes": ms.reclaimed_bytes,
                                       "reserved_bytes": ms.reserved_bytes, "cached_bytes": ms.cached_bytes}
    finally:
        S.release(cupy, s)
    growth[spec] = seen
out["reserved_after_each_of_20_runs"] = growth
print(json.dumps(growth), flush=True)

# 3. the pattern
k = S.Kernels(cupy)
cells = {}
for spec in S.ALLOCATORS:
    s = S.install(cupy, spec)
    try:
        cells[spec] = S.dead_stream_reclaimed(cupy, k)
        if spec == "managed":
            cells["managed_n_reclaims"] = s.managed_stats().n_reclaims
    finally:
        S.release(cupy, s)
out["dead_stream_reclaimed"] = cells
print(json.dumps(cells), flush=True)

write_report(out)
