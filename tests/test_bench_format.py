"""The bench tables render every part of a report (no GPU: synthetic numbers)."""

import pytest

from cupy_memstrat.bench import alloc, async_pool
from cupy_memstrat.bench.fragmentation import run as fragmentation_run  # kept: tests replace the module's

MiB = 1 << 20


def _summary(x):
    return {"median_us": x, "min_us": x, "max_us": x, "runs_us": [x]}


def _alloc_report(labels):
    keys = [str(s) for s in alloc.SIZES] + [alloc.WORKLOAD]
    res = {lab: {k: _summary(1.0 + i) for k in keys} for i, lab in enumerate(labels)}
    return {
        "params": {"workload": "w"},
        "results_us": res,
        "ratio_to_cupy_default": {lab: {k: 1.0 for k in keys} for lab in labels},
    }


def _async_report():
    lat = _alloc_report(["cupy-default", "no-pool", "async", "cupy-async"])
    lat["ratios"] = {"async/cupy-async": {"512": 0.5}}
    return {
        "benchmark": "async",
        "machine": {"cuda": {"devices": [{"name": "Fake H200"}]}},
        "params": {"rounds": 1, "loop_bytes": 64 << 20},
        "latency": lat,
        "raw_cuda_floor_us": {"own-pool": {"512": _summary(1.2)}},
        "sync_loop": {
            "results_us": {"async": dict(_summary(3.0), reserved_after_bytes=64 << 20), "no-pool": _summary(90.0)},
            "threshold_0_over_default": 54.0,
        },
        "growth": [{"size": 1, "reserved_bytes": 32 << 20}],
        "trim": {
            "reserved_after_sync": 512 << 20,
            "reserved_after_trim_keep_128MiB": 128 << 20,
            "reserved_after_trim_0": 0,
        },
        "max_size": [{"max_size": 33 << 20, "largest_granted_MiB": 64, "smallest_refused_MiB": 65}],
    }


def test_async_table_has_every_part():
    text = async_pool.format_table(_async_report())
    for needle in ("async/cupy-async: 512 B 0.500x", "own-pool 512 B 1.20", "54.0x slower", "1 B -> 32.0 MiB",
                   "trim() -> 0 B", "33.0 MiB grants up to 64 MiB"):
        assert needle in text


def _managed_report():
    from cupy_memstrat.bench import managed

    lat = _alloc_report(["cupy-default", "no-pool", "managed", "python-floor"])
    rows = {}
    for i, label in enumerate(managed._scenarios()):
        faults = {"gpu_faults": 0 if "prefetch()" in label else 1000, "cpu_faults": 0,
                  "bytes_htod": 1 << 30, "bytes_dtoh": 0}
        rows[label] = {"median_ms": 10.0 + i, "GB_per_s": 5.0, "fraction_of_pinned_copy": 0.5,
                       "speedup_vs_no_hints": 2.0, "faults_median": faults}
    return {
        "benchmark": "managed",
        "machine": {"cuda": {"devices": [{"name": "Fake H200"}]}},
        "latency": lat,
        "first_pass": {"bytes": 1 << 30, "kernel": "x *= 2", "fault_counters": "driver",
                       "pinned_copy": {"GB_per_s": 55.0, "seconds": 0.0195}, "results": rows},
        "read_mostly": {"read_mostly": {"pass_ms": [3500.0, 530.0, 127.0]},
                        "no-hints": {"pass_ms": [200.0, 1.5, 1.3]}, "second_pass_ratio": 353.0},
        "bars": {"latency_managed_over_cupy_pool": {"512": 1.5, "1048576": 1.04},
                 "latency_managed_over_cupy_pool_rounds": {"512": 1.9, "temporaries": 1.02}, "first_pass_speedup": 8.9,
                 "first_pass_fraction_of_pinned_copy": 0.82, "first_pass_gpu_faults_vs_no_hints": 0.0},
    }


def test_managed_table_has_every_part():
    from cupy_memstrat.bench import managed

    text = managed.format_table(_managed_report())
    for needle in ("python-floor", "cpu-init/prefetch=on_alloc+prefetch()", "pinned copy 55.0 GB/s",
                   "second pass 353x slower", "back to back 512 B 1.50x, 1.0 MiB 1.04x",
                   "(medians of the rounds: 512 B 1.90x, temporaries 1.02x)", "8.9x faster than no hints",
                   "0.82x of the pinned copy",
                   "GPU faults 0.00% of no hints"):
        assert needle in text, needle


