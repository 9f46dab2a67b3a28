"""Probe: what a Numba device-array allocation costs through cupy_memstrat.numba.

    python tools/probes/numba_alloc_cost.py OUT.json [--repeats 3]

Each measurement is a child process (Numba reads NUMBA_CUDA_MEMORY_MANAGER once, at its
first use of CUDA): ``default`` is Numba's own memory manager (cuMemAlloc, frees queued and
flushed in batches); ``memstrat:S`` is cupy_memstrat.numba over strategy S. A child times
``numba.cuda.device_array(n, uint8)`` then dropping it, per pair, for 512 B, 1 MiB and 32 MiB:
7 rounds of a calibrated loop, the median in microseconds. The children run in turn,
``--repeats`` times, the order rotated; the report has each path's median over its children
and its ratio to ``default`` measured in the same repeat.
"""

import json
import os
import statistics
import subprocess
import sys

SIZES = (512, 1 << 20, 32 << 20)
PATHS = ("default", "memstrat:pool", "memstrat:async", "memstrat:managed", "memstrat:device")
COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu", "numba_compat")

CHILD = r"""
import json, statistics, sys, time
import numpy as np
path = sys.argv[1]
if path != "default":
    import cupy_memstrat
    cupy_memstrat.use(path.split(":", 1)[1])
from numba import cuda
out = {}
for n in (512, 1 << 20, 32 << 20):
    def pairs(k):
        t0 = time.perf_counter()
        for _ in range(k):
            a = cuda.device_array(n, dtype=np.uint8)
            del a
        return (time.perf_counter() - t0) / k
    pairs(20)
    k = 20
    while pairs(k) * k < 0.01 and k < 1 << 16:
        k *= 4
    out[str(n)] = statistics.median(pairs(k) for _ in range(7)) * 1e6
cuda.synchronize()
print(json.dumps(out))
"""


def child(path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUPY_MEMSTRAT", "CUPY_MEMSTRAT_BACKEND")}
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    if path != "default":
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "cupy_memstrat.numba"
    env["PYTHONPATH"] = COMPAT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=env, timeout=240)
    if r.returncode != 0:
        raise RuntimeError(f"{path}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(out: str, repeats: int = 3) -> None:
    runs = {p: [] for p in PATHS}
    ratios = {p: {str(n): [] for n in SIZES} for p in PATHS}
    for r in range(repeats):
        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
        got = {p: child(p) for p in order}
        for p in PATHS:
            runs[p].append(got[p])
            for n in SIZES:
                ratios[p][str(n)].append(got[p][str(n)] / got["default"][str(n)])
    from cupy_memstrat.info import collect

    report = {
        "probe": "numba_alloc_cost", "repeats": repeats, "sizes": list(SIZES),
        "machine": collect(),
        "median_us": {p: {str(n): statistics.median(x[str(n)] for x in runs[p]) for n in SIZES} for p in PATHS},
        "ratio_to_default_same_repeat": {p: {k: statistics.median(v) for k, v in ratios[p].items()} for p in PATHS},
        "runs_us": runs,
    }
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    for p in PATHS:
        print(p, {k: round(v, 2) for k, v in report["median_us"][p].items()},
              {k: round(v, 2) for k, v in report["ratio_to_default_same_repeat"][p].items()})


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    main(args[0], int(args[2]) if len(args) > 2 and args[1] == "--repeats" else 3)
