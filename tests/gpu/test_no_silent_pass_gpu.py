"""No silent pass, on the GPU: a test file of the three bugs the checks exist for (a stream
race, a write after free, an out-of-bounds write), each test's last act the bad free, is caught
whichever way the checks are asked for and under every strategy. The control runs the same file
without checks: every bug passes unnoticed.

Each inner session runs in a subprocess (the outer process has CUDA initialised)."""

import json

import pytest

import cupy_memstrat
from cupy_memstrat.registry import get_registry

BUGS = '''
import numpy as np
import pytest
import cupy
import cupy_memstrat

N = 1 << 20
SPIN = 100_000_000  # clock cycles a "long kernel" waits first: ~50 ms on an H200
from cupy_memstrat.bench.streams import KERNELS  # slow_copy(x, y, n, cycles), slow_fill(x, n, v, cycles)

K = cupy.RawModule(code=KERNELS + r"""
extern "C" __global__ void fill_n(float* x, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
""")
slow_copy, slow_fill, fill_n = (K.get_function(n) for n in ("slow_copy", "slow_fill", "fill_n"))
KEEP = []


def stream_race():
    A, B = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with A:
        x = cupy.ones(N, dtype=cupy.float32)
        A.synchronize()
    with B:
        y = cupy.zeros(N, dtype=cupy.float32)
        B.synchronize()
        slow_copy((1,), (256,), (x, y, np.int32(N), np.int64(SPIN)))  # B reads x for a while
    KEEP.append(y)
    with A:
        del x  # nothing orders B's read before A reuses the block


def write_after_free():
    A, B = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with A:
        x = cupy.zeros(N, dtype=cupy.float32)
        A.synchronize()
    with B:
        slow_fill((1,), (256,), (x, np.int32(N), np.float32(5.0), np.int64(SPIN)))  # B writes x later
    with A:
        del x  # freed while B will still write it


def out_of_bounds():
    x = cupy.zeros(1000, dtype=cupy.float32)
    fill_n((4,), (256,), (x, np.int32(1003), np.float32(1.0)))  # three elements too many
    del x


def clean():
    x = cupy.arange(1000, dtype=cupy.float32)
    assert float(x.sum()) == 499500.0
'''

PLAIN = '''
def test_stream_race():
    stream_race()
def test_write_after_free():
    write_after_free()
def test_out_of_bounds():
    out_of_bounds()
def test_clean():
    clean()
'''

# the test's own strategy: the gpumem_strategy fixture (parametrised by _parametrized)
FIXTURE = PLAIN.replace("():", "(gpumem_strategy):")

OWN = '''
def test_stream_race():
    with cupy_memstrat.using(SPEC, check="all"):
        stream_race()
def test_write_after_free():
    with cupy_memstrat.using(SPEC, check="all"):
        write_after_free()
def test_out_of_bounds():
    with cupy_memstrat.using(SPEC, check="all"):
        out_of_bounds()
def test_clean():
    with cupy_memstrat.using(SPEC, check="all"):
        clean()
'''

USE = '''
def test_0_installs_its_own_strategy():
    cupy_memstrat.use(SPEC)
''' + PLAIN


def _strategies():
    reg = get_registry()
    return [pytest.param(n, marks=pytest.mark.skip(reason=reg.get(n).unavailable()) if reg.get(n).unavailable()
                         else ()) for n in ("device", "managed", "async", "pool", "torch")]


