"""``bench alloc``: allocator latency and a small-temporaries workload, every path side by side.

Every path is measured through ``cupy.cuda.alloc`` (CuPy's dispatch included),
in interleaved rounds so that clock drift touches all paths alike; each
figure is the median over rounds. Ratios are taken against CuPy's default
``MemoryPool`` measured in the same run.

Paths: CuPy's default pool (``cupy-default``), no pool (``no-pool``:
``set_allocator(None)``, raw cudaMalloc/cudaFree), every registered
strategy whose library is installed (``rmm`` over the ``rmm-async`` path's
resource), ``device`` with ``track_origins=True``, RMM's
``rmm_cupy_allocator`` over ``CudaAsyncMemoryResource`` (``rmm-async``) when
``rmm`` is importable, a bare allocator over PyTorch's caching allocator
(``torch-bare``) beside the ``torch`` strategy, and CuPy's
``MemoryAsyncPool`` (``cupy-async``).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

from ..sizes import format_size

SIZES = (512, 1 << 20, 32 << 20)
WORKLOAD = "temporaries"
N_TEMPS = 30
WORKLOAD_ELEMS = 4096
PAIRED_ROUNDS = 21  # adjacent device / no-pool measurements per size


@contextlib.contextmanager
def gpu_session(progress=None):
    """A benchmark's frame: a real GPU or :class:`~cupy_memstrat.NoDeviceError`
    (:func:`require_real_gpu`), then ``(cupy, say, prev)``: CuPy, the progress
    callback (or one that says nothing) and CuPy's allocator before, which is
    put back at the end, also on an error."""
    require_real_gpu()
    import cupy

    prev = cupy.cuda.get_allocator()
    try:
        yield cupy, progress or (lambda msg: None), prev
    finally:
        cupy.cuda.set_allocator(prev)


def require_real_gpu():
    """The real CUDA backend, or a clear MemstratError: benchmarks time real
    kernels and CUDA calls, which a fake backend (``CUPY_MEMSTRAT_BACKEND=fake``)
    does not have."""
    from ..backends import RealBackend, get_backend
    from ..errors import NoDeviceError

    try:
        backend = get_backend()
    except ValueError as exc:  # a bad CUPY_MEMSTRAT_BACKEND
        raise NoDeviceError(str(exc)) from None
    if not isinstance(backend, RealBackend):
        raise NoDeviceError(
            f"benchmarks time a real GPU, and this process runs on the {backend.name} backend "
            "(CUPY_MEMSTRAT_BACKEND is set): unset it on a machine with a GPU"
        )
    return backend


def python_floor_allocator(cupy):
    """A ``PythonFunctionAllocator`` over the least a Python allocator can do:
    a free list per 512-byte size and a pointer -> size dict, no statistics
    (the baseline docs/benchmarks.md measures). Blocks come from ``cudaMalloc``. The
    floor under which no Python-level strategy can go."""
    rt = cupy.cuda.runtime
    free_lists: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}

    def malloc(size, device):
        key = (size + 511) & -512
        try:
            ptr = free_lists[key].pop()
        except (KeyError, IndexError):
            free_lists.setdefault(key, [])
            ptr = rt.malloc(key)
        sizes[ptr] = key
        return ptr

    def free(ptr, device):
        free_lists[sizes.pop(ptr)].append(ptr)

    pfa = cupy.cuda.PythonFunctionAllocator(malloc, free)

    def release():
        for lst in free_lists.values():
            for ptr in lst:
                rt.free(ptr)

    return pfa, release


def _paths(cupy, strategies: list[str], extra=()):
    """(label, activate) pairs; ``activate()`` installs the path as CuPy's allocator."""
    from ..api import create

    cuda = cupy.cuda
    default_pool = cupy.get_default_memory_pool()
    paths = [
        ("cupy-default", lambda: cuda.set_allocator(default_pool.malloc)),
        ("no-pool", lambda: cuda.set_allocator(None)),
    ]
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError:
        rmm = None
    rmm_mr = rmm.mr.CudaAsyncMemoryResource() if rmm is not None else None
    for name in strategies:
        if name == "rmm" and rmm_mr is not None:
            s = create(name, resource=rmm_mr)  # the resource of the rmm-async path: our share alone
        else:
            s = create(name)
        paths.append((name, lambda m=s.cupy_allocator(): cuda.set_allocator(m)))
    if "pool" in strategies:  # route="wrap" beside the default route ("direct"), measured in the same rounds
        s = create("pool", route="wrap")
        paths.append(("pool-wrap", lambda m=s.cupy_allocator(): cuda.set_allocator(m)))
    if "device" in strategies:
        s = create("device", track_origins=True)
        paths.append(("device+origins", lambda m=s.cupy_allocator(): cuda.set_allocator(m)))
    paths.extend(extra)
    if rmm is not None:
        def rmm_async():
            rmm.mr.set_current_device_resource(rmm_mr)
            cuda.set_allocator(rmm_cupy_allocator)

        paths.append(("rmm-async", rmm_async))
    if "torch" in strategies:
        paths.append(("torch-bare", _torch_bare_allocator(cupy)))
    # Created last: its constructor changes every device's current memory pool
    # (cudaDeviceSetMemPool), which no path above depends on.
    async_pool = cuda.MemoryAsyncPool()
    paths.append(("cupy-async", lambda: cuda.set_allocator(async_pool.malloc)))
    return paths


