"""pytest_gpumem end to end on the fake backend (CUPY_MEMSTRAT_BACKEND=fake):
options, ini keys, environment variables, markers, precedence, bad values,
leaks, the fixtures, the reports and pytest-xdist."""

import json
import os
import xml.etree.ElementTree as ET

import pytest

import cupy_memstrat
import cupy_memstrat.backends as C

cupy = pytest.importorskip("cupy", reason="the plugin's tests make CuPy arrays (no GPU needed)")

HEAD = """
import gc, sys
import numpy as np
import pytest
import cupy
MiB = 1 << 20
KEEP = []
def alloc(n):
    return cupy.ndarray((n,), dtype=np.uint8)
"""




def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def _xdist_env(monkeypatch):
    """Skip without pytest-xdist; else no GPUMEM* variable and a 1 GiB fake backend, which the
    worker subprocesses inherit."""
    pytest.importorskip("xdist")
    for k in list(os.environ):
        if k.startswith("GPUMEM"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")


def _gpu_present():
    try:
        C.RealBackend()
        return True
    except Exception:
        return False


def _no_gpu_env(monkeypatch):
    """Skip where a GPU is present; else no CUPY_MEMSTRAT_BACKEND, so that the inner sessions (subprocesses,
    which inherit it) run on no backend at all: the plugin without a GPU."""
    if _gpu_present():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("CUPY_MEMSTRAT_BACKEND", raising=False)


# -- options, ini keys, environment -------------------------------------------------------------


def test_every_option_and_ini_key_is_registered(pytester):
    r = pytester.runpytest_subprocess("--help")
    for opt in ("--gpumem ", "--no-gpumem", "--gpumem-budget=SIZE", "--gpumem-leaks=fail|warn|off",
                "--gpumem-strategy=NAME", "--gpumem-faults ", "--no-gpumem-faults",
                "--gpumem-faults-missing=skip|fail", "--gpumem-top=N", "--gpumem-json=PATH",
                "--gpumem-check=streams,poison,redzone", "--gpumem-stream-policy=current|fresh"):
        assert opt in r.stdout.str(), opt
    for ini in ("gpumem ", "gpumem_budget ", "gpumem_leaks ", "gpumem_strategy ", "gpumem_faults ",
                "gpumem_faults_missing ", "gpumem_top ", "gpumem_json ", "gpumem_check ",
                "gpumem_stream_policy "):
        assert "  " + ini in r.stdout.str(), ini
    r = pytester.runpytest_subprocess("--markers")
    r.stdout.fnmatch_lines(["@pytest.mark.limit_gpu_memory(size)*", "@pytest.mark.limit_gpu_leaks(size='0B')*",
                            "@pytest.mark.limit_page_faults(gpu=None, cpu=None, migrated=None)*",
                            "@pytest.mark.gpumem_skip*"])


def test_gpumem_measures_every_test_and_reports_the_top_n(pytester, fake_env):
    pytester.makepyfile(HEAD + """
def test_small():
    x = alloc(1 * MiB)
def test_big():
    x = alloc(5 * MiB)
    y = alloc(2 * MiB)
def test_none():
    pass
""")
    r = run(pytester, "--gpumem", "--gpumem-top=2")
    r.assert_outcomes(passed=3)
    r.stdout.fnmatch_lines([
        "gpumem: measuring every test through strategy 'pool' on 1 device: Fake NVIDIA H200 (1.0 GiB)",
        "*gpumem: top 2 of 3 measured tests by peak GPU memory (strategy pool)*",
        "*peak*allocs*test",
        "*7.0 MiB*2*test_gpumem_measures_every_test_and_reports_the_top_n.py::test_big",
        "*1.0 MiB*1*::test_small",
    ])
    assert "::test_none" not in r.stdout.str()
    r = run(pytester, "--gpumem", "--gpumem-top=0")
    assert "measured tests by peak" not in r.stdout.str()


def test_environment_variables_and_ini_keys_switch_it_on(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_a():\n    x = alloc(MiB)\n")
    fake_env.setenv("GPUMEM", "yes")
    r = run(pytester)
    r.stdout.fnmatch_lines(["gpumem: measuring every test*", "*1.0 MiB*::test_a"])
    r = run(pytester, "--no-gpumem")  # the command line wins over the environment
    assert "gpumem" not in r.stdout.str()
    fake_env.delenv("GPUMEM")
    pytester.makeini("[pytest]\ngpumem = true\ngpumem_top = 1\n")
    r = run(pytester)
    r.stdout.fnmatch_lines(["*top 1 of 1 measured tests*"])
    fake_env.setenv("GPUMEM", "0")  # the environment wins over the ini file
    r = run(pytester)
    assert "gpumem" not in r.stdout.str()


# -- budgets ------------------------------------------------------------------------------------------


def test_over_budget_fails_with_one_line_and_the_status_letter(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.mark.limit_gpu_memory("512KiB")
def test_over():
    x = alloc(MiB)
    KEEP.append(alloc(100))
@pytest.mark.limit_gpu_memory("2MiB")
def test_under():
    x = alloc(MiB)
""")
    r = run(pytester, "-ra")
    r.assert_outcomes(failed=1, passed=1)
    out = r.stdout.str()
    r.stdout.fnmatch_lines([
        "*M.*",
        "*_ test_over _*",
        "peak 1.0 MiB > budget 512.0 KiB (limit_gpu_memory marker)",
        "*- gpumem -*",
        "during the call: 2 allocations, 1 free; in use when it began: 0 B",
        "largest allocations made by the test and still live at the end of its call:",
        "       512 B  device 0  0x*",
        "GPUMEM *::test_over*",
    ])
    assert "test_under" not in out.split("short test summary")[1]
    r = run(pytester, "-v")
    r.stdout.fnmatch_lines(["*::test_over GPUMEM*", "*::test_under PASSED*"])


def test_a_percentage_budget_is_of_the_device_memory(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_a():\n    x = alloc(16 * MiB)\n")
    r = run(pytester, "--gpumem-budget=1%")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["peak 16.0 MiB > budget 10.2 MiB = 1% of device 0's 1.0 GiB (--gpumem-budget)"])


@pytest.mark.parametrize(
    "ini, env, cli, marker, expect",
    [
        ("1MiB", None, None, None, "budget 1.0 MiB (ini key gpumem_budget)"),
        ("1MiB", "2MiB", None, None, "budget 2.0 MiB (environment variable GPUMEM_BUDGET)"),
        ("1MiB", "2MiB", "2.5MiB", None, "budget 2.5 MiB (--gpumem-budget)"),
        ("1MiB", "2MiB", "2.5MiB", "'2.9MiB'", "budget 2.9 MiB (limit_gpu_memory marker)"),
        ("1MiB", "2MiB", "2.5MiB", "'4MiB'", None),
        ("1MiB", "2MiB", "", None, None),  # an empty option switches the budget off
        ("1MiB", "2MiB", "off", None, None),
        ("1MiB", None, "1MiB", "None", None),  # a marker switches it off for one test
    ],
)
def test_budget_precedence_marker_option_environment_ini(pytester, fake_env, ini, env, cli, marker, expect):
    pytester.makeini(f"[pytest]\ngpumem_budget = {ini}\n")
    if env:
        fake_env.setenv("GPUMEM_BUDGET", env)
    deco = f"@pytest.mark.limit_gpu_memory({marker})\n" if marker else ""
    pytester.makepyfile(HEAD + deco + "def test_a():\n    x = alloc(3 * MiB)\n")
    r = run(pytester, "--gpumem", *([f"--gpumem-budget={cli}"] if cli is not None else []))
    if expect is None:
        r.assert_outcomes(passed=1)
    else:
        r.assert_outcomes(failed=1)
        r.stdout.fnmatch_lines([f"peak 3.0 MiB > {expect}"])


def test_the_peak_is_on_top_of_what_was_in_use_when_the_call_began(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.fixture(scope="module")
def big():
    return alloc(64 * MiB)
@pytest.fixture
def medium():
    x = alloc(8 * MiB)
    yield x
    y = alloc(32 * MiB)   # teardown: not the test's call
@pytest.mark.limit_gpu_memory("2MiB")
def test_a(big, medium):
    x = alloc(MiB)
""")
    r = run(pytester, "--gpumem-json=out.json")
    r.assert_outcomes(passed=1)
    (t,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    assert t["peak_bytes"] == 1 << 20 and t["in_use_before_bytes"] == 72 << 20


# -- bad values: usage errors at start-up, naming their source ---------------------------------------


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("budget", "lots", "cannot parse 'lots' as a size"),
        ("budget", "150%", "expected a percentage between 0% and 100%"),
        ("leaks", "sometimes", "expected one of fail, warn, off"),
        ("strategy", "nope", "unknown strategy 'nope'"),
        ("faults", "maybe", "expected one of 1, true, yes, on, 0, false, no, off"),
        ("faults_missing", "ignore", "expected one of skip, fail"),
        ("top", "-1", "expected a whole number of tests >= 0"),
        ("top", "ten", "expected a whole number of tests >= 0"),
        ("check", "leaks", "unknown check 'leaks' in 'leaks'; valid: streams, poison, redzone, all or off"),
        ("stream_policy", "sometimes", "expected one of current, fresh"),
        ("history", "often", "expected one of 1, true, yes, on, 0, false, no, off"),
        ("", "perhaps", "expected one of 1, true"),
    ],
)
@pytest.mark.parametrize("where", ["option", "env", "ini"])
def test_bad_values_are_usage_errors_naming_the_source(pytester, fake_env, setting, value, message, where):
    name = "gpumem" + (f"_{setting}" if setting else "")
    opt = "--" + name.replace("_", "-")
    pytester.makepyfile("def test_a():\n    pass\n")
    args = []
    if where == "option":
        if not setting or setting in ("faults", "history"):  # a flag: argparse refuses a value, also a usage error
            r = run(pytester, f"{opt}={value}")
            assert r.ret == pytest.ExitCode.USAGE_ERROR
            assert f"argument {opt}: ignored explicit argument {value!r}" in r.stderr.str(), r.stderr.str()
            return
        args, label = [f"{opt}={value}"], f"{opt}={value!r}"
    elif where == "env":
        fake_env.setenv(name.upper(), value)
        label = f"environment variable {name.upper()}={value!r}"
    else:
        pytester.makeini(f"[pytest]\n{name} = {value}\n")
        label = f"ini key {name}={value!r}"
    r = run(pytester, *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{label}: " in r.stderr.str() and message in r.stderr.str(), r.stderr.str()


@pytest.mark.parametrize(
    "marker, message",
    [
        ("limit_gpu_memory('lots')", "marker limit_gpu_memory('lots') on *::test_a: size: cannot parse 'lots'*"),
        ("limit_gpu_memory()", "marker limit_gpu_memory() on *::test_a: missing the size argument*"),
        ("limit_gpu_memory('1MiB', '2MiB')", "*expected one argument, size"),
        ("limit_gpu_leaks(limit='1MiB')", "*limit_gpu_leaks(limit='1MiB')*unknown argument 'limit'; expected size"),
        ("limit_gpu_leaks('5%')", "*a percentage ('5%') needs the device's total memory*"),
        ("limit_page_faults(gpu=-1)", "*limit_page_faults(gpu=-1)*gpu: expected a whole number >= 0 or None, got -1"),
        ("limit_page_faults(5)", "*takes keyword arguments only: gpu=, cpu=, migrated="),
        ("limit_page_faults(dtoh=5)", "*unknown argument 'dtoh'; expected gpu, cpu, migrated"),
        ("limit_page_faults(migrated='x')", "*migrated: cannot parse 'x' as a size*"),
    ],
)
def test_bad_markers_are_usage_errors_at_collection(pytester, fake_env, marker, message):
    pytester.makepyfile(f"import pytest\n@pytest.mark.{marker}\ndef test_a():\n    raise AssertionError('BODY RAN')\n")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: " + message])
    assert "BODY RAN" not in r.stdout.str()


def test_every_bad_marker_of_the_run_is_reported_at_once(pytester, fake_env):
    pytester.makepyfile("""
import pytest
@pytest.mark.limit_gpu_memory('lots')
@pytest.mark.limit_gpu_leaks(limit=1)
def test_a():
    raise AssertionError('BODY RAN')
def test_fine():
    pass
@pytest.mark.limit_page_faults(gpu=-1)
def test_b():
    pass
""")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([
        "ERROR: 3 bad gpumem markers:",
        "marker limit_gpu_memory('lots') on *::test_a: size: cannot parse 'lots'*",
        "marker limit_gpu_leaks(limit=1) on *::test_a: unknown argument 'limit'; expected size",
        "marker limit_page_faults(gpu=-1) on *::test_b: gpu: expected a whole number >= 0 or None, got -1",
    ])
    assert "BODY RAN" not in r.stdout.str()


def test_bad_markers_are_usage_errors_also_without_gpu(pytester, monkeypatch):
    _no_gpu_env(monkeypatch)
    pytester.makepyfile("import pytest\n@pytest.mark.limit_gpu_memory('lots')\ndef test_a():\n    pass\n")
    r = pytester.runpytest_subprocess()
    assert r.ret == pytest.ExitCode.USAGE_ERROR


# -- leaks -------------------------------------------------------------------------------------------


LEAKY = HEAD + """
def test_leaks():
    KEEP.append(alloc(3 * MiB))
    KEEP.append(alloc(MiB))
    KEEP.append(alloc(1000))
def test_clean():
    x = alloc(MiB)
def test_cycle_is_collected():
    a = [alloc(MiB)]
    a.append(a)                       # garbage, but only the collector frees it
def test_fails_and_leaks():
    KEEP.append(alloc(MiB))
    assert False
def test_traceback_keeps_arrays():
    def f():
        x = alloc(2 * MiB)
        raise ValueError("boom")
    try:
        f()
    except ValueError as e:
        KEEP.append(e)                # its traceback holds f's frame, and x
@pytest.mark.limit_gpu_leaks("5MiB")
def test_within_its_limit():
    KEEP.append(alloc(4 * MiB))
@pytest.mark.gpumem_skip
def test_not_checked():
    KEEP.append(alloc(MiB))
"""


def test_leaks_fail_the_test_listing_each_leaked_allocation(pytester, fake_env):
    pytester.makepyfile(LEAKY)
    r = run(pytester, "--gpumem-leaks=fail", "-ra", "--gpumem-json=out.json")
    r.assert_outcomes(failed=3, passed=4)
    r.stdout.fnmatch_lines([
        "*_ test_leaks _*",
        "leaked 3 allocations, 4.0 MiB > limit 0 B (--gpumem-leaks)",
        "*- gpumem -*",
        "allocations made by the test and still live after its teardown and gc.collect(), largest first:",
        "     3.0 MiB  device 0  0x*",
        "     1.0 MiB  device 0  0x*",
        "     1.0 KiB  device 0  0x*",
        "  (where each was allocated: run with --gpumem-strategy=pool:track_origins=true, or with --gpumem-history "
        "and --gpumem-json)",
    ])
    r.stdout.fnmatch_lines(["*_ test_traceback_keeps_arrays _*", "leaked 1 allocation, 2.0 MiB > limit 0 B*"])
    out = r.stdout.str()
    summary = out.split("short test summary info")[1]
    assert "GPUMEM *::test_leaks" not in summary
    for name in ("test_clean", "test_cycle_is_collected", "test_within_its_limit", "test_not_checked"):
        assert f"::{name} " not in summary
    assert "FAILED test_leaks_fail_the_test_listing_each_leaked_allocation.py::test_fails_and_leaks" in summary
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    assert tests["test_leaks"]["leaked_bytes"] == 4 * 2**20 + 1024 and tests["test_leaks"]["leaked_count"] == 3
    # as the pool rounds: 512 B steps
    assert [x["size"] for x in tests["test_leaks"]["leaks"]] == [3 << 20, 1 << 20, 1024]
    assert tests["test_leaks"]["verdict"] == "leaks" and tests["test_leaks"]["outcome"] == "failed"
    assert tests["test_fails_and_leaks"]["leaked_bytes"] is None  # no leak verdict on a failed test
    assert tests["test_fails_and_leaks"]["leak_check"].startswith("skipped")
    assert tests["test_cycle_is_collected"]["leaked_bytes"] == 0
    assert tests["test_within_its_limit"]["leaked_bytes"] == 4 << 20
    assert "test_not_checked" not in tests


def test_origins_are_listed_with_track_origins(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_leaks():\n    KEEP.append(alloc(MiB))\n")
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-strategy=pool:track_origins=true")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["     1.0 MiB  device 0  0x*  *test_origins_are_listed_with_track_origins.py:8 in alloc"])


def test_leaks_warn(pytester, fake_env):
    pytester.makepyfile(LEAKY)
    r = run(pytester, "--gpumem-leaks=warn")
    r.assert_outcomes(failed=1, passed=6, warnings=2)
    r.stdout.fnmatch_lines(["*GpuMemLeakWarning: *::test_leaks: leaked 3 allocations, 4.0 MiB > limit 0 B*"])
    # pytest's warnings summary names the test's own line, not the plugin's
    line = (pytester.path / "test_leaks_warn.py").read_text().splitlines().index("def test_leaks():") + 1
    r.stdout.fnmatch_lines([f"*test_leaks_warn.py:{line}: GpuMemLeakWarning: *::test_leaks: leaked 3 allocations*"])
    assert "plugin.py" not in r.stdout.str()
    r = run(pytester, "--gpumem-leaks=warn", "-W", "error::pytest_gpumem.plugin.GpuMemLeakWarning")
    r.assert_outcomes(failed=3, passed=4)


def test_leak_marker_without_any_option_and_cufft_plans_are_not_leaks(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.mark.limit_gpu_leaks
def test_leaks():
    KEEP.append(alloc(100))
@pytest.mark.limit_gpu_leaks()
def test_clean():
    x = alloc(100)
""")
    r = run(pytester)
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["leaked 1 allocation, 512 B > limit 0 B (limit_gpu_leaks marker)"])


# -- page faults (the fake backend's counters) ------------------------------------------------------

FAULTS = HEAD + """
from cupy_memstrat.backends import get_backend
def migrate(prefetch=False):
    b = get_backend()
    p = b.malloc_managed(4 * MiB)
    b.touch(p, 4 * MiB, "host")
    if prefetch:
        b.mem_prefetch(p, 4 * MiB, 0, 0)
    b.touch(p, 4 * MiB, "device")
    b.free(p)
@pytest.mark.limit_page_faults(gpu=0)
def test_faulting():
    migrate()
@pytest.mark.limit_page_faults(gpu=0, migrated="4MiB")
def test_prefetched():
    migrate(prefetch=True)
@pytest.mark.limit_page_faults(migrated="1MiB")
def test_migrates_too_much():
    migrate(prefetch=True)
def test_unlimited():
    migrate()
"""


def _run_faults(pytester, *args):
    """FAULTS run with ``args``: its two tests over their page-fault limits fail, the others pass."""
    pytester.makepyfile(FAULTS)
    r = run(pytester, *args)
    r.assert_outcomes(failed=2, passed=2)
    return r


def test_page_fault_budgets(pytester, fake_env):
    r = _run_faults(pytester, "--gpumem-json=out.json")
    r.stdout.fnmatch_lines([
        "*_ test_faulting _*",
        "64 GPU page faults > limit 0 (limit_page_faults marker; fake counters)",
        "*- gpumem -*",
        "page faults during the call: 64 GPU faults, * (fake backend, exact)",
        "*_ test_migrates_too_much _*",
        "migrated 4.0 MiB > limit 1.0 MiB (limit_page_faults marker; fake counters)",
    ])
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    assert tests["test_faulting"]["faults"]["gpu_faults"] == 64
    assert tests["test_prefetched"]["faults"]["gpu_faults"] == 0
    assert tests["test_prefetched"]["faults"]["bytes_htod"] == 4 << 20
    assert "test_unlimited" not in tests  # not measured: no marker, no option


def test_gpumem_faults_counts_every_test(pytester, fake_env):
    r = _run_faults(pytester, "--gpumem-faults")
    r.stdout.fnmatch_lines([
        "gpumem: measuring every test * page faults: fake counters",
        "*peak*allocs*GPU faults*CPU faults*migrated*test",
    ])
    r.stdout.fnmatch_lines(["* 64 * 4.0 MiB  *::test_unlimited"])


def test_page_fault_markers_without_a_gpu_skip_or_fail(pytester, monkeypatch):
    _no_gpu_env(monkeypatch)
    pytester.makepyfile("import pytest\n@pytest.mark.limit_page_faults(gpu=0)\ndef test_a():\n    pass\n"
                        "def test_b():\n    pass\n")
    r = pytester.runpytest_subprocess("-rs")
    r.assert_outcomes(skipped=1, passed=1)
    r.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_page_fault_markers_without_a_gpu_skip_or_fail.py:2: "
                            "gpumem: limit_page_faults cannot be checked: GPU measurement is off: no CUDA device*"])
    r = pytester.runpytest_subprocess("--gpumem-faults-missing=fail")
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["*gpumem: limit_page_faults cannot be checked: GPU measurement is off*"])


# -- without a GPU -------------------------------------------------------------------------------------


def test_without_gpu_the_session_runs_unmeasured_and_says_so_once(pytester, monkeypatch):
    _no_gpu_env(monkeypatch)
    pytester.makepyfile("import pytest\n@pytest.mark.limit_gpu_memory('1B')\ndef test_a():\n    pass\n"
                        "def test_b(gpumem):\n    pass\n")
    r = pytester.runpytest_subprocess("--gpumem-budget=1B", "--gpumem-leaks=fail", "-rs")
    r.assert_outcomes(passed=1, skipped=1)
    assert r.stdout.str().count("GPU measurement is off") == 2  # the header, and the fixture's skip reason
    r.stdout.fnmatch_lines(["gpumem: GPU measurement is off, tests run unmeasured: no CUDA device is available*",
                            "SKIPPED*gpumem: GPU measurement is off: no CUDA device*"])
    r = pytester.runpytest_subprocess()  # markers only: no header, one line at the end
    r.assert_outcomes(passed=1, skipped=1)
    r.stdout.fnmatch_lines(["gpumem: 1 test asked for GPU measurement, which is off: no CUDA device*"])
    pytester.makepyfile(test_more="import pytest\n@pytest.mark.limit_gpu_leaks\ndef test_c():\n    pass\n"
                        "@pytest.mark.limit_page_faults(gpu=0)\ndef test_d():\n    pass\n")
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=2, skipped=2)  # test_d: no page-fault counters without a GPU
    r.stdout.fnmatch_lines(["gpumem: 2 tests asked for GPU measurement, which is off: no CUDA device*"])


# -- fixtures ---------------------------------------------------------------------------------------------


def test_the_gpumem_fixture_works_without_options(pytester, fake_env):
    pytester.makepyfile(HEAD + """
def test_fixture(gpumem):
    assert gpumem.strategy.name == "pool"
    with gpumem.measure() as m:
        t = alloc(3 * MiB)
        del t
        kept = alloc(MiB)
    assert (m.peak, m.allocated, m.freed, m.leaked) == (3 * MiB, 2, 1, MiB)
    assert [a.size for a in m.leaked_allocations] == [MiB] and m.faults is None
    assert gpumem.in_use == MiB and gpumem.peak == 3 * MiB
    assert [a.size for a in gpumem.live_allocations()] == [MiB]
    gpumem.assert_no_leaks(limit="1MiB")
    with pytest.raises(AssertionError, match=r"leaked 1 allocation, 1.0 MiB > limit 0 B"):
        gpumem.assert_no_leaks()
    del kept
    gpumem.assert_no_leaks()
    with gpumem.measure(faults=True) as m2:
        pass
    assert m2.faults.gpu_faults == 0
def test_nested_windows_keep_the_outer_peak(gpumem):
    a = alloc(8 * MiB)
    del a
    with gpumem.measure() as m:
        b = alloc(MiB)
    assert m.peak == MiB and gpumem.peak == 8 * MiB
@pytest.mark.limit_gpu_memory("6MiB")
def test_a_measure_block_does_not_reset_the_tests_peak(gpumem):
    a = alloc(8 * MiB)
    del a
    with gpumem.measure():
        pass
""")
    r = run(pytester)
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines(["peak 8.0 MiB > budget 6.0 MiB (limit_gpu_memory marker)"])


def test_gpumem_strategy_runs_a_test_under_each_strategy(pytester, fake_env):
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_each(gpumem_strategy):
    assert cupy_memstrat.current() is gpumem_strategy
    x = alloc(MiB)
    assert gpumem_strategy.stats().bytes_in_use >= MiB
@pytest.mark.parametrize("gpumem_strategy", ["device", "nope", 5, ""], indirect=True)
def test_chosen(gpumem_strategy):
    assert gpumem_strategy.name == "device"
""")
    r = run(pytester, "-v", "-rs")
    # every registered strategy; one whose library is missing (torch, rmm) is skipped with the reason
    from cupy_memstrat.registry import get_registry

    missing = {n for n in cupy_memstrat.available() if get_registry().get(n).unavailable()}
    r.assert_outcomes(passed=len(cupy_memstrat.available()) - len(missing) + 1, skipped=len(missing), errors=3)
    r.stdout.fnmatch_lines(["*::test_each[[]async[]] PASSED*", "*::test_each[[]device[]] PASSED*",
                            "*::test_each[[]managed[]] PASSED*", "*::test_each[[]pool[]] PASSED*"])
    out = r.stdout.str()
    for name in missing:  # a typo is an error, never a silent skip or a run under 'pool'
        assert f"strategy {name!r} needs the module" in out
    assert "gpumem_strategy: unknown strategy 'nope'" in out
    assert "gpumem_strategy: expected a strategy name such as 'device' or 'async:cache=0', got 5" in out
    assert "got ''" in out and "Traceback" not in out


def test_a_test_under_the_fixture_is_measured_through_its_own_strategy_without_a_warning(pytester, fake_env):
    """Issue 16: the fixture made the plugin warn (GpuMemAllocatorWarning) for its own test and the
    plain test after it, failing both under -W error, and the title named the fixture's strategy."""
    pytester.makepyfile(HEAD + """
@pytest.mark.parametrize("gpumem_strategy", ["device"], indirect=True)
def test_fixture(gpumem_strategy):
    x = alloc(3 * MiB)
def test_plain_after():
    x = alloc(MiB)
""")
    r = run(pytester, "--gpumem", "--gpumem-json=out.json", "-W", "error")
    r.assert_outcomes(passed=2)
    out = r.stdout.str()
    assert "GpuMemAllocatorWarning" not in out and "allocator changed" not in out
    r.stdout.fnmatch_lines(["*measured tests by peak GPU memory (strategy pool)*",
                            "*3.0 MiB*::test_fixture[[]device[]] [[]strategy device[]]*"])
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    assert tests["test_fixture[device]"]["strategy"] == "device"
    assert tests["test_fixture[device]"]["peak_bytes"] == 3 << 20
    assert "strategy" not in tests["test_plain_after"] and tests["test_plain_after"]["peak_bytes"] == 1 << 20


def test_the_fake_backend_works_without_any_gpumem_option_or_marker(pytester, fake_env):
    """Issue 16: CUPY_MEMSTRAT_BACKEND=fake pytest test_x.py failed with a raw CUDARuntimeError
    unless another collected test had a marker."""
    pytester.makepyfile(HEAD + "def test_plain():\n    assert alloc(MiB).nbytes == MiB\n")
    r = run(pytester)
    r.assert_outcomes(passed=1)


def test_an_installed_strategy_is_measured_through(pytester, fake_env):
    pytester.makeconftest("import cupy_memstrat\ncupy_memstrat.use('device')\n")
    pytester.makepyfile(HEAD + "@pytest.mark.limit_gpu_memory('1KiB')\ndef test_a():\n    x = alloc(MiB)\n")
    r = run(pytester, "--gpumem")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["gpumem: measuring every test through strategy 'device' (already installed)*",
                            "peak 1.0 MiB > budget 1.0 KiB (limit_gpu_memory marker)"])


def _run_with_strategy_from_env(pytester, fake_env, var, name):
    """Run, under --gpumem, a test that passes only if CuPy allocates with strategy ``name``,
    with the environment variable ``var`` set to ``name``."""
    pytester.makepyfile(HEAD + "import cupy_memstrat\ndef test_a():\n"
                        f"    assert cupy_memstrat.current().name == {name!r}\n")
    fake_env.setenv(var, name)
    return run(pytester, "--gpumem")


def test_the_strategy_option_with_measuring(pytester, fake_env):
    r = _run_with_strategy_from_env(pytester, fake_env, "GPUMEM_STRATEGY", "async")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["gpumem: CuPy allocates with strategy 'async' "
                            "(environment variable GPUMEM_STRATEGY='async')",
                            "gpumem: measuring every test through strategy 'async'*"])


def test_cupy_memstrat_env_sets_the_strategy_below_gpumem_strategy(pytester, fake_env):
    r = _run_with_strategy_from_env(pytester, fake_env, "CUPY_MEMSTRAT", "managed")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["gpumem: CuPy allocates with strategy 'managed' "
                            "(environment variable CUPY_MEMSTRAT='managed')"])
    fake_env.setenv("GPUMEM_STRATEGY", "async")
    r = run(pytester, "--gpumem")
    r.assert_outcomes(failed=1)  # GPUMEM_STRATEGY wins: the test sees async
    fake_env.delenv("GPUMEM_STRATEGY")
    fake_env.setenv("CUPY_MEMSTRAT", "managed:colour=red")
    r = run(pytester, "--gpumem")
    r.stderr.fnmatch_lines(["*environment variable CUPY_MEMSTRAT='managed:colour=red': *unknown option 'colour'*"])


