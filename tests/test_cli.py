import importlib.util
import json
import os
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
        from cupy_memstrat.backends import get_backend

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


def test_the_console_script_calls_itself_by_its_name():
    import shutil

    exe = shutil.which("cupy-memstrat")
    if exe is None:
        pytest.skip("the cupy-memstrat console script is not on PATH")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: cupy-memstrat ")
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "--help"], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("usage: python -m cupy_memstrat ")


def test_info_says_which_hot_path_each_strategy_runs(monkeypatch):
    """Issue 16: info said 'allocation hot path: c' while async ran the Python one (issue 18 gave
    async a C path: each strategy's report must match what an instance of it runs)."""
    import cupy_memstrat
    from cupy_memstrat.strategies import _support

    report = collect(FakeBackend())
    per = report["hot_path"]["strategies"]
    for name in ("async", "device", "managed", "pool"):
        s = cupy_memstrat.create(name, backend=FakeBackend())
        s.raw_free(s.raw_malloc(512))  # builds its hot path
        assert per[name] == s.hot_path == ("c" if _support.c_hotpath is not None else "python"), name
        s.close()
    if _support.c_hotpath is not None:
        assert "per strategy: async c, device c, expandable c, managed c, pool c" in format_report(report)
    monkeypatch.setenv(_support.HOT_PATH_ENV, "python")
    assert set(collect(FakeBackend())["hot_path"]["strategies"].values()) == {"python"}


def test_info_says_which_route_pool_takes(monkeypatch):
    """pool's route falls back to wrap without the C hot path or CuPy's PooledMemory.__dict__:
    info says which one a pool made now takes, and why."""
    import cupy_memstrat
    from cupy_memstrat.strategies import _support, cupy_pool

    pytest.importorskip("cupy", reason="CuPy is not installed")
    pr = collect(FakeBackend())["hot_path"]["pool_route"]  # a pool made on the simulated GPU
    assert pr["route"] == "wrap" and "the simulated GPU has no CuPy pool" in pr["reason"]
    assert cupy_memstrat.create("pool", backend=FakeBackend()).route == pr["route"]
    if _support.c_hotpath is not None:
        assert cupy_pool.route_status("c") == {"route": "direct", "reason": "CuPy gets its pool's own MemoryPointer"}
    monkeypatch.setattr(cupy_pool, "_pooled_memory_takes_attributes", lambda: False)
    assert cupy_pool.route_status("c") == {
        "route": "wrap", "reason": "this CuPy's PooledMemory has no __dict__ for the direct route's token"}
    monkeypatch.setenv(_support.HOT_PATH_ENV, "python")
    assert cupy_pool.route_status("python")["route"] == "wrap"


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present")
def test_info_without_gpu_says_why_and_fails():
    r = _run("info")
    assert r.returncode == 1
    assert "GPU: " in r.stdout and ("no CUDA device is available" in r.stdout or "CuPy is not installed" in r.stdout)
    r = _run("info", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and "error" in doc
    pr = doc["hot_path"].get("pool_route")
    assert pr is None or pr["route"] == "wrap" or pr["reason"].startswith("on a CUDA device (")


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
    from cupy_memstrat import backends as C
    from cupy_memstrat.cli import main

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake")
    monkeypatch.setattr(C, "_backend", None)
    assert main(["bench", "managed", "--quiet"]) == 2
    assert "benchmarks time a real GPU, and this process runs on the fake backend" in capsys.readouterr().err


def test_a_bad_backend_variable_is_reported_not_a_traceback(monkeypatch):
    from cupy_memstrat import backends as C

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "bogus")
    monkeypatch.setattr(C, "_backend", None)
    report = collect()
    assert "CUPY_MEMSTRAT_BACKEND='bogus': unknown backend" in report["error"]


def _run_fake(tmp_path, *args, env=None):
    import os

    e = dict(os.environ, CUPY_MEMSTRAT_BACKEND="fake", **(env or {}))
    if not env or "CUPY_MEMSTRAT" not in env:
        e.pop("CUPY_MEMSTRAT", None)
    return subprocess.run([sys.executable, "-m", "cupy_memstrat", *args], capture_output=True, text=True,
                          env=e, cwd=tmp_path)