def _torch_bare_allocator(cupy):
    """``activate()`` of a ``PythonFunctionAllocator`` whose functions only
    call PyTorch's ``caching_allocator_alloc`` / ``caching_allocator_delete``
    on CuPy's current stream: the least any CuPy allocator over PyTorch's
    pool costs, beside which the ``torch`` strategy's share shows."""
    import torch

    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    stream = cupy.cuda.get_current_stream

    def malloc(size, device):
        return alloc(size, device, stream().ptr)

    def free(ptr, device):
        delete(ptr)

    pfa = cupy.cuda.PythonFunctionAllocator(malloc, free)
    return lambda: cupy.cuda.set_allocator(pfa.malloc)


def _usable(names: list[str], say) -> list[str]:
    """The names whose strategy can be made here; the others are said and
    left out: a library not installed, or one that refuses at creation
    (PyTorch without CUDA: ``MemstratError``)."""
    from ..api import create
    from ..errors import MemstratError
    from ..registry import get_registry

    reg, out = get_registry(), []
    for name in names:
        why = reg.get(name).unavailable()
        if why is None and reg.get(name).requires:
            try:
                create(name).close()
            except MemstratError as exc:
                why = str(exc)
        if why:
            say(f"skipping {name}: {why}")
        else:
            out.append(name)
    return out


def _time_pairs(cupy, size: int, n: int) -> float:
    alloc = cupy.cuda.alloc
    t0 = time.perf_counter()
    for _ in range(n):
        alloc(size)  # the MemoryPointer dies at once: one alloc + one free
    t1 = time.perf_counter()
    cupy.cuda.Device().synchronize()
    return (t1 - t0) / n