# -- reports -----------------------------------------------------------------------------------------------


def test_history_puts_the_timeline_of_failing_tests_in_the_json(pytester, fake_env):
    pytester.makepyfile(HEAD + """
def make(n):
    return alloc(n)
def test_ok():
    x = make(MiB)
@pytest.mark.limit_gpu_memory("1MiB")
def test_over():
    keep = [make(MiB) for _ in range(3)]
""")
    r = run(pytester, "--gpumem-history", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=1)
    doc = json.loads((pytester.path / "out.json").read_text())
    ok, over = doc["tests"]
    assert "history" not in ok and doc["settings"]["history"] is True
    h = over["history"]
    assert h["kind"] == "memory-history" and h["strategy"]["name"] == "pool"
    # the list dies when the test function returns, inside the call
    assert [(e["action"], e["size"]) for e in h["events"]] == [("alloc", 1 << 20)] * 3 + [("free", 1 << 20)] * 3
    assert all(e["origin"].endswith("in alloc") for e in h["events"][:3])  # the first frame outside CuPy
    (pytester.path / "snap.json").write_text(json.dumps(h))  # what `python -m cupy_memstrat plot` reads


def test_history_keep_all_puts_every_tests_timeline_in_the_json_for_a_replay(pytester, fake_env):
    from cupy_memstrat.trace import read_trace

    pytester.makepyfile(HEAD + """
def test_one():
    x = alloc(MiB)
def test_two():
    keep = [alloc(2 * MiB) for _ in range(3)]
""")
    r = run(pytester, "--gpumem-history", "--gpumem-history-keep=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2)
    doc = json.loads((pytester.path / "out.json").read_text())
    assert all("history" in t for t in doc["tests"])
    trace = read_trace(str(pytester.path / "out.json"))  # both tests' timelines, one after the other
    assert trace.n_allocs == 4 and trace.peak_in_use() == 6 << 20
    r = run(pytester, "--gpumem-history", "--gpumem-history-keep=some")
    r.stderr.fnmatch_lines(["*--gpumem-history-keep*some*"])




def test_history_of_a_test_inside_using_is_reported_not_recordable_never_an_internal_error(pytester, fake_env):
    """Issue 16: --gpumem-history on a test run inside cupy_memstrat.using() (and the documented
    gpumem_strategy fixture) aborted the whole session with an INTERNALERROR (exit 3)."""
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_inside_using():
    with cupy_memstrat.using("device"):
        x = alloc(MiB)
def test_with_the_fixture(gpumem_strategy):
    x = alloc(MiB)
    assert gpumem_strategy.name != "managed"  # one failing row: its JSON says why it has no timeline
@pytest.mark.limit_gpu_memory("1KiB")
def test_over_after():
    x = alloc(MiB)
""")
    r = run(pytester, "--gpumem-history", "--gpumem-json=out.json", "-p", "no:randomly")
    assert r.ret == 1  # a budget failure and an assertion; no INTERNALERROR (3)
    assert "INTERNALERROR" not in r.stdout.str() + r.stderr.str()
    doc = json.loads((pytester.path / "out.json").read_text())
    by_name = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    over = by_name.pop("test_over_after")
    assert over["outcome"] == "failed" and over["history"]["events"]  # recording works again after
    fixture_rows = {n: t for n, t in by_name.items() if n.startswith("test_with_the_fixture")}
    failed = fixture_rows.pop("test_with_the_fixture[managed]")
    assert failed["outcome"] == "failed" and "history" not in failed
    assert failed["history_error"].startswith("not recorded: the test runs inside cupy_memstrat.using() (as "
                                              "under the gpumem_strategy fixture)")
    assert fixture_rows and all("history_error" not in t for t in fixture_rows.values())  # passed: no noise
    assert all(t["outcome"] in ("passed", "skipped") for t in fixture_rows.values())


@pytest.mark.parametrize("where", ["a directory", "/proc/x.json", "under a file"])
def test_a_json_path_that_cannot_be_written_is_a_usage_error_before_any_test(pytester, fake_env, where):
    """Issue 16: an existing directory or /proc/x.json ran every test, then printed a traceback
    at the end (exit 1) and left PATH.tmpNNNN behind."""
    pytester.makepyfile(HEAD + "def test_a():\n    print('RAN')\n    x = alloc(MiB)\n")
    (pytester.path / "adir").mkdir()
    (pytester.path / "afile").write_text("x")
    path = {"a directory": "adir", "/proc/x.json": "/proc/x.json", "under a file": "afile/out.json"}[where]
    r = run(pytester, "--gpumem", f"--gpumem-json={path}", "-s")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "RAN" not in r.stdout.str() and "Traceback" not in r.stdout.str() + r.stderr.str()
    assert "--gpumem-json" in r.stderr.str() and ("is a directory" in r.stderr.str()
                                                  or "cannot write" in r.stderr.str())
    assert not [p for p in pytester.path.rglob("*.tmp*")]


def test_the_json_carries_each_limit_that_applied_and_where_it_came_from(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.mark.limit_gpu_leaks("2MiB")
def test_leak_limit():
    pass
@pytest.mark.limit_gpu_memory("10%")
@pytest.mark.limit_page_faults(gpu=0, migrated="1MiB")
def test_share():
    pass
def test_plain():
    pass
""")
    r = run(pytester, "--gpumem-budget=200MB", "--gpumem-json=out.json")
    r.assert_outcomes(passed=3)
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["settings"]["measure"] is True  # a budget measures every test
    assert doc["setting_sources"]["budget"] == "--gpumem-budget" and doc["setting_texts"]["budget"] == "200MB"
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    assert tests["test_leak_limit"]["limits"] == {
        "budget": {"value": 200_000_000, "as_given": "200MB", "source": "--gpumem-budget"},
        "leaks": {"mode": "fail", "limit_bytes": 2 << 20, "source": "limit_gpu_leaks marker"}}
    assert tests["test_share"]["limits"]["budget"] == {"value": "10%", "as_given": "10%",
                                                       "source": "limit_gpu_memory marker"}
    assert tests["test_share"]["limits"]["page_faults"] == {"gpu": 0, "migrated": 1 << 20,
                                                            "source": "limit_page_faults marker"}
    assert tests["test_plain"]["limits"] == {"budget": {"value": 200_000_000, "as_given": "200MB",
                                                        "source": "--gpumem-budget"}}


