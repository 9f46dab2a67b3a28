"""Probe: the floor of any allocator CuPy calls through PythonFunctionAllocator.

Alloc+free pairs of 512 B through ``cupy.cuda.alloc`` (as ``bench alloc``),
interleaved rounds, median microseconds, for:

* cupy-default: CuPy's MemoryPool (Cython);
* c-floor: a PythonFunctionAllocator whose malloc and free are C functions
  doing nothing (``operator.add`` / ``operator.sub``; the "pointer" 512 is
  never dereferenced): what CuPy's PFA itself costs;
* python-floor: PFA over a Python free list (bench alloc's baseline);
* the strategies named on the command line (default: pool managed device),
  each with the C hot path and with the Python one;
* no-pool: ``set_allocator(None)``.

Run on the GPU machine:  python3 tools/probes/hot_path_floor.py [--json PATH] [strategy ...]
"""
import json
import operator
import os
import statistics
import sys

import cupy

import cupy_memstrat
import cupy_memstrat.info
from cupy_memstrat.bench.alloc import _calibrate, _time_pairs, python_floor_allocator

args = sys.argv[1:]
json_path = None
if "--json" in args:
    i = args.index("--json")
    json_path = args[i + 1]
    del args[i:i + 2]
names = args or ["pool", "managed", "device"]
cuda = cupy.cuda
pool = cupy.get_default_memory_pool()
c_floor = cuda.PythonFunctionAllocator(operator.add, operator.sub)
py_floor, release = python_floor_allocator(cupy)
paths = [("cupy-default", pool.malloc), ("c-floor", c_floor.malloc), ("python-floor", py_floor.malloc)]
for n in names:
    for hot_path in ("c", "python"):  # the strategy's hot path is built when its allocator is made
        os.environ["CUPY_MEMSTRAT_HOT_PATH"] = hot_path
        s = cupy_memstrat.create(n)
        paths.append((f"{n}/{hot_path}", s.cupy_allocator()))
        assert s.hot_path == hot_path, (n, s.hot_path, cupy_memstrat.hot_path_status())
os.environ.pop("CUPY_MEMSTRAT_HOT_PATH")
paths.append(("no-pool", None))
res = {p: [] for p, _ in paths}
iters = {}
for r in range(7):
    for label, alloc in paths:
        cuda.set_allocator(alloc)
        if label not in iters:
            iters[label] = _calibrate(lambda k: _time_pairs(cupy, 512, k), 0.03)
        res[label].append(_time_pairs(cupy, 512, iters[label]) * 1e6)
cuda.set_allocator(pool.malloc)
base = statistics.median(res["cupy-default"])
out = {}
for label, xs in res.items():
    m = statistics.median(xs)
    out[label] = {"median_us": m, "ratio_to_cupy_default": m / base, "runs_us": xs}
    print(f"{label:14s} {m:7.3f} us  {m / base:5.2f}x", flush=True)
if json_path:
    with open(json_path, "w") as f:
        json.dump({"machine": cupy_memstrat.info.collect(), "size": 512, "paths": out}, f, indent=1)
