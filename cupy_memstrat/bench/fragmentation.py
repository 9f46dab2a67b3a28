"""``bench fragmentation``: programs that fragment a cache, replayed under CuPy's pools and every
strategy (:mod:`cupy_memstrat.replay`); peak reserved against peak in use.

The programs are allocation traces, written here as the allocations and frees they make
(no kernels):

* ``16-then-32``: 8 x 16 MiB allocated and freed, then 4 x 32 MiB; the case PyTorch's
  maintainers use to show its caching allocator keep 256 MiB for 128 MiB in use;
* ``32-then-16``: the same two batches in the other order;
* ``growing-buffer``: a buffer that grows by 24 MiB at each of 40 steps (a growing cache): the
  larger one is allocated, then the older one freed;
* ``random-sizes``: 400 steps at a fixed seed, allocating sizes from 1 MiB to 1 GiB (uniform in
  their logarithm) and freeing random live ones, at most 3 GiB live;
* ``alternating-batches``: a training-like step (input, two temporaries, output) with the batch
  size alternating between 384 and 448 rows of 1 MiB, 12 steps.

Each program is replayed once per path from an empty cache; the report has, per program and
path, the peak in use, the peak reserved, their ratio and the allocations that grew the reserve
(each one took memory from CUDA: a ``cudaMalloc``, a pool growth, new managed chunks).
"""

from __future__ import annotations

import math
import random
import sys

from ..sizes import format_size
from ..trace import Trace, trace_from_events

__all__ = ["PROGRAMS", "program", "check_args", "run", "format_table"]

MiB = 1 << 20


class _Recorder:
    def __init__(self):
        self.events, self.next = [], 1

    def alloc(self, size: int) -> int:
        ptr = self.next << 12
        self.next += 1
        self.events.append({"action": "alloc", "ptr": ptr, "size": int(size), "device": 0, "stream": 0})
        return ptr

    def free(self, ptr: int, size: int) -> None:
        self.events.append({"action": "free", "ptr": ptr, "size": int(size), "device": 0, "stream": 0})


def _batches(first: int, first_n: int, second: int, second_n: int, scale: float) -> list:
    r = _Recorder()
    for size, n in ((first, first_n), (second, second_n)):
        size = int(size * scale)
        held = [r.alloc(size) for _ in range(n)]
        for p in held:
            r.free(p, size)
    return r.events


def _growing(scale: float, steps: int = 40) -> list:
    r = _Recorder()
    size = int(64 * MiB * scale)
    old = r.alloc(size)
    for _ in range(steps):
        new_size = size + int(24 * MiB * scale)
        new = r.alloc(new_size)
        r.free(old, size)
        old, size = new, new_size
    r.free(old, size)
    return r.events


def _random(scale: float, steps: int = 400, seed: int = 0) -> list:
    rng = random.Random(seed)
    r = _Recorder()
    cap = int(3 * 1024 * MiB * scale)
    live: list[tuple[int, int]] = []
    used = 0
    lo, hi = math.log(MiB * scale), math.log(1024 * MiB * scale)
    for _ in range(steps):
        if live and rng.random() < 0.4:
            ptr, size = live.pop(rng.randrange(len(live)))
            r.free(ptr, size)
            used -= size
            continue
        size = int(math.exp(rng.uniform(lo, hi))) // 4096 * 4096 or 4096
        while live and used + size > cap:
            ptr, old = live.pop(rng.randrange(len(live)))
            r.free(ptr, old)
            used -= old
        live.append((r.alloc(size), size))
        used += size
    for ptr, size in live:
        r.free(ptr, size)
    return r.events