def test_a_budget_is_echoed_in_the_users_unit(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_over():\n    x = alloc(300 * 10**6)\n")
    r = run(pytester, "--gpumem-budget=200MB")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["gpumem: measuring every test*; budget 200MB (190.7 MiB) (--gpumem-budget)",
                            "peak 286.1 MiB > budget 200MB (190.7 MiB) (--gpumem-budget)"])
    r = run(pytester, "--gpumem-budget=256MiB")  # the unit shown already: not repeated
    r.stdout.fnmatch_lines(["peak 286.1 MiB > budget 256.0 MiB (--gpumem-budget)"])


def test_json_is_written_also_when_nothing_was_measured_and_a_trailing_slash_is_refused(pytester, fake_env):
    """From the third adversarial trial: --gpumem-json alone wrote nothing, silently; 'x.json/' wrote x.json."""
    pytester.makepyfile("def test_a():\n    pass\n")
    r = run(pytester, "--gpumem-json=plain.json")
    r.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "plain.json").read_text())
    assert doc["tests"] == [] and doc["settings"]["measure"] is False
    r.stdout.fnmatch_lines(["gpumem: JSON report written to plain.json"])
    r = run(pytester, "--gpumem", "--gpumem-json=x.json/")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and not (pytester.path / "x.json").exists()
    r.stderr.fnmatch_lines(["*'x.json/' is a directory; expected a file path such as*"])
    os.symlink("loopB", pytester.path / "loopA")
    os.symlink("loopA", pytester.path / "loopB")
    r = run(pytester, "--gpumem", "--gpumem-json=loopA")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and os.path.islink(pytester.path / "loopA")
    r.stderr.fnmatch_lines(["*'loopA' is a symbolic link in a loop*"])