def test_plot_draws_the_managed_figure_and_refuses_unknown_reports(tmp_path):
    import pytest

    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.bench.plot import plot

    out = tmp_path / "m.png"
    plot(_managed_report(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no figure for benchmark 'mystery'; figures exist for: alloc, async, "
                                         "fragmentation, managed"):
        plot({"benchmark": "mystery"}, str(out))


def test_plot_command_reports_a_bad_file(tmp_path, capsys):
    from cupy_memstrat.cli import main

    assert main(["plot", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "plot: cannot read" in capsys.readouterr().err


def test_alloc_table_shows_device_against_no_pool_both_ways():
    report = _alloc_report(["cupy-default", "no-pool", "device"])
    keys = [str(s) for s in alloc.SIZES] + [alloc.WORKLOAD]
    report["device_vs_no_pool"] = {k: 1.2 for k in keys}
    report["device_vs_no_pool_paired"] = {
        str(s): {"median_ratio": 1.04, "q1": 1.01, "q3": 1.08, "pairs": 21, "iterations": 100} for s in alloc.SIZES
    }
    text = alloc.format_table(report)
    assert "device / no-pool (the table's medians over rounds): 512 B 1.200x" in text
    assert "measured back to back (median of paired ratios [quartiles]): 512 B 1.040x [1.010-1.080], 1.0 MiB" in text


def _streams_report():
    from cupy_memstrat.bench import streams

    res = {p: {a: (0 if a != "managed-one-cache" else 5242880) for a in streams.ALLOCATORS} for p in streams.PATTERNS
           if p != "other-reader+checks"}
    res["other-reader"].update({"managed": 5242880, "async": 5242880, "pool": 5242880, "cupy-default": 5242880})
    res["other-reader+checks"] = {"pool": {"wrong_elements": 5242880, "findings": 5, "kinds": ["cross-stream reuse"]}}
    return {"benchmark": "streams", "params": {"rounds": 5, "elements": 1 << 20, "spin_s": 0.1}, "results": res}


def test_streams_table_and_figure(tmp_path):
    import pytest

    from cupy_memstrat.bench import streams

    text = streams.format_table(_streams_report())
    assert "other-stream" in text and "managed-one-cache" in text
    assert "other-reader under pool with check='streams': 5 findings (cross-stream reuse)" in text
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.bench.plot import plot

    assert plot(_streams_report(), str(tmp_path / "s.png")).endswith("s.png")


def _fragmentation_on_the_simulated_gpu(**kw):
    """bench fragmentation's own run, on a simulated 16 GiB device at a quarter of the sizes."""
    from cupy_memstrat.testing import FakeBackend

    kw.pop("rounds", None)
    return fragmentation_run(backend=FakeBackend(memory="16GiB"), scale=0.25, **kw)


def _plugin_report():
    """A report as bench plugin makes (numbers made up for the format)."""
    return {"benchmark": "plugin", "machine": {}, "params": {"rounds": 2, "tests": 200, "configs": {},
                                                             "test": "a 4 MiB array"},
            "seconds": {"plain": [4.0, 4.2], "measured": [4.4, 4.6], "measured+driver": [4.5, 4.7]},
            "plain_seconds_per_test": 0.0205, "cost_per_test_seconds": {"measured": 0.002, "measured+driver": 0.0025},
            "ratio_to_plain": {"measured": 1.1, "measured+driver": 1.12}}


def test_the_plugin_table_gives_the_cost_per_test_over_plain_pytest():
    from cupy_memstrat.bench import plugin

    text = plugin.format_table(_plugin_report())
    assert "200 tests (a 4 MiB array), 2 rounds; wall s: the median of each setting's sessions" in text
    assert "measured+driver      4.60             +2.500 ms      1.12" in text
    assert "plain, per test (pytest's start-up included): 20.50 ms" in text


def test_bench_with_no_group_runs_every_group_and_writes_json_and_figures(tmp_path, monkeypatch, capsys):
    """The orchestration (the groups' own runs need a GPU: synthetic reports here)."""
    import json

    import pytest

    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    pytest.importorskip("cupy", reason="CuPy is not installed")
    from cupy_memstrat.bench import managed
    from cupy_memstrat.cli import main

    alloc_report = dict(_alloc_report(["cupy-default", "no-pool", "device"]), benchmark="alloc",
                        machine={"cuda": {"devices": [{"name": "Fake H200"}]}})
    from cupy_memstrat.bench import fragmentation, streams, workloads

    seen = []
    for mod, rep in ((alloc, alloc_report), (async_pool, _async_report()), (managed, _managed_report()),
                     (workloads, _workloads_report()), (streams, _streams_report())):
        monkeypatch.setattr(mod, "run",
                            lambda rep=rep, mod=mod, **kw: seen.append((mod.__name__, kw.get("rounds"))) or rep)
    monkeypatch.setattr(fragmentation, "run", lambda **kw: seen.append(("fragmentation", kw.get("rounds")))
                        or _fragmentation_on_the_simulated_gpu(**kw))
    from cupy_memstrat.bench import plugin
    monkeypatch.setattr(plugin, "run", lambda **kw: seen.append(("plugin", kw.get("rounds"))) or _plugin_report())
    monkeypatch.setattr(alloc, "require_real_gpu", lambda: None)
    out = tmp_path / "res"
    assert main(["bench", "--out", str(out), "--quiet", "--rounds", "2"]) == 0
    assert [r for _, r in seen] == [2, 2, 2, 2, 2, 2, 2]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bench-alloc.json", "bench-alloc.png", "bench-async.json", "bench-async.png",
                     "bench-fragmentation.json", "bench-fragmentation.png",
                     "bench-managed.json", "bench-managed.png", "bench-plugin.json", "bench-plugin.png",
                     "bench-streams.json", "bench-streams.png", "bench-workloads.json", "bench-workloads.png"]
    frag = json.loads((out / "bench-fragmentation.json").read_text())
    assert frag["results"]["16-then-32"]["paths"]["device"]["peak_in_use"] == 32 * MiB
    assert json.loads((out / "bench-async.json").read_text())["sync_loop"]["threshold_0_over_default"] == 54.0
    text = capsys.readouterr().out
    assert "== bench alloc" in text and "== bench workloads" in text and "wrote " in text


def test_bench_with_no_group_shows_progress_with_the_group_and_the_time_so_far(tmp_path, monkeypatch, capsys):
    import pytest

    pytest.importorskip("cupy", reason="CuPy is not installed")
    from cupy_memstrat.bench import fragmentation, managed, streams, workloads
    from cupy_memstrat.cli import main

    for mod, rep in ((alloc, dict(_alloc_report(["cupy-default", "no-pool"]), benchmark="alloc")),
                     (async_pool, _async_report()), (managed, _managed_report()), (workloads, _workloads_report()),
                     (streams, _streams_report())):
        monkeypatch.setattr(mod, "run", lambda rep=rep, **kw: kw["progress"]("step one") or rep)
    monkeypatch.setattr(fragmentation, "run", _fragmentation_on_the_simulated_gpu)
    from cupy_memstrat.bench import plugin
    monkeypatch.setattr(plugin, "run", lambda **kw: kw["progress"]("round 1/5") or _plugin_report())
    monkeypatch.setattr(alloc, "require_real_gpu", lambda: None)
    import cupy_memstrat.bench.plot as plot_mod

    monkeypatch.setattr(plot_mod, "plot", lambda report, path: None)
    assert main(["bench", "--out", str(tmp_path / "res")]) == 0
    captured = capsys.readouterr()
    assert "[bench alloc] [0:00 1/7] step one" in captured.err
    assert "[bench workloads] [0:00 4/7] step one" in captured.err
    assert "[bench streams] [0:00 5/7] step one" in captured.err
    assert "[bench fragmentation] [0:00 6/7] 16-then-32: 8 x 16 MiB allocated and freed" in captured.err
    assert "[bench plugin] [" in captured.err and " 7/7] round 1/5" in captured.err
    assert "== bench managed (done at 0:00)" in captured.out


def test_bench_with_no_group_stops_at_once_without_a_gpu(tmp_path, monkeypatch, capsys):
    from cupy_memstrat.cli import main
    from cupy_memstrat.errors import NoDeviceError

    def no_gpu():
        raise NoDeviceError("no CUDA device is available: test")

    monkeypatch.setattr(alloc, "require_real_gpu", no_gpu)
    assert main(["bench", "--out", str(tmp_path / "res")]) == 2
    assert "bench needs a CUDA device and CuPy: no CUDA device is available: test" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def _workloads_report():
    row = lambda t, ident=True: {"seconds": t, "ratio_to_first": t / 2.0, "runs": [t],  # noqa: E731
                                 "check": {"identical": ident, "max_rel_diff": 0.0 if ident else 1e-6},
                                 "peak_bytes_in_use": 1 << 20, "peak_bytes_reserved": 2 << 20}
    return {
        "benchmark": "workloads",
        "machine": {"cuda": {"devices": [{"name": "Fake H200"}]}},
        "params": {"descriptions": {"kmeans": "k-means", "monte-carlo": "a pricer"}},
        "results": {
            "kmeans": {"cupy-default": dict(row(2.0), check={"identical": True, "reference": True}),
                       "managed": row(2.2, ident=False)},
            "monte-carlo": {"cupy-default": dict(row(2.0), check={"identical": True, "reference": True}),
                            "managed": row(1.8)},
        },
    }


def test_workloads_table_and_figure(tmp_path):
    import pytest

    from cupy_memstrat.bench import workloads

    text = workloads.format_table(_workloads_report())
    assert "kmeans: k-means" in text and "1.10x" in text and "differs (max rel 1.00e-06)" in text
    assert "1.0 MiB / 2.0 MiB" in text
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.bench.plot import plot

    plot(_workloads_report(), str(tmp_path / "w.png"))
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_the_workloads_figure_names_cold_runs_faults_and_differing_results():
    import pytest

    from cupy_memstrat.bench import workloads

    report = _workloads_report()
    report["params"]["cold"] = ["monte-carlo"]
    report["results"]["monte-carlo"]["managed"]["faults"] = {"gpu_faults": 5096913}
    assert "monte-carlo: a pricer; cold: each run starts with nothing cached" in workloads.format_table(report)
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.bench.plot import _pyplot, _workloads

    plt = _pyplot()
    fig = _workloads(report, plt)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert "1.10x, result differs" in texts and "0.90x, 5,096,913 GPU faults" in texts
    assert [t.get_text() for t in ax.get_yticklabels()] == ["kmeans", "monte-carlo\n(cold)"]
    assert ax.get_xscale() == "log"
    plt.close(fig)


def test_bench_with_no_group_refuses_an_out_it_cannot_write(tmp_path, monkeypatch, capsys):
    import pytest

    pytest.importorskip("cupy", reason="CuPy is not installed")
    from cupy_memstrat.cli import main

    monkeypatch.setattr(alloc, "require_real_gpu", lambda: None)
    (tmp_path / "file").write_text("")
    assert main(["bench", "--out", str(tmp_path / "file" / "sub")]) == 2
    assert (f"bench: cannot write to --out {str(tmp_path / 'file' / 'sub')!r}: Not a directory"
            in capsys.readouterr().err)


def test_the_workloads_figure_keeps_a_path_missing_from_the_first_workload_and_says_so():
    import pytest

    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.bench.plot import _pyplot, _workloads

    report = _workloads_report()
    del report["results"]["kmeans"]["managed"]
    report["results"]["monte-carlo"]["managed"]["ratio_to_first"] = float("inf")
    plt = _pyplot()
    fig = _workloads(report, plt)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["cupy-default", "managed"]
    texts = [t.get_text() for t in ax.texts]
    assert " not run" in texts and " ratio inf" in texts
    plt.close(fig)


def test_plot_names_what_it_wrote_and_refuses_a_mangled_report_clearly(tmp_path, capsys):
    import json

    import pytest

    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.cli import main

    good = tmp_path / "w.json"
    good.write_text(json.dumps(_workloads_report()))
    assert main(["plot", str(good), "-o", str(tmp_path / "timeline")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'timeline.png'}"
    assert (tmp_path / "timeline.png").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"benchmark": "workloads", "results": {}}))
    assert main(["plot", str(bad), "-o", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot: this workloads report cannot be drawn: it lacks or mangles what the figure needs")
    bad.write_text(json.dumps({"benchmark": "workloads"}))
    assert main(["plot", str(bad), "-o", str(tmp_path / "b.png")]) == 2
    assert "(KeyError: 'results')" in capsys.readouterr().err
    bad.write_text(json.dumps([1, 2]))
    assert main(["plot", str(bad), "-o", str(tmp_path / "b.png")]) == 2
    assert "is not a report: expected a JSON object" in capsys.readouterr().err  # not "benchmark None"


@pytest.mark.parametrize("kw, match", [({"pairs": 1}, "pairs: expected an int >= 2"),
                                       ({"pairs": True}, "pairs: expected an int >= 2"),
                                       ({"target_s": float("nan")}, "target_s: expected seconds > 0"),
                                       ({"reference": ("a", None)}, "two different labels, got 'a' twice")])
def test_paired_ratios_refuses_bad_arguments_before_measuring(kw, match):
    args = {"path": ("a", None), "reference": ("b", None), "say": print, "target_s": 0.01, **kw}
    with pytest.raises(ValueError, match=match):
        alloc.paired_ratios(None, **args)  # no CuPy touched: refused first


def test_the_benchmark_pages_match_the_json_they_are_rendered_from():
    """docs/benchmarks.md's and README.md's measured tables are generated from docs/results/
    (python docs/render_benchmarks.py); a hand edit or a new result set not rendered fails."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "docs" / "render_benchmarks.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_hand_edited_table_is_found_stale(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("render_benchmarks", root / "docs" / "render_benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = tmp_path / "README.md"
    page.write_text("x\n<!-- render:workloads-summary -->\n| made up | 0.50x |\n<!-- /render -->\n")
    monkeypatch.setattr(mod, "PAGES", (page,))
    assert mod.main(["--check"]) == 1
    assert mod.main([]) == 0 and "made up" not in page.read_text() and "cg-poisson" in page.read_text()
    assert mod.main(["--check"]) == 0
