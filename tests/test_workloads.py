"""bench workloads: the programs' numerics, checked with NumPy / SciPy (no GPU
needed: the same code runs on CuPy on the device), and the measuring loop."""

import math

import numpy as np
import pytest

from cupy_memstrat.bench import workloads as W


def test_cg_poisson_converges_to_the_poisson_solution():
    sp = pytest.importorskip("scipy.sparse", reason="SciPy is not installed")
    import scipy.sparse.linalg as spla

    n = 24
    x = W.cg_poisson(np, sp, n=n, iters=400)
    one_d = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    a = (sp.kron(sp.identity(n), one_d) + sp.kron(one_d, sp.identity(n))).tocsc()
    exact = spla.spsolve(a, np.ones(n * n))
    assert x.shape == (n * n,) and np.allclose(x, exact, rtol=1e-8, atol=1e-10)


def test_fft_convolution_equals_the_direct_circular_convolution():
    out = W.fft_convolution(np, batch=2, size=16, sigma=1.5)
    rng = np.random.RandomState(1)
    images = rng.standard_normal((2, 16, 16)).astype(np.float32)
    k = np.minimum(np.arange(16), 16 - np.arange(16)).astype(np.float32)
    g = np.exp(-0.5 * (k / 1.5) ** 2)
    kernel = np.outer(g, g) / np.outer(g, g).sum()
    direct = np.zeros_like(images, dtype=np.float64)
    for dy in range(16):
        for dx in range(16):
            direct += kernel[dy, dx] * np.roll(images, (dy, dx), axis=(1, 2))
    assert out.dtype == np.float32 and np.allclose(out, direct, atol=1e-5)