def test_the_json_goes_through_a_symlink_and_never_replaces_a_fifo(pytester, fake_env):
    """From an adversarial trial: the report replaced a symbolic link, a FIFO and /dev/full with a file."""
    pytester.makepyfile(HEAD + "def test_a():\n    x = alloc(MiB)\n")
    (pytester.path / "real.json").write_text("{}")
    os.symlink("real.json", pytester.path / "link.json")
    r = run(pytester, "--gpumem", "--gpumem-json=link.json")
    r.assert_outcomes(passed=1)
    assert os.path.islink(pytester.path / "link.json")
    assert json.loads((pytester.path / "real.json").read_text())["tests"][0]["peak_bytes"] == 1 << 20
    os.mkfifo(pytester.path / "fifo")
    r = run(pytester, "--gpumem", "--gpumem-json=fifo")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--gpumem-json='fifo': 'fifo' is not a regular file (a FIFO, a device or a socket)*"])
    assert not os.path.isfile(pytester.path / "fifo")


def test_json_and_junit_carry_the_numbers(pytester, fake_env):
    pytester.makepyfile(HEAD + """
def test_a():
    x = alloc(2 * MiB)
@pytest.mark.limit_gpu_memory("1MiB")
def test_b():
    x = alloc(2 * MiB)
""")
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-json=sub/out.json", "--junitxml=junit.xml")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["gpumem: JSON report written to sub/out.json"])
    doc = json.loads((pytester.path / "sub" / "out.json").read_text())
    assert doc["version"] == 1 and doc["strategy"] == {
        "name": "pool", "options": {"track_origins": False, "oom_snapshot": None, "route": "direct"}}
    assert doc["machine"]["backend"] == "fake" and doc["machine"]["devices"][0]["name"] == "Fake NVIDIA H200"
    assert doc["machine"]["driver_version"] == 13000 and doc["packages"]["cupy_memstrat"]
    assert doc["settings"]["leaks"] == "fail"
    a, b = doc["tests"]
    assert a["nodeid"].endswith("::test_a") and a["outcome"] == "passed" and a["worker"] is None
    assert (a["peak_bytes"], a["allocated"], a["freed"], a["leaked_bytes"], a["leaked_count"]) == (2 << 20, 1, 1, 0, 0)
    assert b["outcome"] == "failed" and b["verdict"] == "budget" and b["budget_bytes"] == 1 << 20
    root = ET.parse(pytester.path / "junit.xml").getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_a"].iter("property")}
    assert props == {"gpumem_peak_bytes": str(2 << 20), "gpumem_peak_reserved_bytes": str(2 << 20),
                     "gpumem_allocations": "1",
                     "gpumem_leaked_bytes": "0", "gpumem_leaked_allocations": "0"}
    failure = cases["test_b"].find("failure")
    assert failure is not None and failure.get("message").startswith("peak 2.0 MiB > budget 1.0 MiB")


