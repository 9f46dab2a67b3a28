"""``bench managed``: what helps managed memory, measured side by side in one run.

Parts:

* ``latency``: alloc+free pairs through ``cupy.cuda.alloc`` (512 B, 1 MiB,
  32 MiB; cached) and the small-temporaries workload:
  :func:`cupy_memstrat.bench.alloc.run` restricted to the ``managed``
  strategy, with its ratio to CuPy's default pool, and ``python-floor``: a
  ``PythonFunctionAllocator`` over a bare free list with no statistics, the
  least any Python-level allocator costs. Then ``managed`` against CuPy's
  pool back to back (21 adjacent pairs of short measurements per size, the
  order alternating): the median of their ratios is the latency bar.
* ``first_pass``: a 1 GiB float32 array under each policy, its first GPU
  pass (``x *= 2``) timed with what it takes to get the data there, and the
  page faults and bytes moved (driver counters, :mod:`cupy_memstrat.faults`):

  - ``cpu-init/...``: the array is allocated, written on the CPU through a
    NumPy view of the managed memory, then used on the GPU. Scenarios: no
    hints; ``preferred_location="device"``; ``prefetch="on_alloc"``;
    ``prefetch="on_alloc"`` then :func:`cupy_memstrat.prefetch` before the
    pass (timed: move + pass).
  - ``asarray/...``: the data is made on the CPU in a NumPy array and
    copied with ``cupy.asarray`` (timed: copy + pass), under ``managed`` with
    no hints, with ``prefetch="on_alloc"``, and under ``device`` (cudaMalloc).
  - ``resident``: a pass over data already on the device (the pass alone).

  ``pinned_copy`` is the reference bandwidth: a 1 GiB ``cudaMemcpyAsync``
  from pinned host memory.
* ``read_mostly``: the same cpu-init array with ``read_mostly=True``, its
  first and second GPU pass against a resident pass.

Sizes stay at 1 GiB, far below the card's free memory (never oversubscribe
a shared GPU).
"""

from __future__ import annotations

import ctypes
import statistics
import time
import warnings

from . import alloc as _alloc

GiB = 1 << 30
FIRST_PASS_BYTES = GiB


def _host_view(np, ptr: int, nbytes: int):
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=np.float32)


class _Faults:
    """Driver counters around a region, or None where there are none."""

    def __init__(self):
        try:
            from .. import faults

            self.counter = faults.FaultCounter()
            self.counter.start()
            self.source = self.counter.stop().source
            self.error = None
        except Exception as exc:  # noqa: BLE001 - the bench still times without counters
            self.counter, self.source, self.error = None, None, str(exc)

    def start(self):
        if self.counter is not None:
            self.counter.start()

    def stop(self) -> dict | None:
        if self.counter is None:
            return None
        c = self.counter.stop()
        return {k: getattr(c, k) for k in ("gpu_faults", "cpu_faults", "bytes_htod", "bytes_dtoh")}


def _scenarios():
    # label -> (strategy spec or None for cudaMalloc, how the data gets there, prefetch before the pass)
    return {
        "cpu-init/no-hints": ("managed", "cpu", False),
        "cpu-init/preferred_location=device": ("managed:preferred_location=device", "cpu", False),
        "cpu-init/prefetch=on_alloc": ("managed:prefetch=on_alloc", "cpu", False),
        "cpu-init/prefetch=on_alloc+prefetch()": ("managed:prefetch=on_alloc", "cpu", True),
        "asarray/managed": ("managed", "asarray", False),
        "asarray/managed:prefetch=on_alloc": ("managed:prefetch=on_alloc", "asarray", False),
        "asarray/device": ("device", "asarray", False),
        "resident": ("managed:prefetch=on_alloc", "resident", False),
    }


def _one_first_pass(cupy, np, spec: str, how: str, prefetch_first: bool, host, faults) -> dict:
    from ..api import create, prefetch, using

    n = FIRST_PASS_BYTES // 4
    dev = cupy.cuda.Device()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = create(spec)
    try:
        with using(s):
            if how == "asarray":
                dev.synchronize()
                faults.start()
                t0 = time.perf_counter()
                x = cupy.asarray(host)
                x *= 2
                dev.synchronize()
                t = time.perf_counter() - t0
                counts = faults.stop()
            else:
                x = cupy.empty(n, dtype=cupy.float32)
                dev.synchronize()
                if how == "cpu":
                    _host_view(np, x.data.ptr, x.nbytes)[:] = 1.0  # the CPU writes every page
                else:  # resident: make it so, untimed
                    x.fill(1.0)
                    x *= 2
                dev.synchronize()
                faults.start()
                t0 = time.perf_counter()
                if prefetch_first:
                    prefetch(x)
                x *= 2
                dev.synchronize()
                t = time.perf_counter() - t0
                counts = faults.stop()
            ok = bool(float(x[:1].get()[0]) in (2.0, 4.0, 8.0))
            del x
    finally:
        s.close()
    return {"seconds": t, "faults": counts, "ok": ok}


