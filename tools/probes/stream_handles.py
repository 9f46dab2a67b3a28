"""Probe: does CUDA hand a new stream the handle of one destroyed before?

The stream-ordered caches (CuPy's pool, the managed strategy) key their
arenas by the stream's handle. A program that makes a stream per step, as
bench workloads' multi-stream program does, leaves an arena behind per dead
stream unless new streams get the old handles back. Prints how many distinct
handles 200 create/destroy cycles saw, one stream and four at a time.
"""

import cupy as cp

for k in (1, 4):
    seen = set()
    for _ in range(200):
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
        seen.update(s.ptr for s in streams)
        for s in streams:
            s.synchronize()
        del streams
    print(f"{k} stream(s) at a time, 200 rounds: {len(seen)} distinct handles")

# The same question inside bench workloads' multi-stream program: the handles its
# streams get over 20 runs, and CuPy's own pool total after each run.
from cupy_memstrat.bench import workloads as W

handles = set()
real_stream = cp.cuda.Stream


class Recording(real_stream):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        handles.add(self.ptr)


cp.cuda.Stream = Recording
try:
    pool = cp.get_default_memory_pool()
    totals = []
    for _ in range(20):
        W.multi_stream(cp)
        totals.append(pool.total_bytes() >> 20)
finally:
    cp.cuda.Stream = real_stream
print(f"multi-stream, 20 runs: {len(handles)} distinct handles; CuPy pool total after each run (MiB): {totals}")