def test_xdist_workers_measure_and_the_controller_merges(pytester, monkeypatch):
    _xdist_env(monkeypatch)
    body = "\n".join(f"def test_{i}():\n    x = alloc({i + 1} * MiB)\n" for i in range(6))
    pytester.makepyfile(HEAD + body + "@pytest.mark.limit_gpu_memory('1MiB')\ndef test_over():\n"
                        "    x = alloc(2 * MiB)\n"
                        "def test_leak():\n    KEEP.append(alloc(MiB))\n")
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--gpumem-leaks=fail",
                                      "--gpumem-json=out.json", "--junitxml=junit.xml")
    r.assert_outcomes(passed=6, failed=2)
    r.stdout.fnmatch_lines(["gpumem: measuring every test on each pytest-xdist worker; leaks: fail (--gpumem-leaks)",
                            "*gpumem: top 8 of 8 measured tests by peak GPU memory (strategy pool)*",
                            "*6.0 MiB*::test_5 (gw*)"])
    assert "M" in r.stdout.str()
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["strategy"] == {  # was null under xdist
        "name": "pool", "options": {"track_origins": False, "oom_snapshot": None, "route": "direct"}}
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    assert len(tests) == 8 and {t["worker"] for t in tests.values()} <= {"gw0", "gw1"}
    assert {tests[f"test_{i}"]["peak_bytes"] for i in range(6)} == {(i + 1) << 20 for i in range(6)}
    assert tests["test_leak"]["leaked_bytes"] == 1 << 20 and tests["test_over"]["verdict"] == "budget"
    assert doc["machine"]["backend"] == "fake"
    root = ET.parse(pytester.path / "junit.xml").getroot()
    props = [p.get("name") for p in root.iter("property")]
    assert props.count("gpumem_peak_bytes") == 8