def _session(inner, way, strategy):
    """Write the bugs' file for ``way`` and run it; returns the run and its JSON report."""
    args = ["-p", "no:cacheprovider", "--gpumem-json=out.json", "-W", "ignore::DeprecationWarning"]
    spec = repr(strategy)
    if way == "option":
        body, args = PLAIN, args + ["--gpumem-check=all", f"--gpumem-strategy={strategy}"]
    elif way == "spec":
        body, args = PLAIN, args + [f"--gpumem-strategy={strategy}:check=all"]
    elif way == "env":
        body = PLAIN
        inner.monkeypatch.setenv("CUPY_MEMSTRAT", f"{strategy}:check=all")
    elif way == "ini":
        body = PLAIN
        inner.makeini(f"[pytest]\ngpumem_strategy = {strategy}:check=all\n")
    elif way == "fixture":  # the gpumem_strategy fixture under --gpumem-check
        body = _parametrized(spec)
        args.append("--gpumem-check=all")
    elif way == "marker":  # the fixture's own spec, checks included, and no option
        body = _parametrized(repr(f"{strategy}:check=all"))
    elif way == "own":  # the test's own checked strategy (using), and no option
        body = OWN.replace("SPEC", spec)
    elif way == "use":  # a test installs an unchecked strategy under --gpumem-check
        body = USE.replace("SPEC", spec)
        args.append("--gpumem-check=all")
    else:
        body = PLAIN  # the control: no checks
        args += ["--gpumem", f"--gpumem-strategy={strategy}"]
    inner.makepyfile(test_bugs=BUGS + body)
    r = inner.runpytest_subprocess(*args)
    path = inner.path / "out.json"
    return r, (json.loads(path.read_text()) if path.exists() else None)


def _parametrized(spec):
    return "\n".join(
        line if not line.startswith("def test_") else
        f"@pytest.mark.parametrize('gpumem_strategy', [{spec}], indirect=True)\n{line}"
        for line in FIXTURE.splitlines())


@pytest.fixture
def inner_mp(inner, monkeypatch):
    inner.monkeypatch = monkeypatch
    monkeypatch.delenv("CUPY_MEMSTRAT", raising=False)
    return inner


WAYS = ["option", "spec", "env", "ini", "fixture", "marker", "own", "use"]


@pytest.mark.parametrize("strategy", _strategies())
@pytest.mark.parametrize("way", WAYS)
def test_the_three_bugs_are_caught_whichever_way_the_checks_are_asked(inner_mp, way, strategy):
    r, doc = _session(inner_mp, way, strategy)
    passed = 2 if way == "use" else 1  # the clean test (and the one that installs a strategy)
    r.assert_outcomes(passed=passed, failed=3)
    out = r.stdout.str()
    failing = {line.split("::")[1].split("[")[0].split(" ")[0] for line in r.stdout.lines
               if line.startswith(("FAILED test_bugs.py::", "GPUMEM test_bugs.py::"))}
    assert failing == {"test_stream_race", "test_write_after_free", "test_out_of_bounds"}, out
    r.stdout.fnmatch_lines(["*out-of-bounds write*"])
    assert "write after free" in out or "cross-stream reuse" in out
    if doc is not None and doc["tests"] and way != "own" and way != "marker":
        rec = {t["nodeid"].split("::")[1].split("[")[0]: t for t in doc["tests"]}
        assert rec["test_out_of_bounds"]["checked"] is True and rec["test_out_of_bounds"]["n_findings"] >= 1
        assert rec["test_clean"]["checked"] is True and rec["test_clean"]["n_findings"] == 0


@pytest.mark.parametrize("strategy", ["pool", "async"])
def test_control_without_checks_the_three_bugs_pass(inner_mp, strategy):
    r, doc = _session(inner_mp, "none", strategy)
    r.assert_outcomes(passed=4)
    assert all("checked" not in t for t in doc["tests"])


def test_a_users_own_unchecked_strategy_is_reported_unchecked(inner_mp):
    inner_mp.makepyfile(test_bugs=BUGS + '''
@pytest.fixture
def own():
    with cupy_memstrat.using("async"):
        yield
def test_out_of_bounds(own):
    out_of_bounds()
''')
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, warnings=1)
    r.stdout.fnmatch_lines(["*GpuMemUncheckedWarning*",
                            "*1 test ran, in whole or in part, under a strategy of its own*unchecked*"])
    (t,) = json.loads((inner_mp.path / "out.json").read_text())["tests"]
    assert t["checked"] is False and "n_findings" not in t and "using()" in t["unchecked"]
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=all",
                                      "-W", "error::pytest_gpumem.plugin.GpuMemUncheckedWarning")
    r.assert_outcomes(failed=1)


