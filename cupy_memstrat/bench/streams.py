"""``bench streams``: which stream patterns each allocator keeps safe, measured.

Each pattern is a small CuPy program where a block is freed while a kernel
on some stream may still write or read it, and the next array of that size
is made right after. A "long kernel" is one block of 256 threads that waits
(about 100 ms) and then walks the array, so work on other streams runs
beside it. The report counts the elements that came out wrong over
``rounds`` rounds: 0 is safe; anything else means a block was handed out
while another stream still used it.

Patterns:

* ``other-stream``: an array is allocated and written by a long kernel on
  non-blocking stream A, then dropped; the next array of that size is
  allocated and zero-filled on non-blocking stream B, and B is synchronised.
  A's late writes must not land in it.
* ``freed-elsewhere``: allocated and written on stream S, dropped while the
  legacy default stream is current (``del`` outside ``with S:``); the next
  array is made on the legacy stream.
* ``freed-by-gc``: the same, the array dropped by the garbage collector (in
  a reference cycle) while the legacy stream is current.
* ``dead-stream``: an array is written by a long kernel on stream A and
  dropped, and A itself dies (``cudaStreamDestroy``) while the kernel runs;
  a new stream B, which CUDA may give A's handle, makes the next array.
* ``dead-stream-reclaimed``: the same, but the next array is made on a stream
  that lived all along (so its handle is another) and needs new memory: a
  strategy that hands a destroyed stream's cached chunks to other streams
  (``managed`` does) must wait for A's kernel first.
* ``per-thread``: with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`` (every
  thread's default stream has the handle ``cudaStreamPerThread``), one thread
  writes an array with a long kernel and drops it; another thread makes the
  next one. Run in a subprocess (the variable is read when CuPy loads).
* ``other-reader`` (cupy#8068): an array made on A is read by a long kernel
  on B, dropped on A, and the next array is made on A. Without
  :func:`cupy_memstrat.record_stream` every pool reuses the block on A at
  once; ``+record`` calls ``record_stream(x, B)`` first. ``+checks`` runs
  it under ``check="streams"`` (without record_stream) and reports the
  findings.

Allocators: CuPy's default pool, each strategy, and the control
``managed-one-cache``: the ``managed`` strategy with one cache for all
streams (what it was before its caches became stream-ordered), which shows
what the patterns do without stream-ordered reuse.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

__all__ = ["PATTERNS", "ALLOCATORS", "run", "format_table", "progress_printer"]

N = 1 << 20  # float32 elements: 4 MiB arrays
SPIN_S = 0.1  # seconds a long kernel waits before it walks the array

KERNELS = r"""
extern "C" __global__ void slow_copy(const float* x, float* y, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i];
}
extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = v;
}
"""

PATTERNS = ("other-stream", "freed-elsewhere", "freed-by-gc", "dead-stream", "dead-stream-reclaimed", "per-thread",
            "other-reader", "other-reader+record", "other-reader+checks")
ALLOCATORS = ("cupy-default", "device", "managed", "async", "pool", "pool:route=wrap", "managed-one-cache")


class Kernels:
    """The long kernels, compiled once, and the wait in clock cycles."""

    def __init__(self, cp, spin_s: float = SPIN_S):
        import numpy as np

        m = cp.RawModule(code=KERNELS)
        self.slow_copy, self.slow_fill = m.get_function("slow_copy"), m.get_function("slow_fill")
        khz = cp.cuda.Device().attributes["ClockRate"]
        self.cycles = np.int64(int(khz * 1000 * spin_s))
        self.np = np

    def fill(self, x, v: float):
        self.slow_fill((1,), (256,), (x, self.np.int32(x.size), self.np.float32(v), self.cycles))

    def copy(self, x, y):
        self.slow_copy((1,), (256,), (x, y, self.np.int32(x.size), self.cycles))


def one_cache_managed(**options):
    """The control: the ``managed`` strategy with one cache for every stream
    (its stream key is always 0), as before its caches were stream-ordered.
    Unsafe by construction; for measurements only."""
    from ..strategies.managed import ManagedStrategy

    class OneCacheManaged(ManagedStrategy):
        name = "managed-one-cache"

        def _stream_source(self):
            return None, lambda device: 0

    return OneCacheManaged(**options)


def install(cp, spec: str, **options):
    """Make ``spec`` CuPy's allocator; returns the strategy (None for CuPy's pool)."""
    import cupy_memstrat

    if spec == "cupy-default":
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
        return None
    if spec == "managed-one-cache":
        s = one_cache_managed(**options)
        cp.cuda.set_allocator(s.cupy_allocator())
        return s
    if spec == "rmm-pool":  # the rmm strategy over RMM's pool, which caches freed blocks per stream handle
        import rmm

        mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=256 << 20)
        return cupy_memstrat.use("rmm", resource=mr, **options)
    return cupy_memstrat.use(spec, **options)


def release(cp, s) -> None:
    """After a pattern: everything finished, the strategy closed, CuPy's pool emptied."""
    cp.cuda.Device().synchronize()
    gc.collect()
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    if s is not None:
        s.close()
    cp.get_default_memory_pool().free_all_blocks()


