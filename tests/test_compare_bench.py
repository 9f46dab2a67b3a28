"""tools/compare_bench.py tells a change in a benchmark ratio from the run's own noise (the A/A
spread of ci/bench_ab.sh's alternating runs of two trees)."""

import importlib.util
import json
import pathlib

spec = importlib.util.spec_from_file_location(
    "compare_bench", pathlib.Path(__file__).parents[1] / "tools" / "compare_bench.py"
)
compare_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_bench)


def _run(folder, group, tree, n, device_512, managed_bar):
    doc = {"benchmark": group, "machine": {"date": "x"}, "params": {"rounds": 5},
           "ratio_to_cupy_default": {"device": {"512": device_512}, "cupy-default": {"512": 1.0}},
           "bars": {"latency_managed_over_cupy_pool": {"512": managed_bar}}, "results_us": {"device": {"512": 9.0}}}
    (folder / f"{group}-{tree}-{n}.json").write_text(json.dumps(doc))


def test_a_ratio_moved_beyond_the_a_a_spread_is_marked_and_one_within_it_is_not(tmp_path, capsys):
    for n, (d_before, d_after, m_before, m_after) in enumerate([(6.0, 6.1, 1.10, 1.30), (6.2, 6.0, 1.12, 1.31)], 1):
        _run(tmp_path, "alloc", "before", n, d_before, m_before)
        _run(tmp_path, "alloc", "after", n, d_after, m_after)
    rows = {r["ratio"]: r for r in compare_bench.compare(tmp_path)}
    assert set(rows) == {"ratio_to_cupy_default/device/512", "ratio_to_cupy_default/cupy-default/512",
                         "bars/latency_managed_over_cupy_pool/512"}  # not the absolute times
    dev, bar = rows["ratio_to_cupy_default/device/512"], rows["bars/latency_managed_over_cupy_pool/512"]
    assert (dev["before"], dev["after"], round(dev["spread"], 3), dev["beyond"]) == (6.1, 6.05, 0.2, False)
    assert bar["beyond"] and round(bar["after"] - bar["before"], 3) == 0.195
    assert compare_bench.main([str(tmp_path), "--json", str(tmp_path / "out.json")]) == 1
    assert "<- beyond the A/A spread" in capsys.readouterr().out
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["machines"] == {"alloc": {"date": "x"}} and len(out["rows"]) == 3


def test_runs_of_one_tree_only_are_refused_by_name(tmp_path, capsys):
    _run(tmp_path, "managed", "after", 1, 6.0, 1.1)
    assert compare_bench.main([str(tmp_path)]) == 2
    assert "group 'managed' has runs of after only" in capsys.readouterr().err
    assert compare_bench.main([str(tmp_path / "missing")]) == 2