@pytest.mark.parametrize("bad", ["marker", "strategy"])
def test_xdist_usage_errors_error_each_test_instead_of_crashing_the_workers(pytester, monkeypatch, bad):
    """From an adversarial trial: under -n 2 a bad marker was an INTERNALERROR (exit 3), and a strategy
    option only a device can check (accessed_by=7) crashed every worker over and over (exit 5)."""
    _xdist_env(monkeypatch)
    marker = '@pytest.mark.limit_gpu_memory("lots")\n' if bad == "marker" else ""
    pytester.makepyfile(HEAD + marker + "def test_a():\n    raise AssertionError('BODY RAN')\n"
                        "def test_b():\n    x = alloc(MiB)\n")
    args = ["--gpumem-strategy=managed:accessed_by=7"] if bad == "strategy" else ["--gpumem"]
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", *args)
    out = r.stdout.str() + r.stderr.str()
    assert "INTERNALERROR" not in out and "node down" not in out and "Traceback" not in out, out
    assert "BODY RAN" not in out
    if bad == "marker":
        r.assert_outcomes(passed=1, errors=1)
        r.stdout.fnmatch_lines(["*gpumem usage error: marker limit_gpu_memory('lots') on *::test_a: size: "
                                "cannot parse 'lots'*"])
    else:
        r.assert_outcomes(errors=2)
        r.stdout.fnmatch_lines(["*gpumem usage error: --gpumem-strategy='managed:accessed_by=7': *device 7*"])


def test_bad_markers_are_found_wherever_they_are_and_every_bad_argument_is_named(pytester, fake_env):
    """From an adversarial trial: a bad marker next to gpumem_skip, a bad class marker under a good
    function marker, and all but the first bad argument of a marker went unreported; an __index__
    that raised was an INTERNALERROR."""
    pytester.makepyfile("""
import pytest
class Big:
    def __index__(self):
        raise OverflowError("boom")
@pytest.mark.gpumem_skip
@pytest.mark.limit_gpu_memory("skipped_but_bad")
def test_skip():
    pass
@pytest.mark.limit_gpu_memory("bad_class")
class TestC:
    @pytest.mark.limit_gpu_memory("5GiB")
    def test_m(self):
        pass
@pytest.mark.limit_page_faults(gpu=-1, bogus=2)
def test_two_in_one():
    pass
@pytest.mark.limit_gpu_memory(Big())
def test_index_raises():
    pass
""")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert "INTERNALERROR" not in r.stdout.str() + err
    assert "limit_gpu_memory('skipped_but_bad') on *::test_skip".replace("*", "") not in err  # nodeid has a path
    r.stderr.fnmatch_lines(["ERROR: 4 bad gpumem markers:",
                            "*limit_gpu_memory('skipped_but_bad') on *::test_skip: size: cannot parse*",
                            "*limit_gpu_memory('bad_class') on *::TestC::test_m: size: cannot parse*",
                            "*limit_page_faults(gpu=-1, bogus=2) on *::test_two_in_one: unknown argument 'bogus'"
                            "*; gpu: expected a whole number >= 0 or None, got -1",
                            "*limit_gpu_memory(<*Big object*>) on *::test_index_raises: boom"])


def test_the_gpumem_fixture_measures_through_the_tests_own_strategy(pytester, fake_env):
    """From a new user's trial: with gpumem_strategy, gpumem.measure() read 0 (it measured the
    session's strategy), whichever fixture came first."""
    pytester.makepyfile(HEAD + """
@pytest.mark.parametrize("gpumem_strategy", ["device", "managed"], indirect=True)
def test_first(gpumem, gpumem_strategy):
    with gpumem.measure() as m:
        x = alloc(MiB)
    assert gpumem.strategy is gpumem_strategy
    assert m.peak >= MiB and m.allocated == 1
@pytest.mark.parametrize("gpumem_strategy", ["async"], indirect=True)
def test_second(gpumem_strategy, gpumem):
    with gpumem.measure() as m:
        x = alloc(MiB)
    assert m.peak >= MiB
""")
    r = run(pytester)
    r.assert_outcomes(passed=3)


def test_an_allocator_change_under_w_error_fails_the_test_that_made_it_cleanly(pytester, fake_env):
    """From a new user's trials: with -W error the GpuMemAllocatorWarning raised inside the plugin,
    a traceback of plugin frames; then it failed the next, innocent test."""
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_1_switches():
    cupy_memstrat.use("device")
