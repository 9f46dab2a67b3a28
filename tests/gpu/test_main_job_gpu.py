"""The pieces of the main job on real CuPy: memory timelines, `run`, and the
workload programs (small sizes: a functional check, not a benchmark)."""

import json
import os
import subprocess
import sys

import pytest

import cupy_memstrat
from cupy_memstrat import history


@pytest.fixture
def no_recording(monkeypatch):
    monkeypatch.setattr(history, "_active", None)
    monkeypatch.setattr(history, "_last", None)
    yield
    if history._active is not None:
        cupy_memstrat.record_history(False)


@pytest.mark.parametrize("name", ["device", "managed", "async", "pool"])
def test_record_history_on_the_gpu(cp, no_recording, tmp_path, name):
    s = cupy_memstrat.use(name)
    cupy_memstrat.record_history()
    assert cupy_memstrat.current() is s
    a = cp.arange(1 << 20, dtype=cp.float32)  # 4 MiB
    b = a * 2
    assert float(b[-1]) == 2.0 * ((1 << 20) - 1)
    del a, b
    doc = cupy_memstrat.snapshot(str(tmp_path / "s.json"))
    sizes = [(e["action"], e["size"]) for e in doc["events"] if e["size"] == 4 << 20]
    assert sizes.count(("alloc", 4 << 20)) == 2 and sizes.count(("free", 4 << 20)) == 2
    assert all(e["stream"] is not None for e in doc["events"])
    cupy_memstrat.record_history(False)
    assert cupy_memstrat.current() is s and cp.cuda.get_allocator() is s.cupy_allocator()
    pytest.importorskip("matplotlib")
    from cupy_memstrat.bench.plot import plot

    plot(json.loads((tmp_path / "s.json").read_text()), str(tmp_path / "t.png"))


def test_run_on_the_gpu(tmp_path):
    (tmp_path / "job.py").write_text(
        "import cupy, cupy_memstrat\n"
        "x = cupy.arange(1000, dtype=cupy.float64)\n"
        "assert float(x.sum()) == 499500.0\n"
        "print(cupy_memstrat.current().name, cupy_memstrat.current().config['prefetch'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUPY_MEMSTRAT_BACKEND"}
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "run", "-s", "managed:prefetch=on_alloc", "job.py"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "managed on_alloc" and "peak in use" in r.stderr


def test_the_workload_programs_run_under_a_strategy(cp):
    from cupy_memstrat.bench import workloads

    report = workloads.run(rounds=1, strategies=["device"], scale=0.01, min_sample_s=0.01)
    res = report["results"]
    assert set(res) == set(workloads.WORKLOADS)
    for name, rows in res.items():
        assert set(rows) == {"cupy-default", workloads.CONTROL, "device"}, name
        assert rows["device"]["peak_bytes_in_use"] > 0, name
    for name in ("cg-poisson", "fft-convolution", "monte-carlo", "managed-large"):
        assert res[name]["device"]["check"]["identical"], (name, res[name]["device"]["check"])
        assert res[name][workloads.CONTROL]["check"]["identical"], name  # CuPy's pool again: the same result
    assert res["kmeans"]["device"]["check"]["max_rel_diff"] < 1e-4
    assert all(r["check"]["equals_expected"] for r in res["managed-large"].values())
