"""``bench async``: the ``async`` strategy against CuPy's ``MemoryAsyncPool``,
RMM's ``CudaAsyncMemoryResource`` and plain cudaMalloc, side by side in one run.

Parts:

* ``latency``: alloc+free pairs through ``cupy.cuda.alloc`` (512 B, 1 MiB,
  32 MiB) and the small-temporaries workload: :func:`cupy_memstrat.bench.alloc.run`
  restricted to the ``async`` strategy, with ratios to ``cupy-async`` and
  ``rmm-async`` added.
* ``raw_cuda_floor_us``: ``cudaMallocFromPoolAsync`` + ``cudaFreeAsync``
  pairs called directly on a new pool and on the device's default pool.
* ``sync_loop``: a 64 MiB alloc / free / stream-synchronize loop under the
  ``async`` strategy at its default release threshold (keep) and at
  threshold 0, CuPy's ``MemoryAsyncPool``, RMM's ``CudaAsyncMemoryResource``
  (default options) and no pool; interleaved rounds, medians.
* ``growth``: device memory a fresh own pool reserves for one allocation of
  each size (the 32 MiB steps).
* ``trim``: reserved bytes of a pool that held 8 x 64 MiB, after
  synchronisation, after ``trim(keep_bytes=128MiB)`` and after ``trim()``.
* ``max_size``: the largest single allocation a pool with each ``max_size``
  grants (searched in 1 MiB steps).
"""

from __future__ import annotations

import time

from . import alloc as _alloc

MiB = 1 << 20
LOOP_BYTES = 64 * MiB
GROWTH_SIZES = (1, MiB, 32 * MiB - 1, 32 * MiB, 32 * MiB + 1, 40 * MiB + 7, 100_000_000, 1 << 30)
MAX_SIZES = (MiB, 33 * MiB, 100_000_000)


def _time_raw(rt, pool: int, size: int, n: int) -> float:
    malloc, free = rt.mallocFromPoolAsync, rt.freeAsync
    t0 = time.perf_counter()
    for _ in range(n):
        free(malloc(size, pool, 0), 0)
    return (time.perf_counter() - t0) / n


def _raw_floor(cupy, rounds: int, target_s: float, say) -> dict:
    """cudaMallocFromPoolAsync + cudaFreeAsync called directly (CuPy's Cython
    wrappers, no allocator in between) on a new pool and on the device's
    default pool: what CUDA itself costs."""
    from ..api import create

    rt = cupy.cuda.runtime
    s = create("async", cache=0)
    s.raw_free(s.raw_malloc(1))
    pools = {"own-pool": s.pool_stats().handle, "default-pool": rt.deviceGetDefaultMemPool(cupy.cuda.Device().id)}
    times = {label: {size: [] for size in _alloc.SIZES} for label in pools}
    iters = {}
    for r in range(rounds):
        say(f"raw CUDA floor round {r + 1}/{rounds}")
        for label, pool in pools.items():
            for size in _alloc.SIZES:
                key = f"{label}/{size}"
                if key not in iters:
                    iters[key] = _alloc._calibrate(lambda n: _time_raw(rt, pool, size, n), target_s)
                times[label][size].append(_time_raw(rt, pool, size, iters[key]) * 1e6)
    cupy.cuda.Device().synchronize()
    s.close()
    return {label: {str(k): _alloc._summary(v) for k, v in row.items()} for label, row in times.items()}


def _python_pool_floor(cupy):
    """A ``PythonFunctionAllocator`` whose functions only call
    ``cudaMallocFromPoolAsync`` / ``cudaFreeAsync`` on the legacy default
    stream (the device's default pool, no statistics, no stream tracking):
    the least any allocator CuPy calls through Python functions can cost."""
    rt = cupy.cuda.runtime
    pool = rt.deviceGetDefaultMemPool(cupy.cuda.Device().id)
    malloc_async, free_async = rt.mallocFromPoolAsync, rt.freeAsync

    def malloc(size, device):
        return malloc_async(size, pool, 0)

    def free(ptr, device):
        free_async(ptr, 0)

    return cupy.cuda.PythonFunctionAllocator(malloc, free)