def test_2_after():
    pass
def test_3_none():
    cupy.cuda.set_allocator(None)
def test_4_after_none():
    pass
""")
    r = run(pytester, "--gpumem", "-W", "error", "-p", "no:randomly")
    r.assert_outcomes(passed=2, failed=2)
    out = r.stdout.str()
    assert "plugin.py" not in out and "Traceback" not in out
    r.stdout.fnmatch_lines(["*_ test_1_switches _*",
                            "gpumem: CuPy's allocator changed during *::test_1_switches to strategy 'device'*"
                            "(GpuMemAllocatorWarning, an error under -W)"])
    r.stdout.fnmatch_lines(["*_ test_3_none _*",
                            "*changed during *::test_3_none to plain cudaMalloc, no pool "
                            "(cupy.cuda.set_allocator(None)), which is not a cupy_memstrat strategy*"])
    assert "FAILED *test_2_after" not in out and "FAILED *test_4" not in out


def test_history_without_json_says_where_the_timelines_go(pytester, fake_env):
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_leak():
    KEEP.append(alloc(MiB))
def test_use_in_body():
    cupy_memstrat.use("device")
    x = alloc(MiB)
    assert False
""")
    r = run(pytester, "--gpumem-history", "--gpumem-leaks=fail", "-p", "no:randomly")
    r.assert_outcomes(failed=2)
    r.stdout.fnmatch_lines(["gpumem: --gpumem-history recorded the timeline of 2 failing tests; they go into "
                            "--gpumem-json=PATH (none given)*"])
    r.stdout.fnmatch_lines(["*leaked 1 allocation*", "*allocations made by the test*",
                            "     1.0 MiB  device 0  0x*  *.py:* in alloc"])  # the recording knew where
    assert "(where each was allocated" not in r.stdout.str()
    r = run(pytester, "--gpumem-history", "--gpumem-history-keep=all", "--gpumem-leaks=warn", "-p", "no:randomly")
    r.stdout.fnmatch_lines(["gpumem: --gpumem-history recorded the timeline of 2 tests; they go into *"])
    r = run(pytester, "--gpumem-history", "--gpumem-leaks=fail", "-p", "no:randomly", "--gpumem-json=out.json")
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    assert tests["test_leak"]["history"]["events"]
    assert tests["test_use_in_body"]["history_error"].startswith("not recorded: the recording ended during the "
                                                                 "call: the test installed another allocator")


def test_second_trial_paths_are_usage_errors_never_internal_errors(pytester, fake_env):
    """From the second adversarial trial: a marker value whose __repr__ raises (INTERNALERROR), a
    bad CUPY_MEMSTRAT_BACKEND ignored when nothing was measured, a JSON name too long for the file
    system (found only at the end)."""
    pytester.makepyfile("""
import pytest
class BadRepr:
    def __repr__(self):
        raise RuntimeError("repr boom")
    def __index__(self):
        raise RuntimeError("index boom")
@pytest.mark.limit_gpu_memory(BadRepr())
def test_badrepr():
    pass
""")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "INTERNALERROR" not in r.stdout.str() + r.stderr.str()
    r.stderr.fnmatch_lines(["*marker limit_gpu_memory(<BadRepr object>) on *::test_badrepr: index boom"])
    pytester.makepyfile("def test_badrepr():\n    pass\n")
    r = run(pytester, "--gpumem", "--gpumem-json=" + "a" * 300 + ".json")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*a 305-character file or folder name; the file system takes at most *"])
    fake_env.setenv("CUPY_MEMSTRAT_BACKEND", "gpu")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # no gpumem option, no marker
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*CUPY_MEMSTRAT_BACKEND='gpu': unknown backend*"])


def test_xdist_checks_given_twice_error_each_test(pytester, monkeypatch):
    _xdist_env(monkeypatch)
    pytester.makepyfile("def test_a():\n    pass\n")
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--gpumem-check=all",
                                      "--gpumem-strategy=device:check=streams")
    out = r.stdout.str() + r.stderr.str()
    assert "node down" not in out and "INTERNALERROR" not in out
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*gpumem usage error: checks given in two places: --gpumem-check='all' and the check= "
                            "of --gpumem-strategy='device:check=streams'; give them in one place*"])


def test_the_gpumem_fixture_refuses_numbers_that_are_not_the_tests(pytester, fake_env):
    """From the second new user's trial: after the test called use(), gpumem.peak read 0."""
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_switch(gpumem):
    cupy_memstrat.use("device")
    x = alloc(5 * MiB)
    with gpumem.measure() as m:   # a block measures what allocates at the time
        y = alloc(2 * MiB)
    assert m.peak == 2 * MiB
    with pytest.raises(RuntimeError, match="gpumem: CuPy allocates through strategy 'device' now, installed "
                                           "after the gpumem fixture was set up"):
        gpumem.peak
@pytest.mark.parametrize("gpumem_strategy", ["devcie"], indirect=True)
def test_typo(gpumem_strategy):
    pass
""")
    r = run(pytester, "-p", "no:randomly")
    r.assert_outcomes(passed=1, errors=1)
    out = r.stdout.str()
    # once in the error's section, no chained traceback; the short summary repeats it in full
    # where pytest does not shorten it (CI=1 or BUILD_NUMBER set), so it is left out of the count
    errors = out.split("short test summary info")[0]
    assert errors.count("unknown strategy 'devcie'") == 1 and "During handling" not in out, out


# -- a test that replaces CuPy's allocator ------------------------------------------------------


def test_xdist_names_the_strategy_given_on_the_command_line(pytester, monkeypatch):
    _xdist_env(monkeypatch)
    pytester.makepyfile(HEAD + "def test_a():\n    x = alloc(MiB)\n")
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--gpumem", "--gpumem-strategy=device",
                                      "--gpumem-json=out.json")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*measured tests by peak GPU memory (strategy device)*"])
    assert json.loads((pytester.path / "out.json").read_text())["strategy"]["name"] == "device"


def test_a_strategy_installed_by_a_test_is_measured_through_and_said_once(pytester, fake_env):
    """The test that switches is reported as not measured (its allocations after the switch went
    elsewhere: a trial saw '0 B' rows and a leak that escaped); the tests after it are measured
    through the new strategy."""
    pytester.makepyfile(HEAD + """
import cupy_memstrat
def test_1_switches():
    cupy_memstrat.use("device")
    KEEP.append(alloc(2 * MiB))
def test_2_leaks():
    KEEP.append(alloc(MiB))
""")
    r = run(pytester, "--gpumem-leaks=fail", "-p", "no:randomly", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=1)  # the leak after the switch is still caught
    r.stdout.fnmatch_lines([
        "*leaked 1 allocation, 1.0 MiB > limit 0 B (--gpumem-leaks)*",
        "gpumem: CuPy's allocator changed during *test_1_switches to strategy 'device' *",
    ])
    r.stdout.fnmatch_lines(["*-        -  *::test_1_switches  [[]not measured: it changed CuPy's allocator[]]"])
    line = (pytester.path / "test_a_strategy_installed_by_a_test_is_measured_through_and_said_once.py").read_text()
    line = line.splitlines().index("def test_1_switches():") + 1  # the warning names the test that switched
    r.stdout.fnmatch_lines([f"*.py:{line}: GpuMemAllocatorWarning: CuPy's allocator changed during *test_1_switches*"])
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    t1 = tests["test_1_switches"]
    assert t1["measured"] is False and t1["leaked_bytes"] is None and "changed during" in t1["allocator_change"]
    assert t1["peak_bytes"] is None and t1["allocated"] is None  # no made-up 0 for a CI script to read
    assert t1["leak_check"] == "skipped: the test changed CuPy's allocator"
    assert tests["test_2_leaks"]["leaked_bytes"] == 1 << 20 and tests["test_2_leaks"]["strategy"] == "device"


def test_a_foreign_allocator_installed_by_a_test_stops_measuring_loudly(pytester, fake_env):
    pytester.makepyfile(HEAD + """
