"""``bench plugin``: what the pytest plugin (pytest_gpumem) costs per test, with and without
its reading of the driver beside the strategy's count.

One file of small GPU tests (each makes a 4 MiB array, doubles it and reads one element back)
runs in a pytest subprocess under three settings, in rotated order each round:

* ``plain``: pytest without the plugin (``-p no:gpumem``);
* ``measured``: ``--gpumem --gpumem-leaks=fail --gpumem-outside=off``: the strategy's
  count only;
* ``measured+driver``: ``--gpumem --gpumem-leaks=fail``: the same with the driver's reading
  (``cudaMemGetInfo`` before and after each test, the libraries' counters, the leak check on
  memory outside the strategy).

The cost per test is a setting's wall time less ``plain``'s in the same round, over the
number of tests (the median over rounds); ``plain``'s wall time over the number of tests is
given beside it, an upper bound on a small test's own time (it includes pytest's start-up).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["CONFIGS", "run", "format_table", "progress_printer"]

N_TESTS = 200

#: setting -> pytest arguments
CONFIGS = {
    "plain": ["-p", "no:gpumem"],
    "measured": ["--gpumem", "--gpumem-leaks=fail", "--gpumem-outside=off"],
    "measured+driver": ["--gpumem", "--gpumem-leaks=fail", "--gpumem-outside=on"],
}

_TESTS = """
import cupy
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_step(i):
    x = cupy.ones(1 << 20, dtype=cupy.float32)
    x *= 2
    assert float(x[i]) == 2.0
"""


def _session(path: str, args: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM")}
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, path],
                       capture_output=True, text=True, env=env, cwd=os.path.dirname(path))
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        raise RuntimeError(f"bench plugin: pytest {' '.join(args)} exited {r.returncode}:\n{tail}")
    return dt


def run(*, rounds: int = 5, progress=None, n_tests: int = N_TESTS) -> dict:
    """The report: wall seconds per setting and round, the cost per test over ``plain``.

    Raises:
        NoDeviceError: no real GPU (the simulated one runs no kernel).
        RuntimeError: a pytest session failed (its output's end is in the message).
    """
    from ..info import collect
    from .alloc import require_real_gpu

    require_real_gpu()
    say = progress or (lambda msg: None)
    names = list(CONFIGS)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="memstrat-bench-plugin-") as d:
        path = os.path.join(d, "test_small_gpu_steps.py")
        with open(path, "w") as f:
            f.write(_TESTS.format(n=n_tests))
        say("warm-up (kernel cache)")
        _session(path, CONFIGS["plain"])
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                seconds[name].append(_session(path, CONFIGS[name]))
            say(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names))
    plain = seconds["plain"]
    per_test = {n: statistics.median((s - p) / n_tests for s, p in zip(seconds[n], plain)) for n in names[1:]}
    ratio = {n: statistics.median(s / p for s, p in zip(seconds[n], plain)) for n in names[1:]}
    return {
        "benchmark": "plugin",
        "machine": collect(),
        "params": {"rounds": rounds, "tests": n_tests, "configs": CONFIGS,
                   "test": "a 4 MiB array made, doubled and one element read back"},
        "seconds": seconds,
        "plain_seconds_per_test": statistics.median(plain) / n_tests,
        "cost_per_test_seconds": per_test,
        "ratio_to_plain": ratio,
    }


def format_table(report: dict) -> str:
    p = report["params"]
    lines = [f"pytest_gpumem's cost per test: {p['tests']} tests ({p['test']}), {p['rounds']} rounds; wall s: the "
             "median of each setting's sessions; per test over plain and x plain: the medians of each round's "
             "difference and ratio to plain (a round's settings run one after another)",
             f"  {'setting':<17}{'wall s':>8}  {'per test over plain':>20}  {'x plain':>8}"]
    for name, secs in report["seconds"].items():
        med = statistics.median(secs)
        if name == "plain":
            lines.append(f"  {name:<17}{med:>8.2f}  {'-':>20}  {'1.00':>8}")
            continue
        cost = report["cost_per_test_seconds"][name] * 1e3
        lines.append(f"  {name:<17}{med:>8.2f}  {cost:>+17.3f} ms  {report['ratio_to_plain'][name]:>8.2f}")
    lines.append(f"  plain, per test (pytest's start-up included): {report['plain_seconds_per_test'] * 1e3:.2f} ms")
    return "\n".join(lines)


def progress_printer(stream=None):
    from .alloc import progress_printer as _p

    return _p(stream, "plugin")
