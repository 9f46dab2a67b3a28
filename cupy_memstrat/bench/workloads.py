"""``bench workloads``: real scientific CuPy programs under CuPy's pool and every strategy.

Each workload is an ordinary array program written against an array module
``xp`` (CuPy on the GPU; NumPy in the tests, which check the numerics on a
machine without one) and a sparse module ``sp`` (``cupyx.scipy.sparse`` /
``scipy.sparse``):

* ``cg-poisson``: a conjugate-gradient solve of the 2-D Poisson problem
  (5-point Laplacian on an n x n grid, a CSR matrix built with ``sp.kron``),
  a fixed number of iterations;
* ``fft-convolution``: a batch of images convolved with a Gaussian through
  ``rfft2`` / ``irfft2``;
* ``kmeans``: Lloyd's iterations on a few million 2-D points;
* ``monte-carlo``: a European call priced over geometric Brownian paths, a
  handful of temporaries per time step;
* ``managed-large``: a reduction over one data set larger than a quarter of
  the device's memory (the others fit easily), filled on the GPU, summed in
  chunks;
* ``multi-stream``: four non-blocking streams, each a pipeline of stages that
  allocate, compute and free on their own stream while the others run: the
  stream-ordered reuse every caching strategy must get right (a block handed
  to another stream too early gives a wrong sum).

Every path (CuPy's default pool, then each strategy, ``managed`` also with
``prefetch="on_new"`` and ``prefetch="on_alloc"``) runs each workload once to
warm up (kernels compile, caches fill); then ``rounds`` rounds time every path
once each, side by side, in an order rotated each round (see :func:`measure`:
a short program is repeated within a sample). ``managed-large`` is measured
cold: every sample starts with the path's cache given back, as a program
allocating one big data set does. The report has the median seconds per run,
the ratio to CuPy's pool, peak bytes in use and reserved (for strategies,
from their statistics), the page faults per run (from the last sample) where
counters exist, and whether the result equals the one under CuPy's pool (bit for bit,
or the largest relative difference).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

from ..sizes import format_size

__all__ = ["WORKLOADS", "CONTROL", "run", "check_args", "default_specs", "format_table"]


# -- the programs ------------------------------------------------------------------------------


def cg_poisson(xp, sp, n: int = 1024, iters: int = 200):
    """``iters`` CG iterations on A x = b, A the 2-D 5-point Laplacian on an
    ``n`` x ``n`` grid (n**2 unknowns), b = 1. Returns x (float64, n**2)."""
    one_d = sp.diags([-xp.ones(n - 1), 2 * xp.ones(n), -xp.ones(n - 1)], [-1, 0, 1], format="csr")
    eye = sp.identity(n, format="csr")
    a = (sp.kron(eye, one_d) + sp.kron(one_d, eye)).tocsr()
    b = xp.ones(n * n)
    x = xp.zeros(n * n)
    r = b - a @ x
    p = r.copy()
    rr = r @ r
    for _ in range(iters):
        ap = a @ p
        alpha = rr / (p @ ap)
        x += alpha * p
        r -= alpha * ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x


def fft_convolution(xp, sp=None, batch: int = 64, size: int = 512, sigma: float = 3.0):
    """A ``batch`` x ``size`` x ``size`` float32 image stack (seeded) convolved
    (circularly) with a Gaussian of ``sigma`` pixels through rfft2 / irfft2."""
    rng = xp.random.RandomState(1)
    images = rng.standard_normal((batch, size, size)).astype(xp.float32)
    k = xp.arange(size, dtype=xp.float32)
    k = xp.minimum(k, size - k)
    g1 = xp.exp(-0.5 * (k / sigma) ** 2)
    kernel = g1[:, None] * g1[None, :]
    kernel /= kernel.sum()
    spec = xp.fft.rfft2(images, axes=(-2, -1)) * xp.fft.rfft2(kernel)
    return xp.fft.irfft2(spec, s=(size, size), axes=(-2, -1)).astype(xp.float32)


def kmeans(xp, sp=None, n: int = 2_000_000, k: int = 16, iters: int = 20):
    """Lloyd's k-means on ``n`` seeded 2-D points around ``k`` centres; returns
    the final centres (k x 2, float32)."""
    rng = xp.random.RandomState(2)
    true = rng.uniform(-10, 10, size=(k, 2)).astype(xp.float32)
    labels = rng.randint(0, k, size=n)
    pts = true[labels] + rng.standard_normal((n, 2)).astype(xp.float32)
    centres = pts[:k].copy()
    for _ in range(iters):
        d2 = ((pts[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
        nearest = d2.argmin(axis=1)
        counts = xp.bincount(nearest, minlength=k).astype(xp.float32)
        sums = xp.stack([xp.bincount(nearest, weights=pts[:, j], minlength=k) for j in range(2)], axis=1)
        centres = xp.where(counts[:, None] > 0, sums / xp.maximum(counts, 1)[:, None], centres).astype(xp.float32)
    return centres


def monte_carlo(xp, sp=None, paths: int = 1_000_000, steps: int = 64, s0: float = 100.0, strike: float = 105.0,
                rate: float = 0.03, vol: float = 0.2, years: float = 1.0):
    """A European call over ``paths`` geometric Brownian paths of ``steps``
    steps (seeded); returns [price, standard error] (float64)."""
    rng = xp.random.RandomState(3)
    dt = years / steps
    drift, diffusion = (rate - 0.5 * vol * vol) * dt, vol * math.sqrt(dt)
    s = xp.full(paths, s0)
    for _ in range(steps):
        z = rng.standard_normal(paths)
        s = s * xp.exp(drift + diffusion * z)  # a few temporaries per step, on purpose
    payoff = xp.maximum(s - strike, 0.0) * math.exp(-rate * years)
    return xp.stack([payoff.mean(), payoff.std() / math.sqrt(paths)])


def managed_large(xp, sp=None, nbytes: int = 1 << 30, chunk: int = 1 << 28):
    """Fill a float32 array of ``nbytes`` with its index modulo 1024 on the
    device and sum it in chunks of ``chunk`` bytes; returns the sum (float64)."""
    n = nbytes // 4
    x = xp.empty(n, dtype=xp.float32)
    step = chunk // 4
    total = xp.zeros((), dtype=xp.float64)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x[lo:hi] = xp.arange(lo, hi, dtype=xp.int64) % 1024
        total += x[lo:hi].sum(dtype=xp.float64)
    return total


class _HostStream:
    """Stands in for a CUDA stream where ``xp`` has none (NumPy, in the tests)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def synchronize(self):
        return None