def _alternating(scale: float, steps: int = 12) -> list:
    r = _Recorder()
    for step in range(steps):
        rows = 384 if step % 2 == 0 else 448
        row = int(MiB * scale)
        x = r.alloc(rows * row)
        t1, t2 = r.alloc(rows * row // 2), r.alloc(rows * row // 2)
        r.free(t1, rows * row // 2)
        out = r.alloc(rows * row // 4)
        r.free(t2, rows * row // 2)
        r.free(x, rows * row)
        r.free(out, rows * row // 4)
    return r.events


#: name -> (events for a scale, description)
PROGRAMS = {
    "16-then-32": (lambda scale: _batches(16 * MiB, 8, 32 * MiB, 4, scale),
                   "8 x 16 MiB allocated and freed, then 4 x 32 MiB"),
    "32-then-16": (lambda scale: _batches(32 * MiB, 4, 16 * MiB, 8, scale),
                   "4 x 32 MiB allocated and freed, then 8 x 16 MiB"),
    "growing-buffer": (_growing, "a buffer grown by 24 MiB at each of 40 steps, the older one freed"),
    "random-sizes": (_random, "400 steps of sizes from 1 MiB to 1 GiB, random lifetimes, at most 3 GiB live"),
    "alternating-batches": (_alternating, "input, two temporaries and output per step, batch 384 and 448 "
                                          "rows of 1 MiB in turn"),
}


def program(name: str, scale: float = 1.0) -> Trace:
    """The trace of program ``name`` (:data:`PROGRAMS`), sizes multiplied by ``scale``.

    Raises:
        ValueError: an unknown name.
    """
    if name not in PROGRAMS:
        raise ValueError(f"unknown program {name!r}; programs: {', '.join(PROGRAMS)}")
    return trace_from_events(PROGRAMS[name][0](scale), source=name)


def check_args(*, strategies=None, only=None, scale=1.0):
    """Refuse bad arguments before anything runs; return the program names and the specs.

    Raises:
        ValueError, TypeError: an unknown program, a repeated name, a scale outside (0, 1], or
            a strategy spec that does not parse.
    """
    from ..replay import check_args as replay_args

    names = list(PROGRAMS) if only is None else list(only)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        raise ValueError(f"unknown program {unknown[0]!r}; programs: {', '.join(PROGRAMS)}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"only: expected distinct program names, at least one, got {names}")
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ValueError(f"scale: expected a number in (0, 1], got {scale!r}")
    _, specs, _ = replay_args(strategies=strategies)
    return names, specs


def run(*, rounds: int = 1, progress=None, strategies=None, only=None, scale: float = 1.0, backend=None,
        cupy_paths=None) -> dict:
    """Every program under CuPy's pools and each strategy; the report.

    Args:
        rounds: accepted for the command line's sake; the figures are counts of bytes, the same
            in every round, so each program is replayed once per path.
        strategies: strategy specs (default: :func:`cupy_memstrat.replay.default_specs`).
        only: program names (default: all).
        scale: multiplies every size (0 < scale <= 1).
        backend: the CUDA seam (default: the process's; the simulated GPU in the tests).
        cupy_paths: CuPy's pools to run beside (default: both on a GPU, none simulated).

    Raises:
        NoDeviceError, CuPyNotInstalledError: no GPU and no backend given.
        ValueError, TypeError: bad arguments, refused before anything runs.
    """
    from ..replay import replay

    names, specs = check_args(strategies=strategies, only=only, scale=scale)
    if backend is None:
        from .alloc import require_real_gpu

        require_real_gpu()
    say = progress or (lambda msg: None)
    results, machine, params = {}, None, None
    for name in names:
        say(f"{name}: {PROGRAMS[name][1]}")
        rep = replay(program(name, scale), strategies=specs, cupy_paths=cupy_paths, backend=backend,
                     progress=lambda msg, name=name: say(f"  {name} {msg}"))
        machine, params = rep["machine"], rep["params"]
        rows = {}
        for label, row in rep["results"].items():
            rows[label] = {k: v for k, v in row.items() if k != "reserved_curve"}
        results[name] = {"peak_in_use_as_written": rep["trace"]["peak_in_use"], "paths": rows}
    return {
        "benchmark": "fragmentation",
        "machine": machine,
        "params": {"scale": scale, "strategies": specs, "cupy_paths": params["cupy_paths"] if params else [],
                   "descriptions": {n: PROGRAMS[n][1] for n in names}},
        "results": results,
    }


def format_table(report: dict) -> str:
    """Per program and path: peak in use, peak reserved, their ratio, the allocations that grew the
    reserve."""
    out = ["fragmentation: peak in use / peak reserved (reserved over in use) and the allocations that took "
           "memory from CUDA (growths)"]
    for name, res in report["results"].items():
        out.append(f"{name}: {report['params']['descriptions'].get(name, '')}")
        for label, r in res["paths"].items():
            ratio = f"{r['reserved_over_in_use']:.2f}x" if r.get("reserved_over_in_use") else "-"
            note = "" if r["completed"] else f"  out of memory at {r['failed_at']}"
            out.append(f"  {label:26s} {format_size(r['peak_in_use']):>11s} / {format_size(r['peak_reserved']):>11s}"
                       f"  {ratio:>7s}  {r['growth_steps']:>5d} growths{note}")
    return "\n".join(out)


def progress_printer(stream=None):
    from .alloc import progress_printer as _pp

    return _pp(stream, "fragmentation")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m cupy_memstrat bench fragmentation")