@pytest.mark.parametrize("strategy", ["device", "async", "managed"])
def test_a_switch_to_an_unchecked_strategy_and_back_within_the_call_is_reported_unchecked(inner_mp, strategy):
    """The allocator is the session's again when the call ends: still never checked and clean."""
    inner_mp.makepyfile(test_bugs=BUGS + f'''
def test_using_in_the_body():
    with cupy_memstrat.using({strategy!r}):
        out_of_bounds()
def test_use_then_restore():
    prev = cupy.cuda.get_allocator()
    cupy_memstrat.use({strategy!r})
    out_of_bounds()
    cupy.cuda.set_allocator(prev)
def test_using_with_checks():
    with cupy_memstrat.using({strategy!r}, check="all", on_finding="record"):
        out_of_bounds()
''')
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2, failed=1, warnings=2)
    rec = {t["nodeid"].split("::")[1]: t for t in json.loads((inner_mp.path / "out.json").read_text())["tests"]}
    for name in ("test_using_in_the_body", "test_use_then_restore"):
        assert rec[name]["checked"] is False and "n_findings" not in rec[name], rec[name]
        assert rec[name]["unchecked"].startswith(f"switched to strategy {strategy!r} during its call")
    assert rec["test_using_with_checks"]["n_findings"] >= 1


def test_a_fixtures_setup_finding_fails_the_test(inner_mp):
    inner_mp.makepyfile(test_bugs=BUGS + '''
@pytest.fixture
def buggy():
    out_of_bounds()
    yield
def test_uses_it(buggy):
    clean()
''')
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=all")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*out-of-bounds write*"])
    inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem").assert_outcomes(passed=1)  # control


def test_a_checked_conftest_strategy_checks_the_gpumem_strategy_fixture(inner_mp):
    inner_mp.makeconftest("import cupy_memstrat\ncupy_memstrat.use('pool', check='all', on_finding='record')\n")
    inner_mp.makepyfile(test_bugs=BUGS + _parametrized("'async'"))
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem")
    r.assert_outcomes(passed=1, failed=3)


def test_a_fixture_on_cupys_own_allocator_leaves_the_checks_on_for_the_tests_after_it(inner_mp):
    inner_mp.makepyfile(test_bugs=BUGS + '''
@pytest.fixture
def cupy_alloc():
    with cupy.cuda.using_allocator(cupy.cuda.memory._malloc):
        yield
def test_a_on_cupys_allocator(cupy_alloc):
    out_of_bounds()
def test_b_out_of_bounds():
    out_of_bounds()
def test_c_narrower_checks():
    with cupy_memstrat.using("async", check="poison", on_finding="record"):
        out_of_bounds()
''')
    r = inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2, failed=1, warnings=2)
    rec = {t["nodeid"].split("::")[1]: t for t in json.loads((inner_mp.path / "out.json").read_text())["tests"]}
    assert rec["test_a_on_cupys_allocator"]["checked"] is False
    assert rec["test_b_out_of_bounds"]["n_findings"] >= 1
    assert rec["test_c_narrower_checks"]["checked"] is False
    assert "(checks poison only)" in rec["test_c_narrower_checks"]["unchecked"]


def test_gpumem_check_off_switches_off_the_specs_checks(inner_mp):
    inner_mp.monkeypatch.setenv("CUPY_MEMSTRAT", "async:check=all")
    inner_mp.makepyfile(test_bugs=BUGS + PLAIN)
    inner_mp.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=3)  # control
    inner_mp.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-check=off").assert_outcomes(passed=4)


def test_run_reports_the_findings_of_the_last_free_and_exits_non_zero(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(BUGS + "\nout_of_bounds()\n")
    cmd = [sys.executable, "-m", "cupy_memstrat", "run", "-s", "async:check=all", str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "the checks found 1 problem during the run" in p.stderr and "out-of-bounds write" in p.stderr
    p = subprocess.run(cmd[:5] + ["async", str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "problem" not in p.stderr  # the control: unchecked, nothing is said
    assert cupy_memstrat  # the package under test is importable here (the subprocesses use it)