def multi_stream(xp, sp=None, streams: int = 4, stages: int = 16, n: int = 1 << 21):
    """``streams`` non-blocking streams (made for each run, as a program
    makes them), each running ``stages`` stages; a stage allocates a float32
    array of ``n`` values on its stream, computes two temporaries from it and
    adds their sum to the stream's running total; every array is freed on
    its stream while the other streams still run. Returns the totals
    (float64, one per stream)."""
    cuda = getattr(xp, "cuda", None)
    made = [cuda.Stream(non_blocking=True) if cuda is not None else _HostStream() for _ in range(streams)]
    totals = []
    for st in made:
        with st:
            totals.append(xp.zeros((), dtype=xp.float64))
    for stage in range(stages):
        for i, st in enumerate(made):
            with st:
                a = xp.arange(n, dtype=xp.float32) * xp.float32(i + 1) + xp.float32(stage)
                b = xp.sqrt(a * a + xp.float32(1.0))
                totals[i] += (b - a).sum(dtype=xp.float64)
                del a, b  # freed on this stream, the others still running
    for st in made:
        st.synchronize()
    return xp.stack(totals)


WORKLOADS = {
    "cg-poisson": (cg_poisson, "CG, 2-D Poisson (5-point Laplacian, CSR), 1024 x 1024 grid, 200 iterations"),
    "fft-convolution": (fft_convolution, "64 images of 512 x 512 convolved with a Gaussian through rfft2"),
    "kmeans": (kmeans, "k-means, 2 000 000 points in 2-D, k = 16, 20 iterations"),
    "monte-carlo": (monte_carlo, "European call, 1 000 000 GBM paths x 64 steps"),
    "managed-large": (managed_large, "fill and sum one float32 array larger than a quarter of the device"),
    "multi-stream": (multi_stream, "4 non-blocking streams, each 16 stages of allocate / compute / free, 8 MiB arrays"),
}