SCRIPT = """
import sys, cupy, cupy_memstrat
x = cupy.empty(1000, dtype=cupy.float32)
print("strategy", cupy_memstrat.current().name, cupy_memstrat.current().config.get("prefetch"), "argv", sys.argv)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def test_run_executes_a_script_under_a_strategy_with_its_arguments(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    r = _run_fake(tmp_path, "run", "--strategy", "managed:prefetch=on_alloc", "job.py", "3", "--flag")
    assert r.returncode == 3, r.stderr  # the script's exit status
    assert "strategy managed on_alloc argv ['job.py', '3', '--flag']" in r.stdout
    assert "cupy_memstrat: managed:prefetch=on_alloc on device 0: peak in use 4.0 KiB, peak reserved 2.0 MiB, " \
           "1 allocation, 0 live at exit" in r.stderr
    r = _run_fake(tmp_path, "run", "-q", "job.py", env={"CUPY_MEMSTRAT": "device"})
    assert r.returncode == 0 and "strategy device" in r.stdout and r.stderr == ""


def test_run_a_module(tmp_path):
    (tmp_path / "jobmod.py").write_text(SCRIPT)
    r = _run_fake(tmp_path, "run", "-s", "device", "-m", "jobmod", "0", "-x")
    assert r.returncode == 0, r.stderr
    assert "strategy device None argv [" in r.stdout and "jobmod.py', '0', '-x']" in r.stdout  # as python -m sets it


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["run", "job.py"], None,
         "run: no strategy: pass --strategy SPEC (e.g. managed:prefetch=on_new) or set CUPY_MEMSTRAT"),
        (["run", "-s", "bogus", "job.py"], None, "run: --strategy='bogus': unknown strategy 'bogus'; available:"),
        (["run", "job.py"], {"CUPY_MEMSTRAT": "device:x=1"}, "run: environment variable CUPY_MEMSTRAT='device:x=1': "),
        (["run", "-s", "device", "missing.py"], None, "run: cannot run 'missing.py': no such file"),
        (["run", "-s", "device"], None, "run: nothing to run"),
        (["run", "-s", "device", "-m"], None, "run: -m takes a module name"),
        (["run", "-s", "device", "-m", "nosuchmodule"], None, "run: cannot run -m 'nosuchmodule': no such module"),
        (["run", "-s", "device", "-m", "nosuch.sub"], None, "run: cannot run -m 'nosuch.sub': no such module"),
        (["run", "-s", "device", "-m", "pkg"], None, "run: cannot run -m 'pkg': it is a package without a __main__"),
        (["run", "-s", "device", "pkg"], None, "run: cannot run 'pkg': a directory, not a script"),
        (["bench", "--rounds", "\u0661", "alloc"], None, "--rounds: expected a positive integer (ASCII digits)"),
        (["bench", "--rounds", "1_0", "alloc"], None, "--rounds: expected a positive integer (ASCII digits)"),
    ],
)
def test_run_refuses_clearly(tmp_path, args, env, message):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    r = _run_fake(tmp_path, *args, env=env)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_run_imports_a_package_only_under_the_strategy(tmp_path):
    """From the second adversarial trial: checking -m imported the package before the strategy was
    installed (and a package whose __init__ raised gave our own traceback)."""
    (tmp_path / "pkgok").mkdir()
    (tmp_path / "pkgok" / "__init__.py").write_text("import cupy_memstrat as cm\nprint('init', cm.current().name)\n")
    (tmp_path / "pkgok" / "__main__.py").write_text("print('main')\n")
    r = _run_fake(tmp_path, "run", "-q", "-s", "device", "-m", "pkgok")
    assert r.returncode == 0 and r.stdout.split() == ["init", "device", "main"], r.stderr
    (tmp_path / "pkgrt").mkdir()
    (tmp_path / "pkgrt" / "__init__.py").write_text("raise RuntimeError('init rt')\n")
    (tmp_path / "pkgrt" / "__main__.py").write_text("")
    r = _run_fake(tmp_path, "run", "-q", "-s", "device", "-m", "pkgrt")
    assert r.returncode == 1 and r.stderr.rstrip().endswith("RuntimeError: init rt")
    assert "cupy_memstrat" not in r.stderr and "Traceback (most recent call last):" in r.stderr


def test_fifos_and_deep_json_are_refused_without_hanging(tmp_path, capsys):
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    for src in (fifo, "/dev/zero"):  # a FIFO would block, /dev/zero never end
        assert cli.main(["plot", str(src), "-o", str(tmp_path / "o.png")]) == 2
        assert "a directory, a FIFO, a socket or a device, not a file" in capsys.readouterr().err
    assert cli.main(["bench", "alloc", "--json", str(fifo)]) == 2
    assert "a FIFO" in capsys.readouterr().err
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert cli.main(["plot", str(deep), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot: cannot read") and "Traceback" not in err


def test_run_shows_the_scripts_traceback_without_ours(tmp_path):
    (tmp_path / "bad.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    r = _run_fake(tmp_path, "run", "-s", "device", "-q", "bad.py")
    assert r.returncode == 1
    assert r.stderr.splitlines()[:2] == ["Traceback (most recent call last):", '  File "bad.py", line 3, in <module>']
    assert (r.stderr.rstrip().endswith("ValueError: boom") and "cupy_memstrat" not in r.stderr
            and "runpy" not in r.stderr)


def test_plot_refuses_a_folder_or_an_empty_output_and_says_when_nothing_is_drawn(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"kind": "memory-history", "version": 1, "events": []}))
    for out in (str(tmp_path), "", str(tmp_path) + "/"):
        assert cli.main(["plot", str(tmp_path / "r.json"), "-o", out]) == 2
        assert "expected an image file path such as 'figure.png'" in capsys.readouterr().err
    assert not (tmp_path.parent / (tmp_path.name + ".png")).exists()
    assert cli.main(["plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "nodir" / "p.png")]) == 2
    assert "the folder" in capsys.readouterr().err and not (tmp_path / "nodir").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert cli.main(["plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "o.png")]) == 2
        assert "nothing to draw: the snapshot holds no allocation or free event" in capsys.readouterr().err


@pytest.mark.parametrize("doc, message", [
    ({"kind": ["x"]}, "no figure for this JSON (it names no benchmark"),
    ([1, 2], "is not a report: expected a JSON object"),
    ({"tests": [{"nodeid": 5, "history": 1}]}, "no test in it has a timeline"),
])
def test_plot_refuses_mangled_reports_with_a_message(tmp_path, capsys, doc, message):
    """Issue 16: these printed tracebacks."""
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert cli.main(["plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _fake_group_run(monkeypatch, seen):
    """bench GROUP without a GPU: the group's run returns a synthetic report, as if on one."""
    from cupy_memstrat.bench import alloc, workloads

    monkeypatch.setattr(alloc, "require_real_gpu", lambda: None)
    report = {"benchmark": "workloads", "params": {"descriptions": {}}, "results": {}}
    monkeypatch.setattr(workloads, "run", lambda **kw: seen.append(kw) or report)
    monkeypatch.setattr(workloads, "format_table", lambda rep: "the table")