def test_kmeans_ends_at_a_fixed_point_of_lloyds_iteration():
    centres = W.kmeans(np, n=20_000, k=4, iters=50)
    rng = np.random.RandomState(2)
    true = rng.uniform(-10, 10, size=(4, 2)).astype(np.float32)
    labels = rng.randint(0, 4, size=20_000)
    pts = true[labels] + rng.standard_normal((20_000, 2)).astype(np.float32)  # the workload's points
    nearest = ((pts[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
    means = np.stack([pts[nearest == j].mean(axis=0) for j in range(4)])
    assert centres.shape == (4, 2) and centres.dtype == np.float32
    assert np.allclose(centres, means, atol=1e-4)  # each centre is the mean of its points
    first = pts[:4]
    inertia = lambda c: ((pts[:, None, :] - c[None]) ** 2).sum(axis=2).min(axis=1).sum()  # noqa: E731
    assert inertia(centres) < 0.5 * inertia(first)


def test_monte_carlo_matches_black_scholes():
    price, stderr = W.monte_carlo(np, paths=200_000, steps=16)
    s0, k, r, v, t = 100.0, 105.0, 0.03, 0.2, 1.0
    d1 = (math.log(s0 / k) + (r + v * v / 2) * t) / (v * math.sqrt(t))
    d2 = d1 - v * math.sqrt(t)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    bs = s0 * cdf(d1) - k * math.exp(-r * t) * cdf(d2)
    assert abs(price - bs) < 4 * stderr and stderr < 0.05


@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 4 * 1500])
def test_managed_large_sums_exactly(nbytes):
    assert float(W.managed_large(np, nbytes=nbytes, chunk=1 << 16)) == W.expected_managed_large(nbytes)


def test_multi_stream_sums_each_streams_pipeline():
    n, stages = 4096, 3
    got = W.multi_stream(np, streams=2, stages=stages, n=n)
    for i in range(2):
        want = 0.0
        for stage in range(stages):
            a = np.arange(n, dtype=np.float32) * np.float32(i + 1) + np.float32(stage)
            want += float((np.sqrt(a * a + np.float32(1)) - a).sum(dtype=np.float64))
        assert got[i] == want
    assert got.dtype == np.float64 and got.shape == (2,)
    assert "multi-stream" in W.WORKLOADS


class _Strategy:
    """Enough of a strategy for the measuring loop: per-device peaks."""

    class backend:
        @staticmethod
        def device_count():
            return 1

    def __init__(self, peak):
        self.peak, self.resets = peak, 0

    def reset_peak(self, d):
        self.resets += 1

    def stats(self, d):
        from types import SimpleNamespace

        return SimpleNamespace(peak_bytes_in_use=self.peak, peak_bytes_reserved=2 * self.peak)


def test_the_measuring_loop_times_checks_and_reports_peaks():
    active, released = [], []
    s = _Strategy(peak=4096)
    paths = [("base", lambda: active.append("base"), None, lambda: released.append("base")),
             ("mine", lambda: active.append("mine"), s, lambda: released.append("mine")),
             ("noisy", lambda: active.append("noisy"), None, None)]

    def prog(xp, sp, scale=1.0):
        return xp.arange(4.0) * (1.0 + (1e-3 if active[-1] == "noisy" else 0.0)) * scale

    res = W.measure(np, None, paths, {"prog": (prog, {"scale": 2.0})}, rounds=3, sync=lambda: None,
                    to_host=np.asarray, say=lambda m: None, stats=lambda: {"pool_total_bytes_after": 7},
                    min_sample_s=0.0)
    rows = res["prog"]
    # warm-up under each, one calibration run under the first, then the rounds in rotated order
    assert active == ["base", "mine", "noisy", "base",
                      "base", "mine", "noisy", "mine", "noisy", "base", "noisy", "base", "mine"]
    assert released == ["base", "mine"] and s.resets == 3  # each cache given back once, at the end
    assert rows["base"]["check"] == {"identical": True, "max_rel_diff": 0.0, "reference": True}
    assert rows["mine"]["check"] == {"identical": True, "max_rel_diff": 0.0}
    assert (rows["noisy"]["check"]["identical"] is False
            and rows["noisy"]["check"]["max_rel_diff"] == pytest.approx(1e-3))
    assert rows["mine"]["peak_bytes_in_use"] == 4096 and rows["mine"]["peak_bytes_reserved"] == 8192
    assert rows["base"]["pool_total_bytes_after"] == 7 and len(rows["base"]["runs"]) == 3
    assert rows["base"]["value"] == [0.0, 2.0, 4.0, 6.0] and rows["base"]["ratio_to_first"] == 1.0
    text = W.format_table({"params": {"descriptions": {"prog": "a test"}}, "results": res})
    assert ("prog: a test" in text and "reference" in text and "identical" in text
            and "differs (max rel 1.00e-03)" in text)


class _Clock:
    """A clock that each program run moves on by its path's cost."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_short_program_is_repeated_within_a_sample_and_timed_per_run():
    clock, active, runs = _Clock(), [], []
    cost = {"fast": 0.002, "slow": 0.004}
    paths = [(name, lambda name=name: active.append(name), None, None) for name in cost]

    def prog(xp, sp):
        clock.t += cost[active[-1]]
        runs.append(active[-1])
        return xp.zeros(1)

    rows = W.measure(np, None, paths, {"p": (prog, {})}, rounds=2, sync=lambda: None, to_host=np.asarray,
                     say=lambda m: None, min_sample_s=0.02, clock=clock)["p"]
    assert rows["fast"]["reps"] == 10  # 0.02 s / 0.002 s per run, from the first path's calibration run
    assert runs.count("slow") == 1 + 2 * 10 and runs.count("fast") == 1 + 1 + 2 * 10
    assert rows["fast"]["seconds"] == pytest.approx(0.002) and rows["slow"]["seconds"] == pytest.approx(0.004)
    assert rows["slow"]["ratio_to_first"] == pytest.approx(2.0)


def test_the_ratio_in_rounds_cancels_the_hosts_drift_between_rounds():
    # The host's speed changes from round to round (1, 3, 1.5, 2.5, 0.9 times slower), "b" costs
    # 1.04x "a" in the same round, and one sample of "a" hits a hiccup (twice as slow). The ratio
    # of the medians falls to 0.62; the median of the rounds' ratios stays 1.04.
    clock, active = _Clock(), []
    cost = {"a": 0.01, "b": 0.0104}
    speeds, timed = [1.0, 3.0, 1.5, 2.5, 0.9], {"a": 0, "b": 0}
    paths = [(name, lambda name=name: active.append(name), None, None) for name in cost]

    def prog(xp, sp):
        name = active[-1]
        if not hasattr(prog, "calls"):
            prog.calls = 0
        prog.calls += 1
        if prog.calls <= 3:  # the warm-ups and the calibration run are not timed
            return xp.zeros(1)
        r = timed[name]
        timed[name] += 1
        clock.t += cost[name] * speeds[r] * (2.0 if (name, r) == ("a", 2) else 1.0)
        return xp.zeros(1)

    rows = W.measure(np, None, paths, {"p": (prog, {})}, rounds=5, sync=lambda: None, to_host=np.asarray,
                     say=lambda m: None, min_sample_s=0.0, clock=clock)["p"]
    rr = rows["b"]["ratio_in_rounds"]
    assert rr["per_round"] == pytest.approx([1.04, 1.04, 0.52, 1.04, 1.04])
    assert rr["median"] == pytest.approx(1.04) and rr["q1"] == pytest.approx(1.04) and rr["q3"] == pytest.approx(1.04)
    assert rows["a"]["ratio_in_rounds"]["median"] == 1.0
    assert rows["b"]["ratio_to_first"] == pytest.approx(0.624)
    text = W.format_table({"params": {"descriptions": {"p": "drift"}}, "results": {"p": rows}})
    assert "1.04x [1.04-1.04]" in text


def test_a_cold_workload_starts_every_sample_with_the_cache_given_back():
    events = []
    paths = [(name, lambda name=name: events.append(("use", name)), None,
              lambda name=name: events.append(("release", name))) for name in ("a", "b")]

    def big(xp, sp):
        events.append(("run",))
        return xp.ones(2)

    rows = W.measure(np, None, paths, {"big": (big, {})}, rounds=2, sync=lambda: None, to_host=np.asarray,
                     say=lambda m: None, cold=("big",), min_sample_s=10.0)["big"]
    assert rows["a"]["reps"] == 1  # cold: one run per sample, however short
    # every run (warm-ups included) is followed by its path's release, before anything else runs
    runs = [i for i, e in enumerate(events) if e == ("run",)]
    assert len(runs) == 2 + 2 * 2
    assert all(events[i + 1][0] == "release" and events[i - 1] == ("use", events[i + 1][1]) for i in runs)
    assert events[-1][0] == "release"


def test_run_refuses_bad_arguments_before_needing_a_gpu():
    with pytest.raises(ValueError, match="unknown workload 'nbody'; workloads: cg-poisson, fft-convolution"):
        W.run(only=["nbody"])
    with pytest.raises(ValueError, match=r"scale: expected a number in \(0, 1\], got 2"):
        W.run(scale=2)
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; available: async"):
        W.run(strategies=["pool", "nope"])
    with pytest.raises(ValueError, match=r"strategies: each spec once, got \['pool', 'pool'\]"):
        W.run(strategies=["pool", "pool"])
    with pytest.raises(ValueError, match=r"pool: option route: expected one of 'wrap', 'direct', got 'sideways'"):
        W.run(strategies=["pool:route=sideways"])
    with pytest.raises(ValueError, match=r"min_sample_s: expected seconds in \[0, 10\], got -1"):
        W.run(min_sample_s=-1)
    with pytest.raises(ValueError, match=r"only: expected distinct workload names, at least one, got \[\]"):
        W.run(only=[])


def test_the_default_paths_are_this_packages_strategies_and_pools_other_route():
    names, specs = W.check_args()
    assert names == list(W.WORKLOADS)
    assert specs[-3:] == ["managed:prefetch=on_new", "managed:prefetch=on_alloc", "pool:route=wrap"]
    assert {"device", "managed", "async", "pool"} <= set(specs) and not {"rmm", "torch"} & set(specs)


@pytest.mark.parametrize("ref, got, want", [
    ([1.0, float("nan")], [1.0, float("nan")], {"identical": True, "max_rel_diff": 0.0}),
    (np.array([2**62], dtype=np.int64), np.array([2**62 + 1], dtype=np.int64),
     {"identical": False, "max_rel_diff": 1 / 2**62}),
    ([0.0, 0.0], [0.0, 1e-3], {"identical": False, "max_rel_diff": None, "max_abs_diff": 1e-3,
                               "why": "the reference is all zeros"}),
    ([1.0, 2.0], [1.0, 2.5], {"identical": False, "max_rel_diff": 0.25}),
])
def test_results_are_compared_bit_for_bit_nan_equal_and_integers_exactly(ref, got, want):
    assert W._compare(ref, got) == want


def test_the_measuring_loop_refuses_what_it_cannot_measure():
    prog = {"p": (lambda xp, sp: xp.zeros(1), {})}
    path = ("a", lambda: None, None, None)
    kw = dict(sync=lambda: None, to_host=np.asarray, say=lambda m: None)
    with pytest.raises(ValueError, match="rounds: expected an int >= 1, got 0"):
        W.measure(np, None, [path], prog, rounds=0, **kw)
    with pytest.raises(ValueError, match="paths: expected at least one"):
        W.measure(np, None, [], prog, rounds=1, **kw)
    with pytest.raises(ValueError, match=r"each label must be unique, got \['a', 'a'\]"):
        W.measure(np, None, [path, path], prog, rounds=1, **kw)
    with pytest.raises(ValueError, match="min_sample_s: expected seconds >= 0, got nan"):
        W.measure(np, None, [path], prog, rounds=1, min_sample_s=float("nan"), **kw)


def test_page_faults_are_reported_per_run_like_the_time():
    clock = _Clock()

    class Faults:
        def start(self):
            self.runs0 = len(runs)

        def stop(self):
            return {"gpu_faults": 7 * (len(runs) - self.runs0), "bytes_htod": 0}

    runs = []

    def prog(xp, sp):
        clock.t += 0.001
        runs.append(1)
        return xp.zeros(1)

    rows = W.measure(np, None, [("a", lambda: None, None, None)], {"p": (prog, {})}, rounds=2, sync=lambda: None,
                     to_host=np.asarray, say=lambda m: None, faults=Faults(), min_sample_s=0.01, clock=clock)["p"]
    assert rows["a"]["reps"] == 10 and rows["a"]["faults"] == {"gpu_faults": 7, "bytes_htod": 0}


def test_the_ratio_in_rounds_leaves_out_rounds_without_a_reference_time():
    rr = W._ratio_in_rounds([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 0.0, 1.0])
    assert rr["median"] == 2.0 and rr["q1"] == 1.5 and rr["q3"] == 3.0
    assert rr["per_round"][2] != rr["per_round"][2]  # NaN kept in the rounds' list
    assert W._ratio_in_rounds([1.0], [0.0])["median"] != W._ratio_in_rounds([1.0], [0.0])["median"]  # all NaN
    with pytest.raises(ValueError, match="one sample per round for both paths, got 2 and 3"):
        W._ratio_in_rounds([1.0, 2.0], [1.0, 1.0, 1.0])