COLD = ("managed-large",)  # measured from nothing cached: a data set that size is allocated once per program


def expected_managed_large(nbytes: int) -> float:
    """The exact value :func:`managed_large` must return."""
    n = nbytes // 4
    full, rest = divmod(n, 1024)
    return float(full * (1023 * 1024 // 2) + rest * (rest - 1) // 2)


# -- measuring ---------------------------------------------------------------------------------


def _compare(ref, got) -> dict:
    """Bit for bit (NaN equal to NaN), else the largest difference relative
    to the reference's largest magnitude (absolute if the reference is all
    zeros; integers compared exactly)."""
    import numpy as np

    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        return {"identical": False, "max_rel_diff": None, "why": f"shape {got.shape} != {ref.shape}"}
    nan_ok = ref.dtype.kind in "fc" and got.dtype.kind in "fc"
    if np.array_equal(ref, got, equal_nan=nan_ok):
        return {"identical": True, "max_rel_diff": 0.0}
    if ref.dtype.kind in "iu" and got.dtype.kind in "iu":
        diff = max(abs(int(a) - int(b)) for a, b in zip(ref.reshape(-1).tolist(), got.reshape(-1).tolist()))
        scale = max(max((abs(int(a)) for a in ref.reshape(-1).tolist()), default=0), 1)
        return {"identical": False, "max_rel_diff": diff / scale}
    diff = float(np.nanmax(np.abs(got.astype(np.complex128) - ref.astype(np.complex128))))
    if np.isnan(got).sum() != np.isnan(ref).sum():
        diff = float("nan")
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    if not scale > 0:
        return {"identical": False, "max_rel_diff": None, "max_abs_diff": diff, "why": "the reference is all zeros"}
    return {"identical": False, "max_rel_diff": diff / scale}


def measure(xp, sp, paths, workloads: dict, *, rounds: int, sync, to_host, say, stats=None, faults=None,
            cold=(), min_sample_s: float = 0.05, clock=time.perf_counter) -> dict:
    """Run ``workloads`` ({name: (fn, kwargs)}) under each of ``paths``
    ([(label, activate, strategy or None, release or None)]), side by side.

    Per workload: each path runs it once to warm up (kernels compile, caches
    fill); then ``rounds`` rounds, each timing every path once, the order
    rotated by one path per round (so drift does not favour one path). A
    timed sample runs the program ``reps`` times back to back and reports
    the time per run: ``reps`` is chosen once per workload, from one run
    under the first path, so that a sample lasts at least ``min_sample_s``
    seconds. A workload named in ``cold`` runs once per sample and starts
    each sample with nothing cached: ``release()`` (give the path's cache
    back) runs after its warm-up and after each sample, so its time includes
    getting the memory from CUDA and the first touch (and its page faults).
    After the rounds every path's cache is released, so that the next
    workload finds the device's memory free.

    ``sync()`` waits for the device; ``to_host(x)`` gives a NumPy copy;
    ``faults``, if given, has ``start()`` / ``stop() -> dict or None``
    (reported per run: the last sample's counts over its runs); ``stats()`` adds CuPy-pool figures
    to rows of paths without a strategy. Returns {workload: {label: row}};
    ``row["seconds"]`` is the median over the rounds of the seconds per run,
    ``row["ratio_to_first"]`` its ratio to the first path's median, and
    ``row["ratio_in_rounds"]`` the median and quartiles of the ratios of the
    path's sample to the first path's sample round by round.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    if not paths:
        raise ValueError("paths: expected at least one (label, activate, strategy, release)")
    labels = [p[0] for p in paths]
    if len(set(labels)) != len(labels):
        raise ValueError(f"paths: each label must be unique, got {labels}")
    if not min_sample_s >= 0:  # NaN fails too
        raise ValueError(f"min_sample_s: expected seconds >= 0, got {min_sample_s!r}")
    out = {}
    for name, (fn, kwargs) in workloads.items():
        is_cold = name in cold
        for label, activate, _strategy, release in paths:
            say(f"{name}  {label}  warm-up")
            activate()
            result = fn(xp, sp, **kwargs)
            sync()
            del result
            if is_cold and release is not None:
                release()
        reps = 1
        if not is_cold:
            paths[0][1]()
            t0 = clock()
            result = fn(xp, sp, **kwargs)
            sync()
            one = clock() - t0
            del result
            reps = max(1, min(100, math.ceil(min_sample_s / max(one, 1e-9))))
        rows = {label: {"runs": [], "reps": reps, "faults": None} for label, *_ in paths}
        hosts = {}
        for r in range(rounds):
            for label, activate, strategy, release in paths[r % len(paths):] + paths[:r % len(paths)]:
                say(f"{name}  round {r + 1}/{rounds}  {label}")
                row = rows[label]
                activate()
                if strategy is not None:
                    for d in range(strategy.backend.device_count()):
                        strategy.reset_peak(d)
                if faults is not None:
                    faults.start()
                moved0 = sum(getattr(strategy, "n_pages_moved", None) or [0])  # expandable's remap
                t0 = clock()
                for i in range(reps):
                    if i:
                        del result  # noqa: F821 - the previous run's result, before the next one
                    result = fn(xp, sp, **kwargs)
                sync()
                row["runs"].append((clock() - t0) / reps)
                if faults is not None:
                    counts = faults.stop()
                    # per run, like the time: the sample's counts over its runs
                    row["faults"] = None if counts is None else {k: round(v / reps) for k, v in counts.items()}
                hosts[label] = to_host(result)
                del result
                moved = getattr(strategy, "n_pages_moved", None)
                if moved is not None:  # pages expandable moved to grow its range, per run of the sample
                    row["pages_moved"] = round((sum(moved) - moved0) / reps)
                if strategy is not None:
                    st = [strategy.stats(d) for d in range(strategy.backend.device_count())]
                    row["peak_bytes_in_use"] = max(row.get("peak_bytes_in_use", 0), *(x.peak_bytes_in_use for x in st))
                    row["peak_bytes_reserved"] = max(row.get("peak_bytes_reserved", 0),
                                                     *(x.peak_bytes_reserved for x in st))
                elif stats is not None:
                    row.update(stats())
                if is_cold and release is not None:
                    release()
        for _label, _activate, _strategy, release in paths:
            if release is not None and not is_cold:
                release()
        ref = None
        for label, row in rows.items():
            row["seconds"] = statistics.median(row["runs"])
            host = hosts[label]
            if host.size <= 4:  # scalar results (a price, a sum) are kept in the report
                row["value"] = [float(v) for v in host.reshape(-1)]
            if ref is None:
                ref = host
                row["check"] = {"identical": True, "max_rel_diff": 0.0, "reference": True}
            else:
                row["check"] = _compare(ref, host)
        first = next(iter(rows.values()))
        base = first["seconds"]
        for row in rows.values():
            row["ratio_to_first"] = row["seconds"] / base if base > 0 else float("nan")
            row["ratio_in_rounds"] = _ratio_in_rounds(row["runs"], first["runs"])
        out[name] = rows
    return out


def _ratio_in_rounds(runs: list[float], ref: list[float]) -> dict:
    """The ratio of a path's sample to the first path's sample of the same
    round, per round; their median and quartiles. The samples of one round
    are taken one after the other, so this ratio cancels the host's drift
    between rounds, which the ratio of the two medians does not."""
    if not runs or len(runs) != len(ref):
        raise ValueError(f"expected one sample per round for both paths, got {len(runs)} and {len(ref)}")
    per = [a / b if b > 0 else float("nan") for a, b in zip(runs, ref)]
    ok = [x for x in per if math.isfinite(x)]  # a reference sample of 0 s (or NaN) gives no ratio
    if not ok:
        nan = float("nan")
        return {"median": nan, "q1": nan, "q3": nan, "per_round": per}
    if len(ok) >= 2:
        q = statistics.quantiles(ok, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    else:
        q1 = q3 = ok[0]
    return {"median": statistics.median(ok), "q1": q1, "q3": q3, "per_round": per}


CONTROL = "cupy-default-again"
"""The label of the A/A control: CuPy's pool a second time, timed like any
other path. Its ratio to ``cupy-default`` is what the bench cannot tell apart
from 1 on that machine in that run."""


def default_specs() -> list[str]:
    """The strategy specs ``bench workloads`` runs when none are given: every
    registered strategy that needs no other library (rmm and torch are
    measured by ``bench alloc``), then ``managed:prefetch=on_new``,
    ``managed:prefetch=on_alloc`` and ``pool:route=wrap``."""
    from ..registry import get_registry

    reg = get_registry()
    return [n for n in reg.names() if not reg.get(n).requires] + [
        "managed:prefetch=on_new", "managed:prefetch=on_alloc", "pool:route=wrap"]


def check_args(*, strategies=None, only=None, scale=1.0, min_sample_s=0.25) -> tuple[list[str], list[str]]:
    """Refuse bad arguments of :func:`run` before anything runs; return the
    workload names and the strategy specs.

    Raises:
        ValueError: an unknown workload name, an empty or repeated list, a
            ``scale`` outside (0, 1], ``min_sample_s`` not a number of
            seconds in [0, 10].
        TypeError, ValueError (from :func:`cupy_memstrat.validate`): a
            spec that does not parse, names no registered strategy or has a
            bad option.
    """
    from ..api import validate

    names = list(WORKLOADS) if only is None else list(only)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; workloads: {', '.join(WORKLOADS)}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"only: expected distinct workload names, at least one, got {names}")
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ValueError(f"scale: expected a number in (0, 1], got {scale!r}")
    if isinstance(min_sample_s, bool) or not isinstance(min_sample_s, (int, float)) or not 0 <= min_sample_s <= 10:
        raise ValueError(f"min_sample_s: expected seconds in [0, 10], got {min_sample_s!r}")
    specs = default_specs() if strategies is None else list(strategies)
    if len(set(specs)) != len(specs):
        raise ValueError(f"strategies: each spec once, got {specs}")
    for spec in specs:
        validate(spec)
    return names, specs


def run(*, rounds: int = 5, progress=None, strategies=None, scale: float = 1.0, only=None,
        min_sample_s: float = 0.25) -> dict:
    """Every workload under CuPy's pool, the A/A control (:data:`CONTROL`)
    and each strategy; the report (seconds).

    Args:
        rounds: rounds of timed samples, each path once per round (after
            one warm-up run each).
        strategies: strategy specs to run (default: :func:`default_specs`).
        scale: multiplies the problem sizes (0 < scale <= 1 shrinks them).
        only: workload names to run (default: all).
        min_sample_s: seconds a timed sample lasts at least (a short
            program runs several times in one sample; see :func:`measure`).

    Raises:
        NoDeviceError, CuPyNotInstalledError: nothing to measure on.
        ValueError, TypeError: bad arguments (see :func:`check_args`),
            refused before anything runs.
    """
    from ..api import create
    from ..info import collect
    from . import managed as _managed
    from .alloc import require_real_gpu

    names, specs = check_args(strategies=strategies, only=only, scale=scale, min_sample_s=min_sample_s)
    require_real_gpu()
    import cupy
    import cupyx.scipy.sparse as sp

    say = progress or (lambda msg: None)
    total = cupy.cuda.Device().mem_info[1]
    large = int(total / 4 + (1 << 30)) if scale == 1 else int((1 << 30) * scale)
    large -= large % (1 << 20)
    kwargs = {
        "cg-poisson": {"n": max(32, int(1024 * math.sqrt(scale))), "iters": 200},
        "fft-convolution": {"batch": max(2, int(64 * scale)), "size": 512},
        "kmeans": {"n": max(1000, int(2_000_000 * scale))},
        "monte-carlo": {"paths": max(1000, int(1_000_000 * scale))},
        "managed-large": {"nbytes": large},
        "multi-stream": {"n": max(1024, int((1 << 21) * scale))},
    }
    workloads = {n: (WORKLOADS[n][0], kwargs[n]) for n in names}
    pool = cupy.get_default_memory_pool()
    prev = cupy.cuda.get_allocator()
    # Each path gives its cache back when done: a data set of a quarter of the device cached by
    # several pools at once would leave the next path short (and managed memory must never be
    # asked for beyond what is free). The control is the same pool under another label.
    paths = [(label, lambda: cupy.cuda.set_allocator(pool.malloc), None, pool.free_all_blocks)
             for label in ("cupy-default", CONTROL)]
    made = []
    for spec in specs:
        s = create(spec)
        made.append(s)
        paths.append((spec, lambda m=s.cupy_allocator(): cupy.cuda.set_allocator(m), s, s.trim))
    faults = _managed._Faults()

    def pool_stats():
        return {"pool_total_bytes_after": int(pool.total_bytes())}

    try:
        results = measure(cupy, sp, paths, workloads, rounds=rounds, sync=lambda: cupy.cuda.Device().synchronize(),
                          to_host=cupy.asnumpy, say=say, stats=pool_stats,
                          faults=faults if faults.counter is not None else None, cold=COLD,
                          min_sample_s=min_sample_s)
    finally:
        cupy.cuda.set_allocator(prev)
        for s in made:
            s.trim()
    if "managed-large" in results:
        want = expected_managed_large(kwargs["managed-large"]["nbytes"])
        for row in results["managed-large"].values():
            row["check"]["expected"] = want
            row["check"]["equals_expected"] = row.get("value") == [want]
    return {
        "benchmark": "workloads",
        "machine": collect(),
        "params": {"rounds": rounds, "scale": scale, "min_sample_s": min_sample_s, "control": CONTROL,
                   "sizes": kwargs, "cold": [n for n in names if n in COLD],
                   "descriptions": {n: WORKLOADS[n][1] for n in names},
                   "fault_counters": faults.source or faults.error},
        "results": results,
    }


def format_table(report: dict) -> str:
    """Median seconds per workload and path, ratio to CuPy's pool, peaks, faults, check."""
    out = ["workloads: median wall seconds (ratio of the medians to CuPy's pool), the ratio to CuPy's pool's sample "
           "of the same round (median [quartiles]), peak in use / reserved, GPU faults, result"]
    control = report["params"].get("control")
    if control:
        out.append(f"{control} is CuPy's pool again, timed as another path: its ratios are the run's own noise")
    cold = set(report["params"].get("cold") or ())
    for name, rows in report["results"].items():
        how = "; cold: each run starts with nothing cached" if name in cold else ""
        out.append(f"{name}: {report['params']['descriptions'].get(name, '')}{how}")
        for label, r in rows.items():
            peaks = ""
            if "peak_bytes_in_use" in r:
                peaks = f"{format_size(r['peak_bytes_in_use'])} / {format_size(r['peak_bytes_reserved'])}"
            f = (r.get("faults") or {}).get("gpu_faults")
            c = r.get("check") or {}
            check = "reference" if c.get("reference") else "identical" if c.get("identical") else (
                f"differs (max rel {c['max_rel_diff']:.2e})" if c.get("max_rel_diff") is not None
                else f"differs (max abs {c['max_abs_diff']:.2e}; {c['why']})" if "max_abs_diff" in c
                else c.get("why", "?"))
            rr = r.get("ratio_in_rounds")
            paired = f"{rr['median']:5.2f}x [{rr['q1']:.2f}-{rr['q3']:.2f}]" if rr else ""
            out.append(f"  {label:28s} {r['seconds']:9.4f} s ({r['ratio_to_first']:5.2f}x)  {paired:>19s}  "
                       f"{peaks:>22s}  {'' if f is None else f'{f} faults':>12s}  {check}"
                       + (f"; {r['pages_moved']} pages moved per run" if r.get("pages_moved") else ""))
    return "\n".join(out)


def progress_printer(stream=None):
    from .alloc import progress_printer as _pp

    return _pp(stream, "workloads")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m cupy_memstrat bench workloads")
