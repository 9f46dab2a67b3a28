"""The growth gate: --gpumem-compare=BASELINE.json with --gpumem-max-growth,
against the --gpumem-json report of an earlier run, with pytester on the
fake backend (1 GiB, or two devices)."""

import json

import pytest


cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

TESTS = """
import cupy, cupy_memstrat
import numpy as np
MiB = 1 << 20
KEEP = []
SIZE = {size}
def alloc(n):
    return cupy.ndarray((n,), dtype=np.uint8)
def test_peak():
    x = alloc(SIZE)
def test_leak():
    KEEP.append(alloc({leak}))
def test_two_devices():
    x = alloc(MiB)
    b = cupy_memstrat.current().backend
    if b.device_count() > 1:
        b.set_device(1)
        try:
            y = alloc(SIZE)
        finally:
            b.set_device(0)
{extra}
"""




def _write(pytester, size="4 * MiB", leak="0", extra=""):
    pytester.makepyfile(test_mem=TESTS.format(size=size, leak=leak, extra=extra))


def _run(pytester, *args, subprocess=False):
    go = pytester.runpytest_subprocess if subprocess else pytester.runpytest_inprocess
    return go("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def _baseline(pytester, tmp_path, **kw):
    _write(pytester, **kw)
    r = _run(pytester, "--gpumem", "--gpumem-leaks=warn", f"--gpumem-json={tmp_path / 'base.json'}")
    assert r.ret == 0, r.stdout.str()
    return tmp_path / "base.json"


def test_a_peak_that_grew_more_than_allowed_fails_and_names_both_numbers(pytester, fake_env, tmp_path):
    base = _baseline(pytester, tmp_path)
    _write(pytester, size="5 * MiB")  # 25% more
    r = _run(pytester, f"--gpumem-compare={base}", "--gpumem-max-growth=10%", f"--gpumem-json={tmp_path / 'r.json'}")
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines([f"*peak 5.0 MiB grew by 25.00% (1,048,576 B) over the baseline's 4.0 MiB (4,194,304 B; "
                            f"{base}), more than the 10% allowed (--gpumem-max-growth)*",
                            f"gpumem: compared 3 tests with the baseline {base} (max growth 10%): 1 grew more"])
    recs = {t["nodeid"].split("::")[-1]: t for t in json.loads((tmp_path / "r.json").read_text())["tests"]}
    assert recs["test_peak"]["verdict"] == "growth"
    assert recs["test_peak"]["baseline"]["peak_bytes_per_device"] == [4 << 20]
    assert recs["test_peak"]["limits"]["growth"] == {"max_growth": "10%", "baseline": str(base),
                                                     "source": "--gpumem-max-growth"}
    # within the growth allowed: passes; the default is 10%
    r = _run(pytester, f"--gpumem-compare={base}", "--gpumem-max-growth=30%")
    r.assert_outcomes(passed=3)
    r = _run(pytester, f"--gpumem-compare={base}")
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines(["*more than the 10% allowed (the default)*"])


def test_the_growth_is_compared_exactly_at_the_limit():
    from pytest_gpumem.baseline import parse_growth

    g = parse_growth("13%")  # 12800 * 1.13 = 14464 exactly: not more than allowed (floating point said it was)
    assert not g.exceeded(14464, 12800) and g.exceeded(14465, 12800)
    assert all(not parse_growth(f"{p}%").exceeded(100 * (100 + p), 100 * 100) for p in range(0, 300))


def test_a_size_of_growth_is_bytes_on_top_of_the_baseline(pytester, fake_env, tmp_path):
    base = _baseline(pytester, tmp_path)
    _write(pytester, size="5 * MiB")
    _run(pytester, f"--gpumem-compare={base}", "--gpumem-max-growth=1MiB").assert_outcomes(passed=3)
    r = _run(pytester, f"--gpumem-compare={base}", "--gpumem-max-growth=512KiB")
    r.assert_outcomes(passed=2, failed=1)


def test_a_leak_that_grew_fails(pytester, fake_env, tmp_path):
    base = _baseline(pytester, tmp_path)
    _write(pytester, leak="MiB")  # the baseline leaked nothing
    r = _run(pytester, f"--gpumem-compare={base}", "--gpumem-leaks=warn", "-W", "ignore::pytest.PytestWarning")
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines([f"*leak 1.0 MiB grew by 1.0 MiB (from nothing) over the baseline's 0 B (0 B; {base})*"])


def test_new_and_removed_tests_are_listed_not_failed(pytester, fake_env, tmp_path):
    base = _baseline(pytester, tmp_path)
    _write(pytester, extra="def test_new():\n    x = alloc(100 * MiB)\n")
    r = _run(pytester, f"--gpumem-compare={base}", "-k", "not leak")
    r.assert_outcomes(passed=3, deselected=1)
    r.stdout.fnmatch_lines(["gpumem: 1 test not in the baseline, or not measured there (not compared): "
                            "test_mem.py::test_new",
                            "gpumem: 1 test of the baseline did not run: test_mem.py::test_leak"])


def test_each_device_is_compared_with_its_own_peak(pytester, fake_env, tmp_path):
    fake_env.setenv("CUPY_MEMSTRAT_BACKEND", "fake:devices=2,memory=1GiB")
    base = _baseline(pytester, tmp_path)
    _write(pytester, size="8 * MiB")  # device 0's peak of test_two_devices stays 1 MiB, device 1's doubles
    r = _run(pytester, f"--gpumem-compare={base}", "--gpumem-max-growth=50%", "-k", "two_devices")
    r.assert_outcomes(failed=1, deselected=2)
    r.stdout.fnmatch_lines(["*peak 8.0 MiB on device 1 grew by 100.00% (4,194,304 B) over the baseline's 4.0 MiB*"])


def test_under_xdist_the_workers_compare_and_the_controller_lists(pytester, fake_env, tmp_path):
    pytest.importorskip("xdist")
    base = _baseline(pytester, tmp_path)
    _write(pytester, size="5 * MiB", extra="def test_new():\n    pass\n")
    r = _run(pytester, "-n", "2", f"--gpumem-compare={base}", subprocess=True)
    r.assert_outcomes(passed=3, failed=1)
    r.stdout.fnmatch_lines(["*peak 5.0 MiB grew by 25.00%*", "*1 test not in the baseline, or not measured there*"])


def test_the_settings_come_from_the_environment_and_the_ini_file(pytester, fake_env, tmp_path):
    base = _baseline(pytester, tmp_path)
    _write(pytester, size="5 * MiB")
    fake_env.setenv("GPUMEM_COMPARE", str(base))
    pytester.makeini("[pytest]\ngpumem_max_growth = 20%\n")
    r = _run(pytester)
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines(["*more than the 20% allowed (ini key gpumem_max_growth)*"])


def _with_growth(limit):
    """A valid report with no tests as the baseline, and the arguments comparing with it under
    --gpumem-max-growth=LIMIT: (content, args) of a row below."""
    return '{"version": 1, "tests": []}', ["--gpumem-compare={f}", f"--gpumem-max-growth={limit}"]


@pytest.mark.parametrize("content, args, match", [
    (None, ["--gpumem-compare={missing}"], "the baseline '*missing.json' does not exist"),
    ("not json", ["--gpumem-compare={f}"], "cannot read the baseline '*'"),
    ('{"benchmark": "alloc"}', ["--gpumem-compare={f}"], "*is not a pytest --gpumem-json report*"),
    ('{"version": 0, "tests": []}', ["--gpumem-compare={f}"], "*is a version 0 report; this pytest_gpumem reads*"),
    (*_with_growth("-5%"), "*--gpumem-max-growth='-5%': expected a growth of 0% or more, got '-5%'"),
    (*_with_growth("ten"), "*--gpumem-max-growth='ten': expected a growth such as '10%' or '1MiB', got 'ten'"),
    (*_with_growth("nan%"), "*expected a growth such as '10%' or '1MiB', got 'nan%'"),
    (*_with_growth("1e306%"), "*expected a growth such as '10%' or '1MiB', got '1e306%'"),
    (*_with_growth("10"),
     "*'10' has no unit: write '10%' for a share of the baseline's value or a size such as '1MiB'*"),
    (*_with_growth("0.13"), "*'0.13' has no unit*"),
    ('{"version": "1", "tests": []}', ["--gpumem-compare={f}"], "*has version '1', not a whole number*"),
    ('{"version": 1, "tests": [{"nodeid": "t.py::a", "peak_bytes_per_device": [true]}]}', ["--gpumem-compare={f}"],
     "*the record of t.py::a has peak_bytes_per_device=?True?: expected a list of byte counts, one per device"),
    ('{"version": 1, "tests": [{"nodeid": "t.py::a", "peak_bytes_per_device": [-5]}]}', ["--gpumem-compare={f}"],
     "*the record of t.py::a has peak_bytes_per_device=?-5?: expected a list*"),
    ('{"version": 1, "tests": [{"nodeid": "t.py::a", "peak_bytes_per_device": [5], "leaked_bytes": -1}]}',
     ["--gpumem-compare={f}"], "*the record of t.py::a has leaked_bytes=-1: expected a byte count or null"),
    (None, ["--gpumem-max-growth=10%"], "ERROR: --gpumem-max-growth='10%': a growth limit needs a baseline to "
                                        "compare with: give --gpumem-compare=BASELINE.json*"),
    ("\x80\x04 binary", ["--gpumem-compare={f}"], "*is not a text file, so not a --gpumem-json report"),
])
def test_bad_settings_are_usage_errors_before_any_test_runs(pytester, fake_env, tmp_path, content, args, match):
    f = tmp_path / "b.json"
    if content is not None:
        f.write_bytes(content.encode("latin-1"))
    _write(pytester)
    r = _run(pytester, *[a.format(f=f, missing=tmp_path / "missing.json") for a in args])
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"*{match}*"])
    assert "passed" not in r.stdout.str()