# -- the patterns: each returns the number of wrong elements over its rounds ---------------------------


def other_stream(cp, k: Kernels, rounds: int = 5, n: int = N) -> int:
    bad = 0
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for _ in range(rounds):
        with a:
            x = cp.empty(n, dtype=cp.float32)
            k.fill(x, 5.0)  # late writes, on A
            del x
        with b:
            y = cp.zeros(n, dtype=cp.float32)
            b.synchronize()
        a.synchronize()
        bad += int(cp.count_nonzero(y))
        del y
    return bad


def dead_stream(cp, k: Kernels, rounds: int = 5, n: int = N, per_round: list | None = None) -> int:
    """A stream dies while its last kernel still writes a freed block; a new
    stream, which CUDA may give the dead one's handle while that kernel still
    runs (docs/streams.md), allocates the same size and zero-fills it. An
    allocator that finds a stream's free blocks by handle then gives the new
    stream the block the dead one's kernel still writes: CuPy's pool does
    (its arenas are keyed by handle; wrong elements show only in rounds
    where the handle comes back), and so does the ``pool`` strategy, whose
    blocks are CuPy's pool's. ``per_round``, if given, gets ``(handle_reused,
    wrong_elements)`` for each round."""
    bad = 0
    for _ in range(rounds):
        a = cp.cuda.Stream(non_blocking=True)
        a_handle = a.ptr
        with a:
            x = cp.empty(n, dtype=cp.float32)
            k.fill(x, 5.0)  # late writes, on A
            del x
        del a  # cudaStreamDestroy: A's kernel goes on
        b = cp.cuda.Stream(non_blocking=True)
        reused = b.ptr == a_handle
        with b:
            y = cp.zeros(n, dtype=cp.float32)
            b.synchronize()
        cp.cuda.Device().synchronize()
        wrong = int(cp.count_nonzero(y))
        bad += wrong
        if per_round is not None:
            per_round.append((reused, wrong))
        del y, b
    return bad


def dead_stream_reclaimed(cp, k: Kernels, rounds: int = 5, n: int = N) -> int:
    """A stream dies while its last kernel still writes a freed block; stream
    B, alive all along, then makes an array of that size. B's own cache has
    none (every earlier array of B is kept), so a strategy that reclaims
    destroyed streams' caches (``managed``) gives B A's block: only after a
    device synchronisation, or A's late writes land in it."""
    bad = 0
    b = cp.cuda.Stream(non_blocking=True)
    kept = []
    for _ in range(rounds):
        a = cp.cuda.Stream(non_blocking=True)
        with a:
            x = cp.empty(n, dtype=cp.float32)
            k.fill(x, 5.0)  # late writes, on A
            del x
        del a  # cudaStreamDestroy: A's kernel goes on
        with b:
            y = cp.zeros(n, dtype=cp.float32)
            b.synchronize()
        cp.cuda.Device().synchronize()
        bad += int(cp.count_nonzero(y))
        kept.append(y)
    return bad


class _Cycle:
    def __init__(self, x):
        self.me, self.x = self, x


def freed_elsewhere(cp, k: Kernels, rounds: int = 5, n: int = N, by_gc: bool = False) -> int:
    bad = 0
    s = cp.cuda.Stream(non_blocking=True)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            with s:
                x = cp.empty(n, dtype=cp.float32)
                k.fill(x, 5.0)
            if by_gc:
                _Cycle(x)
                del x
                # the collector frees it, the legacy stream current; the young generation only,
                # which is quick: a full collection of a large heap (a test session's) can take
                # longer than the kernel (a tenth of a second and more for millions of objects)
                gc.collect(0)
            else:
                del x  # the legacy stream is current
            y = cp.zeros(n, dtype=cp.float32)
            cp.cuda.Stream.null.synchronize()
            s.synchronize()
            bad += int(cp.count_nonzero(y))
            del y
    finally:
        if gc_was:
            gc.enable()
    return bad


def other_reader(cp, k: Kernels, rounds: int = 5, n: int = N, record: bool = False) -> int:
    import cupy_memstrat

    bad = 0
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for _ in range(rounds):
        with a:
            x = cp.full(n, 7.0, dtype=cp.float32)
        a.synchronize()
        with b:
            out = cp.empty(n, dtype=cp.float32)  # B is current at an allocation: the streams check sees it
            k.copy(x, out)  # reads x late, on B
        if record:
            cupy_memstrat.record_stream(x, b)
        with a:
            del x
            z = cp.zeros(n, dtype=cp.float32)
        b.synchronize()
        a.synchronize()
        bad += int(cp.count_nonzero(out != 7.0))
        del out, z
    return bad


