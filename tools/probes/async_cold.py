"""Where `async`'s time goes on a cold large allocation (bench workloads'
managed-large: one float32 array of a quarter of the device plus 1 GiB, from
nothing cached), beside CuPy's MemoryPool and CuPy's MemoryAsyncPool.

Per path, in interleaved rounds (the order rotated each round), each step
timed to a device synchronisation: the allocation (`cupy.empty`), the first
fill (first touch), a second fill, a sum, the free, then giving the cache
back (`free_all_blocks` / `trim`), which the bench does outside its timing.

    python tools/probes/async_cold.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    import cupy as cp

    import cupy_memstrat

    dev = cp.cuda.Device()
    total = dev.mem_info[1]
    nbytes = int(total / 4 + (1 << 30))
    nbytes -= nbytes % (1 << 20)
    n = nbytes // 4
    default = cp.get_default_memory_pool()
    ours = cupy_memstrat.create("async")
    theirs = cp.cuda.MemoryAsyncPool()
    paths = {
        "cupy-default": (default.malloc, default.free_all_blocks),
        "async": (ours.cupy_allocator(), ours.trim),
        "cupy-async": (theirs.malloc, theirs.free_all_blocks),
    }
    prev = cp.cuda.get_allocator()
    out = {label: {} for label in paths}

    def timed(fn):
        t0 = time.perf_counter()
        r = fn()
        dev.synchronize()
        return r, time.perf_counter() - t0

    try:
        labels = list(paths)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                malloc, release = paths[label]
                cp.cuda.set_allocator(malloc)
                steps = {}
                x, steps["alloc"] = timed(lambda: cp.empty(n, dtype=cp.float32))
                _, steps["fill_first"] = timed(lambda: x.fill(1))
                _, steps["fill_again"] = timed(lambda: x.fill(2))
                _, steps["sum"] = timed(lambda: x.sum(dtype=cp.float64))
                t0 = time.perf_counter()
                x = None  # the free being timed
                dev.synchronize()
                steps["free"] = time.perf_counter() - t0
                cp.cuda.set_allocator(prev)
                _, steps["release"] = timed(release)
                for k, v in steps.items():
                    out[label].setdefault(k, []).append(v)
    finally:
        cp.cuda.set_allocator(prev)
        ours.close()
    report = {"nbytes": nbytes, "rounds": args.rounds,
              "median_ms": {lab: {k: round(statistics.median(v) * 1e3, 3) for k, v in steps.items()}
                            for lab, steps in out.items()},
              "runs_s": out}
    for lab, steps in report["median_ms"].items():
        print(f"{lab:14s} " + "  ".join(f"{k} {v:8.2f} ms" for k, v in steps.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