def _make_workload(cupy):
    x = cupy.ones(WORKLOAD_ELEMS, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()

    def step():
        y = x
        for _ in range(N_TEMPS):
            y = y + 1.0  # one temporary, one kernel
        stream.synchronize()
        return y

    def check(y):
        if not bool((y == 1.0 + N_TEMPS).all()):
            raise AssertionError("workload result differs: the allocator corrupted data")

    return step, check


def _time_workload(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def _calibrate(fn, target_s: float) -> int:
    """Iterations that take about ``target_s`` seconds. The first call is a
    warm-up and not counted: it can include one-off costs (an allocator's
    first use creates its pool), which made an earlier run time 21 pairs."""
    fn(8)
    n = 8
    while True:
        t = fn(n) * n
        if t >= target_s / 4 or n >= 1 << 20:
            return max(8, min(1 << 20, int(n * target_s / max(t, 1e-9))))
        n *= 4


def run(*, rounds: int = 7, target_s: float = 0.03, progress=None, strategies=None, extra_paths=()) -> dict:
    """Run the benchmark; return the results dict (times in microseconds).

    ``strategies``: registered names to measure (default: all);
    ``extra_paths``: more ``(label, activate)`` pairs, measured alongside.

    Raises:
        NoDeviceError, CuPyNotInstalledError: nothing to measure on.
    """
    from ..info import collect
    from ..registry import get_registry

    require_real_gpu()  # fail fast and clearly without a GPU
    import cupy

    say = progress or (lambda msg: None)
    names = list(strategies) if strategies is not None else _usable(get_registry().names(), say)
    prev = cupy.cuda.get_allocator()
    paths = _paths(cupy, names, extra_paths)
    labels = [p[0] for p in paths]
    lat = {lab: {s: [] for s in SIZES} for lab in labels}
    work = {lab: [] for lab in labels}
    iters: dict = {}
    try:
        for r in range(rounds):
            for i, (label, activate) in enumerate(paths):
                say(f"round {r + 1}/{rounds}  path {i + 1}/{len(paths)}  {label}")
                activate()
                for size in SIZES:
                    key = (label, size)
                    if key not in iters:
                        iters[key] = _calibrate(lambda n: _time_pairs(cupy, size, n), target_s)
                    lat[label][size].append(_time_pairs(cupy, size, iters[key]) * 1e6)
                step, check = _make_workload(cupy)
                check(step())
                key = (label, WORKLOAD)
                if key not in iters:
                    iters[key] = _calibrate(lambda n: _time_workload(step, n), target_s * 3)
                work[label].append(_time_workload(step, iters[key]) * 1e6)
                step = check = None  # the workload's arrays go now
    finally:
        try:
            cupy.cuda.set_allocator(prev)
        except Exception:  # noqa: BLE001
            cupy.cuda.set_allocator()

    results = {}
    for label in labels:
        row = {str(s): _summary(lat[label][s]) for s in SIZES}
        row[WORKLOAD] = _summary(work[label])
        results[label] = row
    base = results["cupy-default"]
    ratios = {
        label: {k: row[k]["median_us"] / base[k]["median_us"] for k in row} for label, row in results.items()
    }
    report = {
        "benchmark": "alloc",
        "machine": collect(),
        "params": {
            "rounds": rounds,
            "target_seconds_per_measurement": target_s,
            "sizes": list(SIZES),
            "workload": f"{N_TEMPS} x (float32[{WORKLOAD_ELEMS}] + 1.0), then stream synchronize",
            "iterations": {f"{k[0]}/{k[1]}": v for k, v in iters.items()},
        },
        "results_us": results,
        "ratio_to_cupy_default": ratios,
    }
    if "device" in results:
        report["device_vs_no_pool"] = {
            k: results["device"][k]["median_us"] / results["no-pool"][k]["median_us"] for k in base
        }
        report["device_vs_no_pool_paired"] = _paired_device_vs_no_pool(cupy, say, target_s / 3)
    return report


def _paired_device_vs_no_pool(cupy, say, target_s: float, pairs: int = PAIRED_ROUNDS) -> dict:
    """``device`` against raw ``cudaMalloc`` (``no-pool``), measured back to
    back (:func:`paired_ratios`). ``cudaMalloc``'s own time drifts between
    rounds by more than the strategy's share (docs/benchmarks.md), which the
    medians of the main table, taken over rounds that visit every path in
    turn, do not cancel."""
    from ..api import create

    return paired_ratios(cupy, ("device", create("device").cupy_allocator()), ("no-pool", None), say, target_s, pairs)


def report_on_latency(benchmark: str, lat: dict, params: dict, **parts) -> dict:
    """The JSON report of a bench group built on :func:`run`: its name, the machine (moved out of
    ``lat``, :func:`run`'s report), ``params``, the latency report as ``"latency"``, then ``parts``
    in the order given."""
    return {"benchmark": benchmark, "machine": lat.pop("machine"), "params": params, "latency": lat, **parts}


def paired_ratios(cupy, path, reference, say, target_s: float, pairs: int = PAIRED_ROUNDS) -> dict:
    """One path's alloc+free time against a reference path's, measured back
    to back: per size, ``pairs`` times one short measurement of each
    (about ``target_s`` seconds), adjacent, the order alternating; the ratio
    of each adjacent pair, then the median of those ratios with their
    quartiles. ``path`` and ``reference`` are ``(label, allocator)``, the
    allocator as given to ``cupy.cuda.set_allocator`` (``None``: no pool).
    Returns ``{str(size): {"median_ratio", "q1", "q3", "pairs", "iterations"}}``."""
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 2:
        raise ValueError(f"pairs: expected an int >= 2 (quartiles need two ratios), got {pairs!r}")
    if not target_s > 0:  # NaN fails too
        raise ValueError(f"target_s: expected seconds > 0, got {target_s!r}")
    (label, alloc), (ref_label, ref_alloc) = path, reference
    if label == ref_label:
        raise ValueError(f"path and reference: expected two different labels, got {label!r} twice")
    cuda = cupy.cuda
    prev = cuda.get_allocator()
    out = {}
    try:
        for size in SIZES:
            say(f"{label} vs {ref_label}, paired, {format_size(size)}")
            cuda.set_allocator(ref_alloc)
            n = _calibrate(lambda k: _time_pairs(cupy, size, k), target_s)
            ratios = []
            for i in range(pairs):
                t = {}
                for which in ((ref_label, label) if i % 2 == 0 else (label, ref_label)):
                    cuda.set_allocator(alloc if which == label else ref_alloc)
                    t[which] = _time_pairs(cupy, size, n)
                ratios.append(t[label] / t[ref_label])
            q = statistics.quantiles(ratios, n=4)
            out[str(size)] = {"median_ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
                              "pairs": pairs, "iterations": n}
    finally:
        cuda.set_allocator(prev)
    return out


def _summary(xs: list[float]) -> dict:
    return {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs), "runs_us": xs}


def format_table(report: dict) -> str:
    """The report as a fixed-width table of median microseconds and ratios."""
    cols = [str(s) for s in SIZES] + [WORKLOAD]
    heads = [format_size(s) for s in SIZES] + [f"{N_TEMPS} temps"]
    width = max(len(k) for k in report["results_us"]) + 2
    out = [
        "alloc+free through cupy.cuda.alloc (median us, ratio to cupy-default); "
        f"workload: {report['params']['workload']}",
        "".ljust(width) + "".join(h.rjust(20) for h in heads),
    ]
    for label, row in report["results_us"].items():
        ratios = report["ratio_to_cupy_default"][label]
        cells = "".join(f"{row[c]['median_us']:>10.2f} ({ratios[c]:5.2f}x)".rjust(20) for c in cols)
        out.append(label.ljust(width) + cells)
    if "device_vs_no_pool" in report:
        dv = report["device_vs_no_pool"]
        out.append(
            "device / no-pool (the table's medians over rounds): "
            + ", ".join(f"{h} {dv[c]:.3f}x" for h, c in zip(heads, cols))
        )
    if "device_vs_no_pool_paired" in report:
        pv = report["device_vs_no_pool_paired"]
        out.append(
            "device / no-pool, measured back to back (median of paired ratios [quartiles]): "
            + ", ".join(
                f"{format_size(int(c))} {v['median_ratio']:.3f}x [{v['q1']:.3f}-{v['q3']:.3f}]" for c, v in pv.items()
            )
        )
    return "\n".join(out)


def progress_printer(stream=None, name: str = "alloc"):
    """A ``progress`` callable printing ``[bench NAME] msg`` lines to ``stream`` (default: stderr)."""

    def say(msg: str) -> None:
        print(f"[bench {name}] {msg}", file=stream or sys.stderr, flush=True)

    return say
