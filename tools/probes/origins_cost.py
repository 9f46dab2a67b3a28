"""What ``track_origins`` costs per allocation (issue 21): off, 1, 8 and 32
frames, from a caller 40 Python frames deep (as a test or a library call
stack is), side by side in interleaved rounds; median microseconds per
alloc+free pair and the cost over ``off``.

On a GPU (the real backend), pairs go through ``cupy.cuda.alloc`` under the
``device`` strategy. Without one (``--fake``, or no CUDA), through the
strategy's ``raw_malloc`` / ``raw_free`` on the fake backend: the fake's
"CUDA calls" are not the GPU's, but the extra cost of tracking (the stack
walk and the interning) is the same Python code, measured on this CPU.

Usage: python tools/probes/origins_cost.py [--fake] [OUT.json]
"""

import argparse
import json
import platform
import statistics
import sys
import time

import cupy_memstrat
from cupy_memstrat.info import collect

DEPTH = 40
N = 20000
ROUNDS = 7
SETTINGS = (False, True, 8, 32)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fake", action="store_true", help="the fake backend (also taken where there is no GPU)")
    p.add_argument("out", nargs="?", help="write the report here as JSON")
    args = p.parse_args(argv)
    fake, out = args.fake, args.out
    if not fake:
        try:
            from cupy_memstrat.cuda import get_backend

            get_backend()
        except Exception as exc:  # noqa: BLE001 - no CUDA here: measure on the fake backend
            print(f"no GPU ({str(exc).split(';')[0]}): measuring on the fake backend", file=sys.stderr)
            fake = True
    backend = None
    if fake:
        from cupy_memstrat.testing import FakeBackend

        backend = FakeBackend(memory="1GiB")
    strategies = {t: cupy_memstrat.create("device", backend=backend, track_origins=t) for t in SETTINGS}
    if fake:
        def pairs(s, n):
            m, f = s.raw_malloc, s.raw_free
            for _ in range(n):
                f(m(512))
    else:
        import cupy

        def pairs(s, n):
            cupy.cuda.set_allocator(s.cupy_allocator())
            alloc = cupy.cuda.alloc
            for _ in range(n):
                alloc(512)
            cupy.cuda.set_allocator(None)

    def deep(k, fn):  # a caller DEPTH frames deep: every frame is outside CuPy and cupy_memstrat
        return fn() if k == 0 else deep(k - 1, fn)

    samples = {t: [] for t in SETTINGS}
    for r in range(ROUNDS):
        order = list(SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)])
        for t in order:
            s = strategies[t]
            deep(DEPTH, lambda: pairs(s, 500))  # warm
            t0 = time.perf_counter()
            deep(DEPTH, lambda: pairs(s, N))
            samples[t].append((time.perf_counter() - t0) / N * 1e6)
    med = {str(t): statistics.median(v) for t, v in samples.items()}
    off = med["False"]
    report = {
        "probe": "origins_cost",
        "backend": "fake (raw_malloc/raw_free; the tracking cost is this CPU's)" if fake else "cuda (cupy.cuda.alloc)",
        "machine": collect(backend) if fake else collect(),
        "cpu": platform.processor() or platform.machine(),
        "params": {"caller_depth": DEPTH, "pairs_per_sample": N, "rounds": ROUNDS, "size": 512},
        "median_us_per_pair": med,
        "cost_over_off_us": {k: v - off for k, v in med.items()},
        "ratio_to_off": {k: v / off for k, v in med.items()},
        "samples_us": {str(t): v for t, v in samples.items()},
    }
    text = json.dumps(report, indent=1, default=str)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    for k in med:
        print(f"track_origins={k:>5}: {med[k]:7.3f} us a pair, +{med[k] - off:6.3f} us over off")


if __name__ == "__main__":
    main(sys.argv[1:])