import cupy
def test_1_switches():
    cupy.cuda.set_allocator(None)
def test_2_after():
    pass
""")
    r = run(pytester, "--gpumem-leaks=fail", "-W", "default")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines([
        "*GpuMemAllocatorWarning: CuPy's allocator changed during *test_1_switches to plain cudaMalloc, no pool "
        "(cupy.cuda.set_allocator(None)), which is not a cupy_memstrat strategy*",
        "gpumem: CuPy's allocator changed during *test_1_switches to *the tests from here on are not measured*",
    ])


# -- the checking layer: --gpumem-check, --gpumem-stream-policy ----------------------------------------

CHECKS_HEAD = HEAD + """
import cupy_memstrat
def backend():
    return cupy_memstrat.current().backend
"""


def test_check_findings_fail_the_test_with_both_sites(pytester, fake_env):
    pytester.makepyfile(CHECKS_HEAD + """
def test_out_of_bounds():
    x = alloc(1000)
    backend().write(x.data.ptr + 1003, b"\\0")   # a kernel writing past the end
    del x
def test_write_after_free():
    x = alloc(1000)
    p = x.data.ptr
    del x
    backend().write(p, b"\\1")                  # a kernel still writing after the free
def test_cross_stream_reuse():
    b = backend()
    other = b.stream(non_blocking=True)
    with b.stream(non_blocking=True):
        x = alloc(1000)
        with other:
            y = alloc(10)
            b.launch(other)                       # a long kernel on the other stream reads x
        del x                                     # no event orders it before x's stream
def test_clean():
    x = alloc(1000)
    del x
""")
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=3)
    out = r.stdout.str()
    r.stdout.fnmatch_lines([
        "*gpumem: measuring every test through strategy 'pool'*checks: streams,poison,redzone (--gpumem-check)",
        "*MMM.*",
        "*1 check finding (out-of-bounds write): 1 byte of the red zone after a 1000 B block*byte 4 past the end*",
        "*allocated at *test_check_findings_fail_the_test_with_both_sites.py:* in alloc on stream 0*",
        "*freed at *test_check_findings_fail_the_test_with_both_sites.py:* in test_out_of_bounds while stream 0*",
        "*1 check finding (write after free)*",
        "*1 check finding (cross-stream reuse)*still had work queued*",
    ])
    assert out.count("[checks]") == 3
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["settings"]["check"] == ["poison", "redzone", "streams"]
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    assert tests["test_clean"]["n_findings"] == 0
    f = tests["test_out_of_bounds"]["findings"][0]
    assert (f["kind"] == "out-of-bounds write" and f["first_bad_offset"] == 1003
            and "test_out_of_bounds" in f["free_site"])


def test_without_checks_the_same_bugs_pass_unnoticed(pytester, fake_env):
    pytester.makepyfile(CHECKS_HEAD + """
def test_out_of_bounds():
    x = alloc(1000)
    backend().write(x.data.ptr + 1003, b"\\0")
""")
    run(pytester, "--gpumem").assert_outcomes(passed=1)


@pytest.mark.parametrize("where", ["env", "ini"])
def test_checks_from_the_environment_and_ini(pytester, fake_env, where):
    pytester.makepyfile(CHECKS_HEAD + """
def test_write_after_free():
    x = alloc(1000)
    p = x.data.ptr
    del x
    backend().write(p, b"\\1")
""")
    if where == "env":
        fake_env.setenv("GPUMEM_CHECK", "poison")
    else:
        pytester.makeini("[pytest]\ngpumem_check = poison\n")
    r = run(pytester)
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*checks: poison (*GPUMEM_CHECK*" if where == "env"
                            else "*checks: poison (ini key gpumem_check)"])


LEGACY = CHECKS_HEAD + """
def normalise(x):
    with backend().null_stream():    # library code that hard-codes the legacy default stream
        return alloc(x.size)
def test_uses_hard_coded_legacy_stream():
    x = alloc(100)
    y = normalise(x)
"""


def test_fresh_stream_policy_exposes_code_hard_coded_to_the_legacy_stream(pytester, fake_env):
    pytester.makepyfile(LEGACY)
    run(pytester, "--gpumem-check=streams").assert_outcomes(passed=1)  # missed without the policy
    r = run(pytester, "--gpumem-check=streams", "--gpumem-stream-policy=fresh")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "*stream policy: fresh (--gpumem-stream-policy)*",
        "*1 check finding (legacy stream): 100 B allocated on device 0 while the legacy default stream was current*",
        "*allocated at *in alloc on stream 0 (the legacy default stream)*",
    ])


def test_fresh_stream_policy_alone_runs_each_call_on_a_new_stream(pytester, fake_env):
    pytester.makepyfile(CHECKS_HEAD + """
import weakref
SEEN = []
def test_a():
    s = backend().current_stream()
    SEEN.append(weakref.ref(s))
    assert s.ptr not in (0, 1, 2) and s.non_blocking
def test_b():
    s = backend().current_stream()
    # a new stream (CUDA may give it the last one's handle: not a test of handles)
    assert SEEN[0]() is None and s.ptr not in (0, 1, 2) and s.non_blocking
""")
    run(pytester, "--gpumem-stream-policy=fresh").assert_outcomes(passed=2)


OOB = CHECKS_HEAD + """
from cupy_memstrat import checks
def test_1_out_of_bounds():
    x = alloc(1000)
    backend().write(x.data.ptr + 1000, b"\\\\0")
def test_2_clean():
    x = alloc(1000)
def test_3_clears_then_overruns():
    checks.clear()
    x = alloc(1000)
    backend().write(x.data.ptr + 1000, b"\\\\0")
"""


@pytest.mark.parametrize("how", ["option", "spec", "conftest"])
def test_checks_given_any_way_are_reported_per_test(pytester, fake_env, how):
    pytester.makepyfile(OOB)
    args = ["--gpumem"]
    if how == "option":
        args.append("--gpumem-check=redzone")
    elif how == "spec":
        args.append("--gpumem-strategy=pool:check=redzone")
    else:
        pytester.makeconftest("import cupy_memstrat\ncupy_memstrat.use('pool', check='redzone', on_finding='record')\n")
        args.append("--gpumem-check=redzone")  # already checked: adopted, not wrapped twice
    r = run(pytester, *args)
    r.assert_outcomes(passed=1, failed=2)
    r.stdout.fnmatch_lines(["*GPUMEM*test_1_out_of_bounds*", "*GPUMEM*test_3_clears_then_overruns*"])


def test_checks_in_two_places_are_a_usage_error(pytester, fake_env):
    pytester.makepyfile("def test_a():\n    pass\n")
    r = run(pytester, "--gpumem-check=streams", "--gpumem-strategy=device:check=poison")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert r.stderr.str().strip() == (
        "ERROR: checks given in two places: --gpumem-check='streams' and the check= of "
        "--gpumem-strategy='device:check=poison'; give them in one place")


def test_fresh_stream_policy_on_two_devices_reports_nothing_on_the_other(pytester, monkeypatch):
    for k in list(os.environ):
        if k.startswith("GPUMEM"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:devices=2,memory=1GiB")
    monkeypatch.setattr(C, "_backend", None)
    pytester.makepyfile(CHECKS_HEAD + """
def test_two_devices():
    x = alloc(100)
    backend().set_device(1)
    try:
        y = alloc(100)
    finally:
        backend().set_device(0)
""")
    prev = cupy.cuda.get_allocator()
    try:
        run(pytester, "--gpumem-check=streams", "--gpumem-stream-policy=fresh").assert_outcomes(passed=1)
    finally:
        cupy.cuda.set_allocator(prev)
