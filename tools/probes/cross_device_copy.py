"""Cross-device copies on the legacy default stream, by kind of memory, and what an allocator can do
about them (issue 22; docs/async.md, "Caveat: copies between devices on the default stream").

For each allocator: device 0 fills a buffer with a slow kernel on its legacy stream; at once, with
device 1 current, the buffer is copied to device 1 on device 1's legacy stream, as CuPy's
cross-device copies do. Counted: the copies that read unfinished data, in two forms:

* ``copy_from_device_async``: a destination allocated after the fill was queued, then
  ``MemoryPointer.copy_from_device_async`` (what tests/gpu/test_async_gpu.py measures);
* ``cupy.array``: ``cupy.array(src)`` with device 1 current (what CuPy's ``test_copy_multigpu``
  does), which allocates the destination and copies into it.

Each once as it is and once with device 0 synchronised before the copy (the documented remedy).
The allocators: ``device`` (``cudaMalloc``), CuPy's default pool (``cudaMalloc`` underneath),
``async`` (an own pool per device, peer access through ``cudaMemPoolSetAccess``), ``async`` behind
``OrderAfterOtherDevices`` (tools/probes/cross_device_order.py: an event recorded at allocation),
CuPy's ``MemoryAsyncPool`` and ``managed``. Then what the event costs: alloc+free pairs of 512 B on
device 1 (device 0 in use), with and without it, interleaved.

Needs two GPUs with peer access; with one, it writes the machine and says so.

Usage: python tools/probes/cross_device_copy.py [OUT.json] (default: stdout)
"""

import statistics
import time

import cupy

import cupy_memstrat
from cupy_memstrat.bench.streams import Kernels
from cupy_memstrat.info import collect

from _probe_report import write_report
from cross_device_order import OrderAfterOtherDevices

TRIALS = 5
N = 1 << 16


def _allocators():
    """name -> (malloc for cupy.cuda.set_allocator, what to keep alive)."""
    out = {}
    for spec in ("device", "async", "managed"):
        s = cupy_memstrat.create(spec)
        out[spec] = (s.cupy_allocator(), s)
    out["cupy-default"] = (cupy.get_default_memory_pool().malloc, None)
    s = cupy_memstrat.create("async")
    w = OrderAfterOtherDevices(s.cupy_allocator())
    out["async+event-at-allocation"] = (w.malloc, (s, w))
    out["cupy-async"] = (cupy.cuda.MemoryAsyncPool().malloc, None)
    return out


def _fill(kernels):
    """A buffer on device 0, filled with 7.0 by a long kernel on its legacy stream (queued, not done)."""
    with cupy.cuda.Device(0):
        src = cupy.zeros(N, cupy.float32)
        cupy.cuda.Device().synchronize()
        kernels[0].fill(src, 7.0)
    return src


def _copies_read_unfinished(kernels, how, sync_source):
    bad = 0
    for _ in range(TRIALS):
        src = _fill(kernels)
        if sync_source:
            with cupy.cuda.Device(0):
                cupy.cuda.Device().synchronize()
        with cupy.cuda.Device(1):
            if how == "cupy.array":
                dst = cupy.array(src)
            else:
                dst = cupy.empty(N, cupy.float32)
                dst.data.copy_from_device_async(src.data, src.nbytes)
            bad += float(dst.sum()) != 7.0 * N
        with cupy.cuda.Device(0):
            cupy.cuda.Device().synchronize()
        del src, dst
    return bad


def _pair_us(malloc, rounds=7, n=2000):
    cupy.cuda.set_allocator(malloc)
    with cupy.cuda.Device(1):
        for _ in range(200):
            cupy.cuda.alloc(512)
        best = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                cupy.cuda.alloc(512)
            cupy.cuda.Device().synchronize()
            best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def main():
    out = {"probe": "cross_device_copy", "machine": collect(), "trials": TRIALS, "n_floats": N}
    n = cupy.cuda.runtime.getDeviceCount()
    out["n_devices"] = n
    if n < 2:
        out["skipped"] = "needs two GPUs"
        print("needs two GPUs: nothing measured", flush=True)
        return write_report(out)
    out["peer_access"] = {"0->1": bool(cupy.cuda.runtime.deviceCanAccessPeer(0, 1)),
                          "1->0": bool(cupy.cuda.runtime.deviceCanAccessPeer(1, 0))}
    with cupy.cuda.Device(0):
        kernels = {0: Kernels(cupy)}  # the long kernels of bench streams (cupy_memstrat.bench.streams)
    out["spin_cycles"] = int(kernels[0].cycles)
    prev = cupy.cuda.memory.get_allocator()
    keep = _allocators()
    rows = {}
    try:
        for name, (malloc, _obj) in keep.items():
            cupy.cuda.set_allocator(malloc)
            row = {}
            for how in ("copy_from_device_async", "cupy.array"):
                for sync in (False, True):
                    key = f"{how}{', device 0 synchronised first' if sync else ''}"
                    try:
                        row[key] = _copies_read_unfinished(kernels, how, sync)
                    except Exception as exc:  # noqa: BLE001 - recorded: a kind of memory CUDA refuses
                        row[key] = f"{type(exc).__name__}: {exc}"
            rows[name] = row
            print(f"{name:<28} {row}", flush=True)
        out["copies_reading_unfinished_data"] = rows
        # what the event costs: device 0 in use, pairs on device 1; interleaved rounds
        cost = {"async": [], "async+event-at-allocation": []}
        for name in ("async", "async+event-at-allocation"):
            cupy.cuda.set_allocator(keep[name][0])
            with cupy.cuda.Device(0):
                anchor = cupy.empty(1, cupy.float32)  # the wrapper has allocated on device 0
            keep[name] = keep[name] + (anchor,)
        for r in range(5):
            for name in (list(cost) if r % 2 == 0 else list(cost)[::-1]):
                cost[name].append(_pair_us(keep[name][0], rounds=1))
        out["pair_us_on_device_1"] = {k: {"median": statistics.median(v), "samples": v} for k, v in cost.items()}
        out["event_cost_ratio"] = (out["pair_us_on_device_1"]["async+event-at-allocation"]["median"]
                                   / out["pair_us_on_device_1"]["async"]["median"])
        print("pair us on device 1:", {k: round(v["median"], 2) for k, v in out["pair_us_on_device_1"].items()},
              f"ratio {out['event_cost_ratio']:.2f}", flush=True)
        out["waits_recorded"] = keep["async+event-at-allocation"][1][1].n_waits
    finally:
        cupy.cuda.set_allocator(prev)
    write_report(out)


if __name__ == "__main__":
    main()
