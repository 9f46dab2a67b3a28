"""Replay a program's allocations and frees (a :class:`~cupy_memstrat.trace.Trace`) under each
strategy and under CuPy's own pools, side by side in one process: which one fits, and what each
reserves for the same program.

Each path replays the whole trace twice from an empty cache: once timed (the time per
allocation), once read after every allocation (peak in use, peak reserved, the growth steps of
the reserve, reserved memory over the replay). Each recorded stream gets a new stream of its
own on the path (the default streams stay the default streams). No kernel runs unless ``touch``:
then each block is written once (``cudaMemsetAsync``), so that managed memory is placed.

A ``limit`` is held by a path's own cap where it has one (CuPy's ``MemoryPool.set_limit``, the
``async`` strategy's ``max_size``), otherwise by device memory set aside before the replay
(``cudaMalloc`` of the free memory less the limit); the report says which.
"""

from __future__ import annotations

import gc
import time

from .sizes import format_size
from .trace import ALLOC, Trace, check_fits

__all__ = ["CUPY_PATHS", "default_specs", "check_args", "replay", "format_table"]

#: CuPy's own pools, replayed beside the strategies: its default ``MemoryPool`` and its
#: ``MemoryAsyncPool`` (``cudaMallocAsync`` on the device's current pool)
CUPY_PATHS = ("cupy-default", "cupy-async")
_SAMPLES = 2000  # points of the reserved-over-the-replay curve kept per path


def default_specs() -> list[str]:
    """Every registered strategy that needs no other library, then ``torch`` where PyTorch is
    installed (its caching allocator is the one PyTorch users compare with)."""
    from .registry import get_registry

    reg = get_registry()
    out = [n for n in reg.names() if not reg.get(n).requires]
    try:
        import torch  # noqa: F401

        if "torch" in reg.names():
            out.append("torch")
    except ImportError:
        pass
    return out


def left_out(*, strategies=None, cupy_paths=None, real: bool = True) -> dict[str, str]:
    """The paths a replay with these arguments leaves out, each with the reason (for the report):
    CuPy's pools on the simulated GPU or where none were asked, and, by default, the strategies
    over another library."""
    from .registry import get_registry

    out = {}
    if cupy_paths is None and not real:
        out.update({p: "the simulated GPU has no CuPy pool" for p in CUPY_PATHS})
    elif cupy_paths is not None:
        out.update({p: "not asked for (--no-cupy)" for p in CUPY_PATHS if p not in cupy_paths})
    if strategies is None:
        reg = get_registry()
        chosen = default_specs()
        for name in reg.names():
            if name in chosen:
                continue
            why = reg.get(name).unavailable()
            if why is None:
                why = (f"left out by default: it allocates through {reg.get(name).requires}'s current memory "
                       f"resource, which the program chooses; name it with --strategies to replay under it")
            out[name] = why
    return out


def check_args(*, strategies=None, cupy_paths=None, limit=None) -> tuple[list[str], list[str], int | None]:
    """Refuse bad arguments before anything is allocated; return the CuPy paths, the strategy
    specs and the limit in bytes.

    Raises:
        ValueError, TypeError: an unknown CuPy path, a repeated spec, a spec that does not
            parse, or a limit that is not a size.
    """
    from .api import validate
    from .sizes import parse_size

    cupy_paths = list(CUPY_PATHS) if cupy_paths is None else list(cupy_paths)
    unknown = [p for p in cupy_paths if p not in CUPY_PATHS]
    if unknown:
        raise ValueError(f"unknown CuPy path {unknown[0]!r}; expected some of {', '.join(CUPY_PATHS)}")
    specs = default_specs() if strategies is None else list(strategies)
    if len(set(specs)) != len(specs):
        raise ValueError(f"strategies: each spec once, got {specs}")
    seen = {}
    for spec in specs:
        name, parsed = validate(spec)
        same = (name, repr(sorted(parsed.items())))  # an alias, or the same options written otherwise
        if same in seen:
            raise ValueError(f"strategies: {spec!r} is the same strategy with the same options as "
                             f"{seen[same]!r}; give each once")
        seen[same] = spec
    if not cupy_paths and not specs:
        raise ValueError("nothing to replay under: no CuPy path and no strategy")
    try:
        nbytes = None if limit is None else parse_size(limit, what="limit")
    except ValueError as exc:
        if ">= 0" not in str(exc):
            raise
        nbytes = -1  # a negative size: the message below
    if nbytes is not None and nbytes <= 0:
        raise ValueError(f"limit: expected a size above 0, got {limit!r}")
    return cupy_paths, specs, nbytes