def test_a_failed_bench_leaves_an_existing_json_file_as_it_was(tmp_path, monkeypatch, capsys):
    from cupy_memstrat.bench import workloads
    from cupy_memstrat.errors import NoDeviceError

    old = tmp_path / "old.json"
    old.write_text('{"old": 1}')

    def no_gpu(**kw):
        raise NoDeviceError("no CUDA device is available: test")

    monkeypatch.setattr(workloads, "run", no_gpu)
    assert cli.main(["bench", "workloads", "--json", str(old)]) == 2
    assert old.read_text() == '{"old": 1}'
    assert not (tmp_path / "new.json").exists()
    assert cli.main(["bench", "workloads", "--json", str(tmp_path / "new.json")]) == 2
    assert not (tmp_path / "new.json").exists()  # the writability check leaves nothing behind


def test_bench_never_deletes_what_json_names(tmp_path, monkeypatch, capsys):
    seen = []
    _fake_group_run(monkeypatch, seen)
    link = tmp_path / "to-null"
    link.symlink_to("/dev/null")  # reads as size 0, like a device or a pipe
    assert cli.main(["bench", "workloads", "--quiet", "--json", str(link)]) == 0
    assert link.is_symlink()
    out = tmp_path / "w.json"
    assert cli.main(["bench", "workloads", "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["benchmark"] == "workloads"


def test_bench_workloads_takes_strategies_workloads_and_sample_length(monkeypatch, capsys):
    seen = []
    _fake_group_run(monkeypatch, seen)
    assert cli.main(["bench", "workloads", "--quiet", "--strategies", "pool; async:release_threshold=1GiB",
                     "--only", "kmeans,cg-poisson", "--min-sample", "0.5"]) == 0
    assert seen[-1]["strategies"] == ["pool", "async:release_threshold=1GiB"]
    assert seen[-1]["only"] == ["kmeans", "cg-poisson"] and seen[-1]["min_sample_s"] == 0.5
    assert cli.main(["bench", "workloads", "--quiet"]) == 0
    assert not {"strategies", "only", "min_sample_s"} & set(seen[-1])  # run's own defaults
    # refused before the run: nothing was measured
    for argv, message in ((["--only", "nbody"], "unknown workload 'nbody'"),
                          (["--strategies", "pool;nope"], "unknown strategy 'nope'"),
                          (["--min-sample", "20"], "bench workloads: --min-sample: expected seconds in [0, 10], "
                                                   "got 20.0"),
                          (["--strategies", "pool;pool"], "bench workloads: --strategies: each spec once")):
        n = len(seen)
        assert cli.main(["bench", "workloads", "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(seen) == n


def test_options_before_the_group_count_and_out_with_a_group_writes_its_json_there(tmp_path, monkeypatch, capsys):
    seen = []
    _fake_group_run(monkeypatch, seen)
    assert cli.main(["bench", "--rounds", "3", "--quiet", "workloads"]) == 0
    assert seen[-1]["rounds"] == 3 and seen[-1]["progress"] is None
    assert cli.main(["bench", "workloads", "--rounds", "2"]) == 0
    assert seen[-1]["rounds"] == 2 and seen[-1]["progress"] is not None
    assert cli.main(["bench", "workloads"]) == 0
    assert seen[-1]["rounds"] == 5
    for i, argv in enumerate((["--out", str(tmp_path / "x0"), "workloads"],
                              ["workloads", "--out", str(tmp_path / "x1")])):
        assert cli.main(["bench", "--quiet", *argv]) == 0
        doc = json.loads((tmp_path / f"x{i}" / "bench-workloads.json").read_text())
        assert doc["benchmark"] == "workloads"
    n = len(seen)
    assert cli.main(["bench", "workloads", "--out", str(tmp_path / "y"), "--json", str(tmp_path / "y.json")]) == 2
    err = capsys.readouterr().err
    assert "give --out DIR (bench-workloads.json and .png there) or --json PATH, not both" in err and len(seen) == n
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.json").exists()


def test_bench_with_no_group_refuses_an_out_folder_it_cannot_fill_before_running(tmp_path, monkeypatch, capsys):
    from cupy_memstrat.bench import alloc

    monkeypatch.setattr(alloc, "require_real_gpu", lambda: None)
    pytest.importorskip("cupy", reason="CuPy is not installed")
    (tmp_path / "res" / "bench-workloads.json").mkdir(parents=True)
    ran = []
    monkeypatch.setattr(alloc, "run", lambda **kw: ran.append(kw))
    assert cli.main(["bench", "--out", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "bench-workloads.json" in err and not ran
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["bench-workloads.json"]


LAST_FREE_OVERRUNS = """
import numpy as np, cupy, cupy_memstrat
x = cupy.ndarray((1000,), dtype=np.uint8)
cupy_memstrat.current().backend.write(x.data.ptr + 1000, b"\\0")   # a kernel writing past the end
del x                                                              # the script's last act
"""


@pytest.mark.parametrize("spec", ["async:check=all", "device:check=redzone,on_finding=record",
                                  "pool:check=redzone,on_finding=warn"])
def test_run_reports_the_findings_of_the_last_free_and_exits_1(tmp_path, spec):
    (tmp_path / "job.py").write_text(LAST_FREE_OVERRUNS)
    r = _run_fake(tmp_path, "run", "-s", spec, "job.py")
    assert r.returncode == 1, r.stderr
    assert "cupy_memstrat: the checks found 1 problem during the run:" in r.stderr
    assert "[out-of-bounds write]" in r.stderr and "job.py:5" in r.stderr  # the free's line
    r = _run_fake(tmp_path, "run", "-s", spec.split(":")[0], "job.py")  # the control: no checks, nothing said
    assert r.returncode == 0 and "problem" not in r.stderr


def test_run_keeps_the_scripts_own_failure_status_with_findings(tmp_path):
    (tmp_path / "job.py").write_text(LAST_FREE_OVERRUNS + "raise SystemExit(3)\n")
    r = _run_fake(tmp_path, "run", "-s", "async:check=redzone", "job.py")
    assert r.returncode == 3 and "the checks found 1 problem" in r.stderr


def test_run_reports_the_strategy_the_script_installed_too(tmp_path):
    (tmp_path / "job.py").write_text("""
import cupy, cupy_memstrat
x = cupy.empty(1 << 20, dtype=cupy.uint8)
cupy_memstrat.use("device")
y = cupy.empty(151 << 20, dtype=cupy.uint8)
""")
    r = _run_fake(tmp_path, "run", "-s", "pool", "job.py")
    assert r.returncode == 0, r.stderr
    assert "cupy_memstrat: pool (replaced by the script) on device 0: peak in use 1.0 MiB" in r.stderr
    assert "cupy_memstrat: device (installed by the script) on device 0: peak in use 151.0 MiB" in r.stderr


def test_run_checks_the_frees_of_the_arrays_a_script_keeps_to_the_end(tmp_path):
    (tmp_path / "job.py").write_text(LAST_FREE_OVERRUNS.replace("del x", "pass"))
    r = _run_fake(tmp_path, "run", "-s", "async:check=all", "job.py")
    assert r.returncode == 1 and "the checks found 1 problem" in r.stderr, r.stderr


def test_bench_group_out_without_a_gpu_makes_no_folder(tmp_path, monkeypatch, capsys):
    from cupy_memstrat import backends as C
    from cupy_memstrat.cli import main

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake")  # no real GPU, also on a machine with one
    monkeypatch.setattr(C, "_backend", None)
    out = tmp_path / "res"
    assert main(["bench", "plugin", "--out", str(out)]) == 2
    assert "bench plugin needs a CUDA device and CuPy" in capsys.readouterr().err
    assert not out.exists()