def _loop_paths(cupy):
    from ..api import create

    cuda = cupy.cuda
    keep = create("async")
    zero = create("async", release_threshold=0)
    paths = [
        ("async", keep, lambda m=keep.cupy_allocator(): cuda.set_allocator(m)),
        ("async:release_threshold=0", zero, lambda m=zero.cupy_allocator(): cuda.set_allocator(m)),
        ("no-pool", None, lambda: cuda.set_allocator(None)),
    ]
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator

        mr = rmm.mr.CudaAsyncMemoryResource()

        def rmm_async():
            rmm.mr.set_current_device_resource(mr)
            cuda.set_allocator(rmm_cupy_allocator)

        paths.append(("rmm-async", None, rmm_async))
    except ImportError:
        pass
    pool = cuda.MemoryAsyncPool()  # last: it changes the device's current pool
    paths.append(("cupy-async", None, lambda: cuda.set_allocator(pool.malloc)))
    return paths


def _time_sync_loop(cupy, n: int) -> float:
    alloc = cupy.cuda.alloc
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        m = alloc(LOOP_BYTES)
        del m
        stream.synchronize()
    return (time.perf_counter() - t0) / n


def _sync_loop(cupy, rounds: int, target_s: float, say) -> dict:
    paths = _loop_paths(cupy)
    times = {label: [] for label, _, _ in paths}
    iters = {}
    for r in range(rounds):
        for label, _, activate in paths:
            say(f"sync loop round {r + 1}/{rounds}  {label}")
            activate()
            if label not in iters:
                iters[label] = _alloc._calibrate(lambda n: _time_sync_loop(cupy, n), target_s)
            times[label].append(_time_sync_loop(cupy, iters[label]) * 1e6)
    out = {label: _alloc._summary(xs) for label, xs in times.items()}
    for label, strat, _ in paths:
        if strat is not None:
            out[label]["reserved_after_bytes"] = strat.pool_stats().reserved_bytes
            strat.trim()
    return {"results_us": out, "iterations": iters}


def _growth(cupy) -> list[dict]:
    from ..api import create

    rows = []
    for size in GROWTH_SIZES:
        s = create("async", cache=0)
        p = s.raw_malloc(size)
        rows.append({"size": size, "reserved_bytes": s.pool_stats().reserved_bytes})
        s.raw_free(p)
        s.close()
    return rows


def _trim(cupy) -> dict:
    from ..api import create

    s = create("async", cache=0)
    ptrs = [s.raw_malloc(64 * MiB) for _ in range(8)]
    for p in ptrs:
        s.raw_free(p)
    cupy.cuda.Device().synchronize()
    out = {"allocated_then_freed_bytes": 8 * 64 * MiB, "reserved_after_sync": s.pool_stats().reserved_bytes}
    t0 = time.perf_counter()
    out["released_by_trim_keep_128MiB"] = s.trim(keep_bytes=128 * MiB)
    out["trim_seconds"] = time.perf_counter() - t0
    out["reserved_after_trim_keep_128MiB"] = s.pool_stats().reserved_bytes
    out["released_by_trim_0"] = s.trim()
    out["reserved_after_trim_0"] = s.pool_stats().reserved_bytes
    s.close()
    return out


def _max_size(cupy) -> list[dict]:
    from ..api import create
    from ..errors import out_of_memory_class

    oom = out_of_memory_class()
    rows = []
    for limit in MAX_SIZES:
        s = create("async", max_size=limit, cache=0)
        lo, hi = 0, 256  # MiB: lo granted, hi refused
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                s.raw_free(s.raw_malloc(mid * MiB))
                lo = mid
            except oom:
                hi = mid
            s.trim()
        rows.append({"max_size": limit, "largest_granted_MiB": lo, "smallest_refused_MiB": hi})
        s.close()
    return rows


