"""Where ``async`` loses time on the four-stream pipeline of ``bench workloads``
(issue 15's 1.05x bar), on one GPU, in one run.

The ``multi-stream`` workload side by side under CuPy's pool, ``pool`` and
``async`` with its per-stream cache at 0, the default (64 MiB) and 512 MiB,
then each ``async`` variant's pool statistics after 20 runs in a row (frees
after a stream died, cached and reserved bytes). Writes one JSON object to
the path given (default: stdout).
"""

import dataclasses
import json

import cupy

from cupy_memstrat.bench import streams as S
from cupy_memstrat.bench import workloads as W
from cupy_memstrat.info import collect

from _probe_report import write_report

SPECS = ["async", "async:cache=0", "async:cache=512MiB", "pool"]
out = {"machine": collect()}
rep = W.run(only=["multi-stream"], rounds=7, strategies=SPECS)
out["workloads"] = rep
print(W.format_table(rep), flush=True)

after = {}
for spec in SPECS[:3]:
    s = S.install(cupy, spec)
    try:
        for _ in range(20):
            W.multi_stream(cupy)
        cupy.cuda.Device().synchronize()
        after[spec] = {"pool_stats": dataclasses.asdict(s.pool_stats()), "stats": dataclasses.asdict(s.stats())}
    finally:
        S.release(cupy, s)
out["async_pool_after_20_runs"] = after
print(json.dumps(after, indent=1, default=str), flush=True)
write_report(out)