class _Path:
    """One way of allocating: CuPy's pool, CuPy's async pool, or a strategy."""

    def __init__(self, label, backend, strategy=None, pool=None):
        from .backends import RealBackend

        self.label, self.backend, self.strategy, self.pool = label, backend, strategy, pool
        self.limit_by = None
        # On the GPU every path allocates as CuPy does (a MemoryPointer, freed when dropped); on
        # the simulated GPU, which has no CuPy, a strategy's hot path takes and frees pointers.
        self._hot = None
        if strategy is not None and not isinstance(backend, RealBackend):
            self._hot = strategy.hot_path_functions()
        elif strategy is not None:
            self._malloc = strategy.cupy_allocator()
        else:
            self._malloc = pool.malloc

    def alloc(self, size, device):
        """A handle that frees the block when :meth:`free` is given it."""
        if self._hot is not None:
            return self._hot[0](size, device)
        return self._malloc(size)

    def free(self, handle, device) -> None:
        if self._hot is not None:
            self._hot[1](handle, device)
        # a MemoryPointer frees its block when the last reference goes (the caller's del)

    def ptr(self, handle) -> int:
        return handle if isinstance(handle, int) else handle.ptr

    def read(self, device) -> tuple[int, int]:
        """``(bytes in use, bytes reserved)`` now."""
        if self.strategy is not None:
            st = self.strategy.stats(device)
            return st.bytes_in_use, st.bytes_reserved
        return int(self.pool.used_bytes()), int(self.pool.total_bytes())

    def reset(self, devices) -> None:
        """Give the cache back and start the peaks anew."""
        if self.strategy is not None:
            self.strategy.trim()
            for d in devices:
                self.strategy.reset_peak(d)
        else:
            self.pool.free_all_blocks()

    def peaks(self, device) -> tuple[int, int] | None:
        if self.strategy is None:
            return None
        st = self.strategy.stats(device)
        return st.peak_bytes_in_use, st.peak_bytes_reserved


def _streams(trace: Trace, backend, real: bool) -> list:
    """One new stream per recorded non-default stream; the default streams stay themselves."""
    out = []
    for handle in trace.streams:
        if real:
            import cupy

            if handle in (None, 0, 1):
                out.append(cupy.cuda.Stream.null)
            elif handle == 2:
                out.append(cupy.cuda.Stream.ptds)
            else:
                out.append(cupy.cuda.Stream(non_blocking=False))
        else:
            out.append(backend.null_stream() if handle in (None, 0, 1, 2) else backend.stream())
    return out


def _set_aside(backend, devices, limit, real) -> list:
    """Device memory allocated so that at most ``limit`` bytes stay free per device."""
    held = []
    for d in devices:
        free, _ = backend.mem_get_info(d)
        extra = free - limit
        if extra > 0:
            if real:
                import cupy

                with cupy.cuda.Device(d):
                    held.append((d, cupy.cuda.runtime.malloc(extra)))
            else:
                cur = backend.get_device()
                backend.set_device(d)
                try:
                    held.append((d, backend.malloc(extra)))
                finally:
                    backend.set_device(cur)
    return held


def _release(backend, held, real) -> None:
    for d, ptr in held:
        if real:
            import cupy

            with cupy.cuda.Device(d):
                cupy.cuda.runtime.free(ptr)
        else:
            backend.free(ptr)