def _pinned_copy(cupy, rounds: int) -> dict:
    rt = cupy.cuda.runtime
    nbytes = FIRST_PASS_BYTES
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    d = rt.malloc(nbytes)  # plain cudaMalloc, no pool
    try:
        ctypes.memset(pinned.ptr, 1, nbytes)
        times = []
        for _ in range(rounds):
            rt.deviceSynchronize()
            t0 = time.perf_counter()
            rt.memcpyAsync(d, pinned.ptr, nbytes, rt.memcpyHostToDevice, 0)
            rt.deviceSynchronize()
            times.append(time.perf_counter() - t0)
    finally:
        rt.free(d)
    t = statistics.median(times)
    return {"seconds": t, "all_seconds": times, "GB_per_s": nbytes / t / 1e9}


def _first_pass(cupy, rounds: int, say) -> dict:
    import numpy as np

    faults = _Faults()
    host = np.ones(FIRST_PASS_BYTES // 4, dtype=np.float32)
    warm = cupy.ones(1024, dtype=cupy.float32)  # compile the kernels before timing
    warm *= 2
    del warm
    scen = _scenarios()
    runs: dict[str, list] = {k: [] for k in scen}
    for r in range(rounds):
        for label, (spec, how, pf) in scen.items():
            say(f"first pass round {r + 1}/{rounds}  {label}")
            runs[label].append(_one_first_pass(cupy, np, spec, how, pf, host, faults))
    say("pinned copy reference")
    pinned = _pinned_copy(cupy, max(rounds, 3))
    out = {}
    for label, rs in runs.items():
        t = statistics.median(r["seconds"] for r in rs)
        row = {
            "median_ms": t * 1e3,
            "all_ms": [r["seconds"] * 1e3 for r in rs],
            "GB_per_s": FIRST_PASS_BYTES / t / 1e9,
            "fraction_of_pinned_copy": pinned["seconds"] / t,
            "results_ok": all(r["ok"] for r in rs),
        }
        counts = [r["faults"] for r in rs if r["faults"] is not None]
        if counts:
            row["faults_median"] = {k: statistics.median(c[k] for c in counts) for k in counts[0]}
        out[label] = row
    base = out["cpu-init/no-hints"]
    for row in out.values():
        row["speedup_vs_no_hints"] = base["median_ms"] / row["median_ms"]
        if "faults_median" in row and base.get("faults_median", {}).get("gpu_faults"):
            row["gpu_faults_vs_no_hints"] = row["faults_median"]["gpu_faults"] / base["faults_median"]["gpu_faults"]
    return {
        "bytes": FIRST_PASS_BYTES,
        "kernel": "x *= 2 (float32, read + write)",
        "fault_counters": faults.source or f"unavailable: {faults.error}",
        "pinned_copy": pinned,
        "results": out,
    }


def _read_mostly(cupy, say) -> dict:
    import numpy as np

    from ..api import create, using

    n = FIRST_PASS_BYTES // 4
    dev = cupy.cuda.Device()
    out = {}
    for label, spec in (("read_mostly", "managed:read_mostly=True"), ("no-hints", "managed")):
        say(f"read-mostly: {label}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = create(spec)
        try:
            with using(s):
                x = cupy.empty(n, dtype=cupy.float32)
                dev.synchronize()
                _host_view(np, x.data.ptr, x.nbytes)[:] = 1.0
                passes = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    x *= 2
                    dev.synchronize()
                    passes.append((time.perf_counter() - t0) * 1e3)
                del x
        finally:
            s.close()
        out[label] = {"pass_ms": passes}
    rm, nh = out["read_mostly"]["pass_ms"], out["no-hints"]["pass_ms"]
    out["second_pass_ratio"] = rm[1] / nh[1]  # read-mostly's 2nd pass / a resident pass
    return out


def run(*, rounds: int = 3, target_s: float = 0.03, progress=None) -> dict:
    """Run every part; return the report (latency in microseconds, passes in ms).

    Raises:
        NoDeviceError, CuPyNotInstalledError: nothing to measure on.
    """
    from ..api import create

    with _alloc.gpu_session(progress) as (cupy, say, prev):
        floor, release_floor = _alloc.python_floor_allocator(cupy)
        extra = [("python-floor", lambda: cupy.cuda.set_allocator(floor.malloc))]
        lat = _alloc.run(
            rounds=max(rounds, 5), target_s=target_s, progress=say, strategies=["managed"], extra_paths=extra
        )
        lat["managed_vs_cupy_pool_paired"] = _alloc.paired_ratios(
            cupy, ("managed", create("managed").cupy_allocator()),
            ("cupy-default", cupy.get_default_memory_pool().malloc), say, target_s / 3)
        cupy.cuda.set_allocator(prev)
        release_floor()
        first = _first_pass(cupy, rounds, say)
        rm = _read_mostly(cupy, say)
    res = first["results"]
    best = res["cpu-init/prefetch=on_alloc+prefetch()"]
    bars = {
        # back to back (the median of 21 adjacent pairs' ratios): the medians of the rounds, which
        # visit seven paths in turn, drift with the host by more than the strategy's share
        "latency_managed_over_cupy_pool": {
            k: v["median_ratio"] for k, v in lat["managed_vs_cupy_pool_paired"].items()},
        "latency_managed_over_cupy_pool_rounds": lat["ratio_to_cupy_default"]["managed"],
        "first_pass_speedup": best["speedup_vs_no_hints"],
        "first_pass_fraction_of_pinned_copy": best["fraction_of_pinned_copy"],
        "first_pass_gpu_faults_vs_no_hints": best.get("gpu_faults_vs_no_hints"),
    }
    return _alloc.report_on_latency("managed", lat, {"rounds": rounds, "first_pass_bytes": FIRST_PASS_BYTES},
                                    first_pass=first, read_mostly=rm, bars=bars)


def format_table(report: dict) -> str:
    from ..sizes import format_size

    out = [_alloc.format_table(report["latency"]), ""]
    fp = report["first_pass"]
    out.append(
        f"first GPU pass over {format_size(fp['bytes'])} ({fp['kernel']}); fault counters: {fp['fault_counters']}; "
        f"pinned copy {fp['pinned_copy']['GB_per_s']:.1f} GB/s"
    )
    out.append(f"  {'scenario':<40}{'ms':>9}{'GB/s':>8}{'x pinned':>9}{'speedup':>9}{'GPU faults':>12}{'HtoD':>11}")
    for label, row in fp["results"].items():
        f = row.get("faults_median") or {}
        gf = f"{f['gpu_faults']:.0f}" if f else "-"
        htod = format_size(int(f["bytes_htod"])) if f else "-"
        out.append(
            f"  {label:<40}{row['median_ms']:>9.1f}{row['GB_per_s']:>8.1f}{row['fraction_of_pinned_copy']:>9.2f}"
            f"{row['speedup_vs_no_hints']:>8.1f}x{gf:>12}{htod:>11}"
        )
    rm = report["read_mostly"]
    out.append("")
    out.append(
        "read_mostly=True, GPU passes writing the CPU-initialised array (ms): "
        + ", ".join(f"{t:.1f}" for t in rm["read_mostly"]["pass_ms"])
        + "; without advice: "
        + ", ".join(f"{t:.1f}" for t in rm["no-hints"]["pass_ms"])
        + f"; second pass {rm['second_pass_ratio']:.0f}x slower"
    )
    b = report["bars"]
    out.append("")
    out.append(
        "bars: "
        + "managed / CuPy pool latency, back to back "
        + ", ".join(f"{format_size(int(k)) if k.isdigit() else k} {v:.2f}x"
                    for k, v in b["latency_managed_over_cupy_pool"].items())
        + (" (medians of the rounds: "
           + ", ".join(f"{format_size(int(k)) if k.isdigit() else k} {v:.2f}x"
                       for k, v in b["latency_managed_over_cupy_pool_rounds"].items()) + ")"
           if "latency_managed_over_cupy_pool_rounds" in b else "")
        + "; "
        + f"prefetched first pass {b['first_pass_speedup']:.1f}x faster than no hints, "
        f"{b['first_pass_fraction_of_pinned_copy']:.2f}x of the pinned copy"
        + (
            f", GPU faults {100 * b['first_pass_gpu_faults_vs_no_hints']:.2f}% of no hints"
            if b["first_pass_gpu_faults_vs_no_hints"] is not None
            else ""
        )
    )
    return "\n".join(out)


def progress_printer(stream=None):
    return _alloc.progress_printer(stream, "managed")
