"""Probe: the ``dead-stream`` pattern of ``bench streams``, round by round:
the handles CUDA gives A and B, the blocks x and y, device synchronisations,
reclaims, and the wrong elements; under ``managed`` (both hot paths, and
with the destroyed-stream reclaim turned off), CuPy's pool and ``pool``.
Prints JSON lines; with a path, also writes them there as one JSON list."""

import gc
import json
import os
import sys

import cupy as cp

import cupy_memstrat
from cupy_memstrat.bench import streams as S
from cupy_memstrat.info import collect
from cupy_memstrat.strategies import _support
from cupy_memstrat.strategies.managed import ManagedStrategy

k = S.Kernels(cp)
N = S.N


class NoReclaim(ManagedStrategy):
    name = "managed-no-reclaim"

    def _reclaim(self, device):
        return None


ROWS = []


def trace(tag, make, rounds=5):
    s = make()
    if s is None:  # CuPy's pool
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
        from cupy_memstrat import cuda as C

        b = C.get_backend()
    else:
        cp.cuda.set_allocator(s.cupy_allocator())
        b = s.backend
    syncs = [0]
    real = b.device_synchronize

    def counted(device):
        syncs[0] += 1
        return real(device)

    b.device_synchronize = counted
    rows = []
    try:
        for r in range(rounds):
            a = cp.cuda.Stream(non_blocking=True)
            ah = a.ptr
            with a:
                x = cp.empty(N, dtype=cp.float32)
                xp = x.data.ptr
                k.fill(x, 5.0)
                del x
            del a
            s0 = syncs[0]
            bb = cp.cuda.Stream(non_blocking=True)
            bh = bb.ptr
            with bb:
                y = cp.zeros(N, dtype=cp.float32)
                yp = y.data.ptr
                s1 = syncs[0]
                bb.synchronize()
            cp.cuda.Device().synchronize()
            wrong = int(cp.count_nonzero(y))
            row = {"round": r, "A": hex(ah), "B": hex(bh), "same_handle": ah == bh, "x": hex(xp), "y": hex(yp),
                   "same_block": xp == yp, "syncs_in_B_alloc": s1 - s0, "wrong": wrong}
            if hasattr(s, "managed_stats"):
                row["n_reclaims"] = s.managed_stats().n_reclaims
            rows.append(row)
            del y, bb
    finally:
        b.device_synchronize = real
        S.release(cp, s)
    for row in rows:
        row = {"run": tag, "hot_path": getattr(s, "hot_path", None), **row}
        ROWS.append(row)
        print(json.dumps(row), flush=True)


for hp in ("c", "python"):
    os.environ[_support.HOT_PATH_ENV] = hp
    trace("managed", lambda: cupy_memstrat.create("managed"))
    trace("managed-no-reclaim", lambda: NoReclaim())
trace("cupy-default", lambda: None, rounds=10)
trace("pool", lambda: cupy_memstrat.create("pool"), rounds=10)
trace("async", lambda: cupy_memstrat.create("async"), rounds=10)

# the freed-by-gc control: how long gc.collect() takes next to the 0.1 s kernel
import time

objs = [[i] for i in range(2_000_000)]
t = time.perf_counter(); gc.collect(); full = time.perf_counter() - t
t = time.perf_counter(); gc.collect(0); young = time.perf_counter() - t
row = {"gc_collect_s_with_2M_objects": full, "gc_collect0_s": young}
ROWS.append(row)
print(json.dumps(row))
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"machine": collect(), "rows": ROWS}, f, indent=1, default=str)