_PER_THREAD_MAIN = textwrap.dedent("""
    import json, sys, threading
    import cupy as cp
    from cupy_memstrat.bench import streams as S
    k = S.Kernels(cp)
    out = {}
    for spec in sys.argv[1:]:
        s = S.install(cp, spec)
        out[spec] = S.per_thread_rounds(cp, k)
        S.release(cp, s)
    print(json.dumps(out))
""")


def per_thread_rounds(cp, k: Kernels, rounds: int = 5, n: int = N) -> int:
    """In a process with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``."""
    bad = 0
    for _ in range(rounds):
        ready, done = threading.Event(), threading.Event()

        def writer():
            x = cp.empty(n, dtype=cp.float32)
            k.fill(x, 5.0)  # on this thread's per-thread default stream
            del x
            ready.set()
            done.wait()
            cp.cuda.get_current_stream().synchronize()

        t = threading.Thread(target=writer)
        t.start()
        ready.wait()
        y = cp.zeros(n, dtype=cp.float32)  # the main thread's per-thread default stream
        cp.cuda.get_current_stream().synchronize()
        done.set()
        t.join()
        cp.cuda.Device().synchronize()
        bad += int(cp.count_nonzero(y))
        del y
    return bad


def per_thread(specs, timeout: float = 300) -> dict:
    """``{spec: wrong elements}`` of the per-thread pattern, in a subprocess
    with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``."""
    env = dict(os.environ, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    r = subprocess.run([sys.executable, "-c", _PER_THREAD_MAIN, *specs], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"the per-thread pattern failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def checks_findings(cp, k: Kernels, rounds: int = 5) -> dict:
    """``other-reader`` without record_stream under ``pool`` with
    ``check="streams"``: the findings, and the wrong elements."""
    from .. import checks

    s = install(cp, "pool", check="streams", on_finding="record")
    mark = checks.mark()
    try:
        bad = other_reader(cp, k, rounds)
        found = [f.kind for f in checks.findings(mark)]
    finally:
        release(cp, s)
    return {"wrong_elements": bad, "findings": len(found), "kinds": sorted(set(found))}


def run(*, rounds: int = 5, progress=None, allocators=ALLOCATORS) -> dict:
    """Every pattern under every allocator; the report.

    Raises:
        NoDeviceError, CuPyNotInstalledError: nothing to measure on.
    """
    from ..info import collect
    from .alloc import require_real_gpu

    require_real_gpu()
    import cupy as cp

    say = progress or (lambda msg: None)
    k = Kernels(cp)
    prev = cp.cuda.get_allocator()
    results: dict = {p: {} for p in PATTERNS}
    try:
        for spec in allocators:
            for pattern, fn in (
                ("other-stream", lambda: other_stream(cp, k, rounds)),
                ("freed-elsewhere", lambda: freed_elsewhere(cp, k, rounds)),
                ("freed-by-gc", lambda: freed_elsewhere(cp, k, rounds, by_gc=True)),
                ("dead-stream", lambda: dead_stream(cp, k, rounds)),
                ("dead-stream-reclaimed", lambda: dead_stream_reclaimed(cp, k, rounds)),
                ("other-reader", lambda: other_reader(cp, k, rounds)),
                ("other-reader+record", lambda: other_reader(cp, k, rounds, record=True)),
            ):
                say(f"{pattern}  {spec}")
                s = install(cp, spec)
                try:
                    results[pattern][spec] = fn()
                finally:
                    release(cp, s)
        say("per-thread (a subprocess)")
        results["per-thread"] = per_thread(list(allocators))
        say("other-reader+checks  pool")
        results["other-reader+checks"] = {"pool": checks_findings(cp, k, rounds)}
    finally:
        cp.cuda.set_allocator(prev)
    return {
        "benchmark": "streams",
        "machine": collect(),
        "params": {"rounds": rounds, "elements": N, "spin_s": SPIN_S,
                   "unit": "wrong elements over all rounds (0: safe)"},
        "results": results,
    }


def format_table(report: dict) -> str:
    res = report["results"]
    specs = [a for a in ALLOCATORS if any(a in res[p] for p in PATTERNS if p != "other-reader+checks")]
    out = [f"streams: wrong elements over {report['params']['rounds']} rounds of "
           f"{report['params']['elements']} (0: safe)"]
    out.append(f"  {'pattern':22s}" + "".join(f"{s:>19s}" for s in specs))
    for p in PATTERNS:
        if p == "other-reader+checks":
            continue
        out.append(f"  {p:22s}" + "".join(f"{res[p].get(s, '-')!s:>19s}" for s in specs))
    c = res.get("other-reader+checks", {}).get("pool")
    if c:
        out.append(f"  other-reader under pool with check='streams': {c['findings']} findings "
                   f"({', '.join(c['kinds']) or 'none'}), {c['wrong_elements']} wrong elements")
    return "\n".join(out)


def progress_printer(stream=None):
    from .alloc import progress_printer as _pp

    return _pp(stream, "streams")
