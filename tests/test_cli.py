import json
import subprocess
import sys

import pytest

from cupy_memstrat import cli
from cupy_memstrat.info import collect, format_report
from cupy_memstrat.testing import FakeBackend


def _run(*args):
    return subprocess.run([sys.executable, "-m", "cupy_memstrat", *args], capture_output=True, text=True)


def _has_gpu():
    try:
        from cupy_memstrat.cuda import get_backend

        get_backend()
        return True
    except Exception:
        return False


def test_info_reports_a_fake_device():
    text = format_report(collect(FakeBackend(devices=2, memory="4GiB")))
    assert "device 1: Fake NVIDIA H200, compute capability 9.0" in text
    assert "memory: 4.0 GiB total, 4.0 GiB free" in text
    assert "concurrentManagedAccess 1, pageableMemoryAccess 0, memoryPoolsSupported 1" in text
    assert "CUDA driver API 13.0 (13000)" in text
    assert "page-fault counters: the fake backend's simulated counters (exact)" in text
    assert "device: one cudaMalloc per allocation" in text


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present")
def test_info_without_gpu_says_why_and_fails():
    r = _run("info")
    assert r.returncode == 1
    assert "GPU: " in r.stdout and ("no CUDA device is available" in r.stdout or "CuPy is not installed" in r.stdout)
    r = _run("info", "--json")
    assert r.returncode == 1 and "error" in json.loads(r.stdout)


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present")
def test_bench_without_gpu_stops_at_once_with_a_clear_message():
    r = _run("bench", "alloc")
    assert r.returncode == 2
    assert "bench alloc needs a CUDA device" in r.stderr


def test_bad_arguments_are_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "alloc", "--rounds", "0"])
    assert exc.value.code == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "nosuchgroup"])
    assert "invalid choice: 'nosuchgroup'" in capsys.readouterr().err


def test_bench_refuses_an_unwritable_json_path_before_running(tmp_path, capsys):
    assert cli.main(["bench", "alloc", "--json", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "cannot write --json" in capsys.readouterr().err
    assert cli.main(["bench", "alloc", "--json", str(tmp_path)]) == 2


def test_bench_refuses_the_fake_backend_clearly(monkeypatch, capsys):
    from cupy_memstrat import cuda as C
    from cupy_memstrat.cli import main

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake")
    monkeypatch.setattr(C, "_backend", None)
    assert main(["bench", "managed", "--quiet"]) == 2
    assert "benchmarks time a real GPU, and this process runs on the fake backend" in capsys.readouterr().err


def test_a_bad_backend_variable_is_reported_not_a_traceback(monkeypatch):
    from cupy_memstrat import cuda as C

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "bogus")
    monkeypatch.setattr(C, "_backend", None)
    report = collect()
    assert "CUPY_MEMSTRAT_BACKEND='bogus': unknown backend" in report["error"]