def run(*, rounds: int = 7, target_s: float = 0.03, progress=None) -> dict:
    """Run every part; return the report (times in microseconds).

    Raises:
        NoDeviceError, CuPyNotInstalledError: nothing to measure on.
    """
    from ..api import create

    with _alloc.gpu_session(progress) as (cupy, say, prev):
        no_cache = create("async", cache=0)  # every allocation a cudaMallocFromPoolAsync
        floor = _python_pool_floor(cupy)
        extra = [("async:cache=0", lambda m=no_cache.cupy_allocator(): cupy.cuda.set_allocator(m)),
                 ("python-pool-floor", lambda: cupy.cuda.set_allocator(floor.malloc))]
        lat = _alloc.run(rounds=rounds, target_s=target_s, progress=say, strategies=["async"], extra_paths=extra)
        res = lat["results_us"]
        lat["ratios"] = {
            f"{mine}/{other}": {k: res[mine][k]["median_us"] / res[other][k]["median_us"] for k in res[mine]}
            for mine, others in (("async", ("cupy-async", "rmm-async", "no-pool")),
                                 ("async:cache=0", ("python-pool-floor", "cupy-async")))
            for other in others
            if other in res
        }
        cupy.cuda.set_allocator(prev)
        no_cache.close()
        raw = _raw_floor(cupy, rounds, target_s, say)
        own = raw["own-pool"]
        lat["ratios"]["async:cache=0/raw-floor"] = {
            k: res["async:cache=0"][k]["median_us"] / own[k]["median_us"] for k in own if k in res["async:cache=0"]
        }
        loop = _sync_loop(cupy, rounds, target_s * 3, say)
        lr = loop["results_us"]
        loop["threshold_0_over_default"] = (
            lr["async:release_threshold=0"]["median_us"] / lr["async"]["median_us"]
        )
        cupy.cuda.set_allocator(prev)
        say("pool growth steps")
        growth = _growth(cupy)
        say("trim")
        trim = _trim(cupy)
        say("max_size granularity")
        max_size = _max_size(cupy)
    return _alloc.report_on_latency("async", lat, {"rounds": rounds, "loop_bytes": LOOP_BYTES},
                                    raw_cuda_floor_us=raw, sync_loop=loop, growth=growth, trim=trim,
                                    max_size=max_size)


def format_table(report: dict) -> str:
    from ..sizes import format_size

    lat = report["latency"]
    out = [_alloc.format_table(lat)]
    for key, row in lat["ratios"].items():
        out.append(f"{key}: " + ", ".join(
            f"{format_size(int(k)) if k.isdigit() else k} {v:.3f}x" for k, v in row.items()))
    out.append("raw cudaMallocFromPoolAsync + cudaFreeAsync, no allocator (median us): " + "; ".join(
        f"{label} " + ", ".join(f"{format_size(int(k))} {v['median_us']:.2f}" for k, v in row.items())
        for label, row in report["raw_cuda_floor_us"].items()
    ))
    out.append("")
    out.append(f"{format_size(LOOP_BYTES)} alloc / free / synchronize loop (median us per iteration)")
    for label, row in report["sync_loop"]["results_us"].items():
        extra = f"  reserved after: {format_size(row['reserved_after_bytes'])}" if "reserved_after_bytes" in row else ""
        out.append(f"  {label:<28}{row['median_us']:>10.2f}{extra}")
    out.append(f"  threshold 0 / default: {report['sync_loop']['threshold_0_over_default']:.1f}x slower")
    out.append("")
    out.append("pool growth (fresh own pool, one allocation): " + ", ".join(
        f"{format_size(r['size'])} -> {format_size(r['reserved_bytes'])}" for r in report["growth"]
    ))
    t = report["trim"]
    out.append(
        f"trim: {format_size(t['reserved_after_sync'])} reserved after freeing 8 x 64 MiB; "
        f"trim(keep_bytes=128MiB) -> {format_size(t['reserved_after_trim_keep_128MiB'])}; "
        f"trim() -> {format_size(t['reserved_after_trim_0'])}"
    )
    out.append("max_size: " + ", ".join(
        f"{format_size(r['max_size'])} grants up to {r['largest_granted_MiB']} MiB" for r in report["max_size"]
    ))
    return "\n".join(out)


def progress_printer(stream=None):
    return _alloc.progress_printer(stream, "async")