def _run_once(path: _Path, trace: Trace, streams, *, probe: bool, touch: bool, real: bool) -> dict:
    """Replay the whole trace on ``path``; with ``probe`` read in use and reserved after each
    allocation. Stops at the first allocation that fails."""
    import contextlib

    b = path.backend
    held: dict[int, object] = {}
    out = {"failed_at": None, "error": None}
    peak_use = {d: 0 for d in trace.devices}
    peak_res = {d: 0 for d in trace.devices}
    growths = largest_growth = 0
    last_res = {d: path.read(d)[1] for d in trace.devices} if probe else {}
    curve = []
    every = max(1, trace.n_allocs // _SAMPLES)
    n_alloc = 0
    if real:
        import cupy

        device_ctx = cupy.cuda.Device
        memset = cupy.cuda.runtime.memsetAsync
    else:
        def device_ctx(d):
            @contextlib.contextmanager
            def cm():
                cur = b.get_device()
                b.set_device(d)
                try:
                    yield
                finally:
                    b.set_device(cur)
            return cm()
        memset = None
    t0 = time.perf_counter()
    try:
        for i, (op, block, size, dev, s) in enumerate(trace.events):
            with device_ctx(dev), streams[s]:
                if op == ALLOC:
                    try:
                        h = path.alloc(size, dev)
                    except MemoryError as exc:
                        out["failed_at"], out["error"] = i, str(exc).split(";")[0]
                        break
                    held[block] = (h, dev)
                    if touch and size:
                        if real:
                            memset(path.ptr(h), 0, size, streams[s].ptr)
                        else:
                            b.memset_async(path.ptr(h), 0, size, streams[s].ptr)
                    n_alloc += 1
                    if probe:
                        use, res = path.read(dev)
                        peak_use[dev] = max(peak_use[dev], use)
                        peak_res[dev] = max(peak_res[dev], res)
                        if res > last_res[dev]:
                            growths += 1
                            largest_growth = max(largest_growth, res - last_res[dev])
                        last_res[dev] = res
                        if n_alloc % every == 0:
                            curve.append([i, sum(last_res.values())])
                else:
                    h, _ = held.pop(block)
                    path.free(h, dev)
                    del h
                    if probe:  # a free may give memory back: the next growth counts from here
                        last_res[dev] = path.read(dev)[1]
        for d in trace.devices:
            b.device_synchronize(d)
    finally:
        seconds = time.perf_counter() - t0
        for block in list(held):
            h, dev = held.pop(block)
            path.free(h, dev)
            del h
        gc.collect()
    out.update(seconds=seconds, n_allocs=n_alloc)
    if probe:
        out.update(peak_in_use=sum(peak_use.values()), peak_reserved=sum(peak_res.values()),
                   growth_steps=growths, largest_growth=largest_growth, reserved_curve=curve)
    return out


def replay(trace: Trace, *, strategies=None, cupy_paths=None, limit=None, touch: bool = False,
           backend=None, progress=None) -> dict:
    """Replay ``trace`` under each path; the report (JSON-ready).

    Args:
        trace: from :func:`cupy_memstrat.trace.read_trace`.
        strategies: strategy specs (default: :func:`default_specs`).
        cupy_paths: which of :data:`CUPY_PATHS` to replay under too (default: both; none on
            the simulated GPU, which has no CuPy).
        limit: bytes (or a size string) a path may use per device; ``None``: no limit.
        touch: write each block once after allocating it.
        backend: the CUDA seam (default: the process's).
        progress: called with a line of text as each path starts.

    Raises:
        TraceError: an allocation larger than its device, or a device the machine lacks
            (before anything is allocated).
        ValueError, TypeError: bad arguments (:func:`check_args`), before anything is allocated.
    """
    from . import backends as _backends
    from .api import create

    b = backend if backend is not None else _backends.get_backend()
    real = isinstance(b, _backends.RealBackend)
    omitted = left_out(strategies=strategies, cupy_paths=cupy_paths, real=real)
    if cupy_paths is None and not real:
        cupy_paths = ()
    cupy_paths, specs, nbytes = check_args(strategies=strategies, cupy_paths=cupy_paths, limit=limit)
    totals = {d: b.device_properties(d)["total_memory"] for d in range(b.device_count())}
    check_fits(trace, totals)
    for d in trace.devices or [0]:
        if nbytes is not None and d in totals and nbytes > totals[d]:
            raise ValueError(f"limit: {format_size(nbytes)} is above device {d}'s memory "
                             f"({format_size(totals[d])}); give a limit up to it")
    say = progress or (lambda msg: None)
    paths = []
    for label in cupy_paths:
        import cupy

        pool = cupy.cuda.MemoryPool() if label == "cupy-default" else cupy.cuda.MemoryAsyncPool()
        paths.append(_Path(label, b, pool=pool))
    for spec in specs:
        opts = {}
        name = spec.split(":")[0]
        if nbytes is not None and name == "async" and "max_size" not in spec:
            opts["max_size"] = nbytes
        if nbytes is not None and name == "managed" and "headroom" not in spec:
            # the guard keeps the headroom a device of `limit` bytes would get by default
            # (min(1 GiB, 5%)), not the real device's 1 GiB, out of the memory left free
            opts["headroom"] = min(1 << 30, nbytes // 20)
        s = create(spec, backend=b, **opts) if not real else create(spec, **opts)
        p = _Path(spec, b, strategy=s)
        if "max_size" in opts:
            p.limit_by = "max_size"
        elif "headroom" in opts:
            p.limit_by = f"memory set aside; guard headroom {format_size(opts['headroom'])}"
        paths.append(p)
    results = {}
    devices = trace.devices or [0]
    try:
        for i, p in enumerate(paths):
            say(f"replaying under {p.label} ({i + 1} of {len(paths)})")
            try:
                p.reset(devices)
                timed = _run_once(p, trace, _streams(trace, b, real), probe=False, touch=touch, real=real)
                p.reset(devices)
                aside = []
                if nbytes is not None:
                    if p.pool is not None and p.label == "cupy-default":
                        p.pool.set_limit(size=nbytes)
                        p.limit_by = "set_limit"
                    elif p.limit_by is None or p.limit_by.startswith("memory set aside"):
                        aside = _set_aside(b, devices, nbytes, real)
                        p.limit_by = p.limit_by or "memory set aside"
                try:
                    probed = _run_once(p, trace, _streams(trace, b, real), probe=True, touch=touch, real=real)
                finally:
                    _release(b, aside, real)
                peaks = p.peaks(devices[0]) if len(devices) == 1 else None
                if peaks is not None:  # the strategy's own peaks: every allocation and free counted
                    probed["peak_in_use"], probed["peak_reserved"] = peaks
                row = {
                    "peak_in_use": probed["peak_in_use"],
                    "peak_reserved": probed["peak_reserved"],
                    "reserved_over_in_use": (probed["peak_reserved"] / probed["peak_in_use"]
                                             if probed["peak_in_use"] else None),
                    "growth_steps": probed["growth_steps"],
                    "largest_growth": probed["largest_growth"],
                    "us_per_alloc": timed["seconds"] / timed["n_allocs"] * 1e6 if timed["n_allocs"] else None,
                    "completed": probed["failed_at"] is None,
                    "failed_at": None if probed["failed_at"] is None else trace.describe(probed["failed_at"]),
                    "error": probed["error"],
                    "reserved_curve": probed["reserved_curve"],
                }
                if nbytes is not None:  # a cap that acts in steps may let the reserve pass the limit
                    row["fits"] = probed["failed_at"] is None and probed["peak_reserved"] <= nbytes * len(devices)
                    row["limit_held_by"] = p.limit_by
            finally:
                if p.pool is not None and nbytes is not None and p.label == "cupy-default":
                    p.pool.set_limit(size=0)
                p.reset(devices)
            results[p.label] = row
    finally:
        for p in paths:
            if p.strategy is not None:
                p.strategy.close()
    machine = None
    if real:
        from .info import collect

        machine = collect()
    return {
        "kind": "replay",
        "machine": machine,
        "trace": {"source": trace.source, "events": len(trace.events), "allocations": trace.n_allocs,
                  "streams": len(trace.streams), "devices": trace.devices, "recorded_with": trace.recorded_with,
                  "peak_in_use": trace.peak_in_use(), "largest": trace.largest()[0]},
        "params": {"limit": nbytes, "touch": touch, "strategies": specs, "cupy_paths": cupy_paths},
        "results": results,
        "left_out": omitted,
    }


def format_table(report: dict) -> str:
    """The report as a table: one row per path."""
    t = report["trace"]
    p = report["params"]
    n, k = t["allocations"], t["streams"]
    lines = [f"replay of {t['source']}: {n:,} allocation{'' if n == 1 else 's'} on {k} stream{'' if k == 1 else 's'}, "
             f"peak in use {format_size(t['peak_in_use'])} as recorded"
             + (f" (recorded with {t['recorded_with']})" if t.get("recorded_with") else "")
             + (f"; limit {format_size(p['limit'])} per device" if p.get("limit") else "")
             + ("; each block written once" if p.get("touch") else "; no kernels")]
    w = max([26] + [len(label) for label in report["results"]])
    head = f"  {'path':{w}s} {'peak in use':>12s} {'peak reserved':>14s} {'ratio':>6s} {'growths':>8s} {'us/alloc':>9s}"
    if p.get("limit"):
        head += "  fits (held by)"
    lines.append(head)
    for label, r in report["results"].items():
        x = r["reserved_over_in_use"]
        ratio = "-" if not x else f"{x:.2f}" if x < 100 else f"{x:.0f}" if x < 1e6 else f"{x:.0e}"
        us = f"{r['us_per_alloc']:.2f}" if r["us_per_alloc"] is not None else "-"
        line = (f"  {label:{w}s} {format_size(r['peak_in_use']):>12s} {format_size(r['peak_reserved']):>14s} "
                f"{ratio:>6s} {r['growth_steps']:>8d} {us:>9s}")
        if p.get("limit"):
            line += f"  {_fits_text(r, p['limit'] * max(1, len(t.get('devices') or [0])))} ({r['limit_held_by']})"
        elif not r["completed"]:
            line += f"  out of memory at {r['failed_at']}"
        lines.append(line)
    for label, why in (report.get("left_out") or {}).items():
        lines.append(f"  {label}: not replayed: {why}")
    return "\n".join(lines)


def _fits_text(row: dict, limit: int) -> str:
    """The "fits" cell: yes, or why not (out of memory at an event, or a reserve over the limit)."""
    if row["fits"]:
        return "yes"
    if not row["completed"]:
        return f"no: out of memory at {row['failed_at']}"
    return f"no: reserved {format_size(row['peak_reserved'])} > limit {format_size(limit)}"
