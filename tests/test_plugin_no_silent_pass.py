"""No silent pass: every finding reaches the verdict, whichever way the checks or the strategy
were chosen (option, strategy spec, environment, ini, the gpumem_strategy fixture, a test's own
use()/using()), on the simulated GPU; each with a control that passes without the checks. Also
the report a run of no test leaves alone, pytest 9's native TOML table, and unittest's setUp in
the window."""

import json

import pytest

cupy = pytest.importorskip("cupy", reason="the plugin's tests make CuPy arrays (no GPU needed)")

BUGS = """
import numpy as np
import pytest
import cupy
import cupy_memstrat

def alloc(n):
    return cupy.ndarray((n,), dtype=np.uint8)

def backend():
    return cupy_memstrat.current().backend

def out_of_bounds():
    x = alloc(1000)
    backend().write(x.data.ptr + 1000, b"\\0")   # a kernel writing one byte past the end
    del x                                         # the test's last act: the free

def write_after_free():
    x = alloc(1000)
    p = x.data.ptr
    del x
    backend().write(p, b"\\1")                    # a kernel still writing after the free

def stream_race():
    b = backend()
    other = b.stream(non_blocking=True)
    with b.stream(non_blocking=True):
        x = alloc(1000)
        with other:
            y = alloc(10)
            b.launch(other)                       # a long kernel on the other stream reads x
        del x                                     # no event orders it before x's stream
"""

PLAIN = """
def test_out_of_bounds():
    out_of_bounds()
def test_write_after_free():
    write_after_free()
def test_stream_race():
    stream_race()
def test_clean():
    alloc(1000)
"""


def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def _tests(pytester, name="out.json"):
    doc = json.loads((pytester.path / name).read_text())
    return {t["nodeid"].split("::")[-1].split("[")[0]: t for t in doc["tests"]}


@pytest.mark.parametrize("way", ["option", "spec", "GPUMEM_STRATEGY", "CUPY_MEMSTRAT", "ini-strategy", "ini-check",
                                 "toml-check"])
def test_session_checks_fail_the_three_bugs_however_they_are_given(pytester, fake_env, way):
    pytester.makepyfile(BUGS + PLAIN)
    args = ["--gpumem-json=out.json"]
    if way == "option":
        args.append("--gpumem-check=all")
    elif way == "spec":
        args.append("--gpumem-strategy=async:check=all")
    elif way in ("GPUMEM_STRATEGY", "CUPY_MEMSTRAT"):
        fake_env.setenv(way, "async:check=all")
    elif way == "ini-strategy":
        pytester.makeini("[pytest]\ngpumem_strategy = device:check=all\n")
    elif way == "ini-check":
        pytester.makeini("[pytest]\ngpumem_check = all\n")
    else:
        pytester.makepyprojecttoml('[tool.pytest]\ngpumem_check = "all"\n')
    r = run(pytester, *args)
    r.assert_outcomes(passed=1, failed=3)
    tests = _tests(pytester)
    assert {n for n, t in tests.items() if t["verdict"] == "checks"} == {
        "test_out_of_bounds", "test_write_after_free", "test_stream_race"}
    assert tests["test_clean"]["checked"] is True and tests["test_clean"]["n_findings"] == 0


def test_control_without_checks_the_three_bugs_pass(pytester, fake_env):
    pytester.makepyfile(BUGS + PLAIN)
    run(pytester, "--gpumem-strategy=async", "--gpumem-json=out.json").assert_outcomes(passed=4)
    assert all("checked" not in t and "n_findings" not in t for t in _tests(pytester).values())


FIXTURE = PLAIN.replace("():", "(gpumem_strategy):")


def _parametrized(body, spec):
    return "\n".join(f"@pytest.mark.parametrize('gpumem_strategy', [{spec!r}], indirect=True)\n{line}"
                     if line.startswith("def test_") else line for line in body.splitlines())


def test_the_gpumem_strategy_fixture_takes_the_sessions_checks(pytester, fake_env):
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "async"))
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=3)
    t = _tests(pytester)["test_clean"]
    assert t["strategy"] == "async" and t["checked"] is True and t["n_findings"] == 0


def test_a_fixture_param_with_checks_fails_the_bugs_without_any_option(pytester, fake_env):
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "device:check=all"))
    run(pytester).assert_outcomes(passed=1, failed=3)
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "device"))  # the control
    run(pytester).assert_outcomes(passed=4)


OWN = """
@pytest.fixture
def own():
    with cupy_memstrat.using("async", check="all") as s:
        yield s
def test_in_a_fixture(own):
    out_of_bounds()
def test_in_the_body():
    with cupy_memstrat.using("async", check="all"):
        write_after_free()
def test_installed_by_the_test():
    cupy_memstrat.use("device", check="redzone")
    out_of_bounds()
def test_checks_it_asserts_itself():
    from cupy_memstrat import checks
    with cupy_memstrat.using("async", check="redzone", on_finding="record"):
        out_of_bounds()
    assert [f.kind for f in checks.collect()] == ["out-of-bounds write"]
    checks.clear()  # asserted: not the session's to judge (under a checked session strategy)
"""


@pytest.mark.parametrize("args", [(), ("--gpumem",)], ids=["unmeasured", "measured"])
def test_a_tests_own_checked_strategy_fails_it_on_the_findings_it_has_not_raised(pytester, fake_env, args):
    """The findings of the last free are still pending when the test returns: the plugin collects
    them. A test that records its findings and asserts them itself passes."""
    pytester.makepyfile(BUGS + OWN)
    r = run(pytester, *args)
    r.assert_outcomes(passed=1, failed=3)
    r.stdout.fnmatch_lines(["*out-of-bounds write*"])


# a fixture of the user's own that runs the test under a strategy it made (the session's checks cannot wrap it)
UNCHECKED_OWN = """
@pytest.fixture
def own():
    with cupy_memstrat.using("async"):
        yield
"""


def test_a_users_own_unchecked_strategy_is_reported_unchecked_never_clean(pytester, fake_env):
    pytester.makepyfile(BUGS + UNCHECKED_OWN + """
def test_under_its_own(own):
    out_of_bounds()
""")
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, warnings=1)
    r.stdout.fnmatch_lines(["*GpuMemUncheckedWarning*ran under strategy 'async' of its own*",
                            "gpumem: 1 test ran, in whole or in part, under a strategy of its own that the session's "
                            "checks do not wrap, unchecked (GpuMemUncheckedWarning; the JSON report says why for "
                            "each): test_a_users_own_unchecked*::test_under_its_own"])
    t = _tests(pytester)["test_under_its_own"]
    assert t["checked"] is False and "n_findings" not in t and "using()" in t["unchecked"]
    r = run(pytester, "--gpumem-check=all", "-W", "error::pytest_gpumem.plugin.GpuMemUncheckedWarning")
    r.assert_outcomes(failed=1)


def test_a_strategy_a_test_installs_is_wrapped_in_the_sessions_checks(pytester, fake_env):
    pytester.makepyfile(BUGS + """
def test_0_installs_device():
    cupy_memstrat.use("device")
""" + PLAIN)
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2, failed=3)
    r.stdout.fnmatch_lines(["*strategy 'device'*gpumem measures through it from here on, with the session's checks "
                            "(streams,poison,redzone) around it*"])
    tests = _tests(pytester)
    assert tests["test_0_installs_device"]["checked"] is False
    assert tests["test_clean"]["checked"] is True and tests["test_clean"]["strategy"] == "device"


def test_spec_checks_show_in_the_header_with_their_source(pytester, fake_env):
    pytester.makepyfile("def test_a():\n    pass\n")
    fake_env.setenv("CUPY_MEMSTRAT", "async:check=poison")
    r = run(pytester)
    r.stdout.fnmatch_lines(["gpumem: measuring every test through strategy 'async'*checks: poison "
                            "(environment variable CUPY_MEMSTRAT)"])


@pytest.mark.parametrize("flag", ["--collect-only", "--setup-only", "--setup-plan"])
def test_a_run_of_no_test_leaves_the_report_alone(pytester, fake_env, flag):
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.makeini("[pytest]\ngpumem_json = out.json\n")
    run(pytester, "--gpumem").assert_outcomes(passed=1)
    before = (pytester.path / "out.json").read_text()
    assert len(json.loads(before)["tests"]) == 1
    r = run(pytester, "--gpumem", flag)
    r.stdout.fnmatch_lines([f"gpumem: {flag} runs no test: the JSON report out.json is not written*"])
    assert (pytester.path / "out.json").read_text() == before
    run(pytester, "--gpumem", "--gpumem-compare=out.json").assert_outcomes(passed=1)  # still a baseline


def test_pytest9_native_toml_table_takes_booleans_and_numbers(pytester, fake_env):
    if pytest.version_tuple < (9,):
        pytest.skip("the native [tool.pytest] table is pytest 9's")
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.makepyprojecttoml("[tool.pytest]\ngpumem = true\ngpumem_top = 5\ngpumem_history = false\n")
    r = run(pytester)
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*gpumem: measuring every test*", "*top 1 of 1 measured tests*"])
    pytester.makepyprojecttoml('[tool.pytest]\ngpumem = "maybe"\n')
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR


@pytest.mark.parametrize("text, message", [
    ("gpumem = maybe", "ini key gpumem='maybe': expected one of 1, true, yes, on, 0, false, no, off"),
    ("gpumem_top = many", "ini key gpumem_top='many': expected a whole number of tests >= 0"),
    # pytest before 9.2 converts ini text itself (it takes these); from 9.2 the plugin's parsers read it
    *(pytest.param(text, message, marks=pytest.mark.skipif(pytest.version_tuple[:2] < (9, 2),
                                                         reason="pytest before 9.2 converts ini text itself"))
      for text, message in [
          ("gpumem_top = 1_000", "ini key gpumem_top='1_000': expected a whole number of tests >= 0 (ASCII digits)"),
          ("gpumem_top = +5", "ini key gpumem_top='+5': expected a whole number of tests >= 0 (ASCII digits)"),
          ("gpumem = y", "ini key gpumem='y': expected one of 1, true, yes, on, 0, false, no, off")]),
])
def test_ini_values_of_the_wrong_type_name_the_key(pytester, fake_env, text, message):
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.makeini(f"[pytest]\n{text}\n")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR and message in r.stderr.str(), r.stderr.str()


def test_unittest_setup_and_teardown_run_inside_the_measured_call(pytester, fake_env):
    """As docs/pytest.md says: pytest runs setUp and tearDown in the call; setUpClass in the setup."""
    pytester.makepyfile("""
import unittest
import numpy as np
import cupy
class T(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.big = cupy.ndarray((4 << 20,), dtype=np.uint8)
    def setUp(self):
        self.x = cupy.ndarray((1 << 20,), dtype=np.uint8)
    def tearDown(self):
        del self.x
    def test_nothing(self):
        pass
""")
    run(pytester, "--gpumem-leaks=fail", "--gpumem-json=out.json").assert_outcomes(passed=1)
    t = _tests(pytester)["test_nothing"]
    assert t["peak_bytes"] == 1 << 20 and t["leaked_bytes"] == 0


def test_under_xdist_the_controller_lists_the_unchecked_tests(pytester, monkeypatch):
    pytest.importorskip("xdist")
    import os

    for k in list(os.environ):
        if k.startswith("GPUMEM"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")
    pytester.makepyfile(BUGS + UNCHECKED_OWN + """
def test_under_its_own(own):
    alloc(10)
def test_out_of_bounds():
    out_of_bounds()
""")
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--gpumem-check=all")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["gpumem: 1 test ran, in whole or in part, under a strategy of its own that the "
                            "session's checks do not wrap, unchecked (GpuMemUncheckedWarning; the JSON report says "
                            "why for each): *::test_under_its_own"])


def test_a_skipped_tests_pending_finding_does_not_fail_the_next_test(pytester, fake_env):
    pytester.makepyfile(BUGS + """
@pytest.mark.gpumem_skip
def test_a_exempt():
    with cupy_memstrat.using("async", check="redzone"):
        out_of_bounds()
def test_b_clean():
    pass
""")
    run(pytester).assert_outcomes(passed=2)


SWITCH_AND_BACK = """
def test_using_in_the_body():
    with cupy_memstrat.using("async"):
        out_of_bounds()
def test_use_then_restore():
    prev = cupy.cuda.get_allocator()
    cupy_memstrat.use("device")
    out_of_bounds()
    cupy.cuda.set_allocator(prev)
def test_using_with_its_own_checks():
    with cupy_memstrat.using("async", check="all", on_finding="record"):
        out_of_bounds()
def test_using_with_fewer_checks():
    with cupy_memstrat.using("async", check="poison", on_finding="record"):
        stream_race()
def test_clean():
    alloc(10)
"""


def test_a_strategy_switched_to_and_back_within_the_call_is_reported_unchecked(pytester, fake_env):
    """The allocator is the session's again when the call ends; the plugin still sees the switch
    (cupy_memstrat.installs) and says the test was not checked, never checked with 0 findings."""
    pytester.makepyfile(BUGS + SWITCH_AND_BACK)
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=4, failed=1, warnings=3)
    r.stdout.fnmatch_lines(["*GPUMEM*test_using_with_its_own_checks*"])
    tests = _tests(pytester)
    for name, how in (("test_using_in_the_body", "'async' during its call (cupy_memstrat.using())"),
                      ("test_use_then_restore", "'device' during its call (cupy_memstrat.use())")):
        t = tests[name]
        assert t["checked"] is False and "n_findings" not in t, t
        assert t["unchecked"].startswith(f"switched to strategy {how}, which the session's checks do not wrap")
    fewer = tests["test_using_with_fewer_checks"]
    assert fewer["checked"] is False and "'async' (checks poison only)" in fewer["unchecked"]
    assert tests["test_clean"]["checked"] is True and tests["test_clean"]["n_findings"] == 0
    assert "[unchecked]" in r.stdout.str()
    r = run(pytester, "--gpumem-check=all", "-W", "error::pytest_gpumem.plugin.GpuMemUncheckedWarning")
    r.assert_outcomes(passed=1, failed=4)


def test_findings_of_a_fixtures_setup_are_the_tests(pytester, fake_env):
    pytester.makepyfile(BUGS + """
@pytest.fixture
def buggy():
    out_of_bounds()
    yield
def test_uses_it(buggy):
    pass
""")
    r = run(pytester, "--gpumem-check=all")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*out-of-bounds write*"])
    run(pytester).assert_outcomes(passed=1)  # the control: no checks


def test_a_checked_strategy_from_conftest_gives_the_gpumem_strategy_fixture_its_checks(pytester, fake_env):
    pytester.makeconftest("import cupy_memstrat\n"
                          "cupy_memstrat.use('pool', check='all', on_finding='record')\n")
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "async"))
    r = run(pytester, "--gpumem", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=3)
    r.stdout.fnmatch_lines(["*checks: streams,poison,redzone (the checked strategy installed before the session)*"])
    assert _tests(pytester)["test_clean"]["checks"] == ["streams", "poison", "redzone"]


def test_a_fixture_param_narrowing_the_checks_is_reported_unchecked(pytester, fake_env):
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "async:check=poison"))
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=3, failed=1, warnings=4)  # only the write after free: no redzone, no streams
    t = _tests(pytester)["test_clean"]
    assert t["checked"] is False and "with checks poison only, fewer than the session's" in t["unchecked"]
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "async:check=all"))  # all of them: checked
    run(pytester, "--gpumem-check=all", "--gpumem-json=out.json").assert_outcomes(passed=1, failed=3)
    assert _tests(pytester)["test_clean"]["checks"] == ["streams", "poison", "redzone"]


def test_a_fixture_param_with_checks_off_is_told_to_drop_it(pytester, fake_env):
    pytester.makepyfile(BUGS + _parametrized(FIXTURE, "async:check=off"))
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=4, warnings=4)
    t = _tests(pytester)["test_out_of_bounds"]
    assert t["checked"] is False and "n_findings" not in t
    assert "whose parameter turns the checks off (check=off)" in t["unchecked"]


def test_gpumem_check_off_switches_off_the_checks_of_the_strategy_spec(pytester, fake_env):
    pytester.makepyfile(BUGS + PLAIN)
    fake_env.setenv("CUPY_MEMSTRAT", "async:check=all")
    run(pytester).assert_outcomes(passed=1, failed=3)  # the control: the spec's checks judge
    r = run(pytester, "--gpumem-check=off", "--gpumem", "--gpumem-json=out.json")
    r.assert_outcomes(passed=4)
    assert "checks:" not in r.stdout.str()
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["settings"]["check"] == [] and doc["strategy"]["name"] == "async"
    assert "check" not in doc["strategy"]["options"]


def test_a_strategy_spec_with_checks_off_runs(pytester, fake_env):
    pytester.makepyfile(BUGS + PLAIN)
    fake_env.setenv("CUPY_MEMSTRAT", "async:check=off")
    r = run(pytester, "--gpumem")
    r.assert_outcomes(passed=4)
    r.stdout.fnmatch_lines(["gpumem: CuPy allocates with strategy 'async'*"])


def test_an_empty_ini_key_is_unset(pytester, fake_env):
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.makeini("[pytest]\ngpumem =\n")
    r = run(pytester)
    r.assert_outcomes(passed=1)
    assert "gpumem: measuring" not in r.stdout.str()


@pytest.mark.parametrize("args", [(), ("--gpumem",)], ids=["unmeasured", "measured"])
def test_an_xpassing_test_with_pending_findings_has_one_outcome_measured_or_not(pytester, fake_env, args):
    pytester.makepyfile(BUGS + """
@pytest.mark.xfail(strict=False)
def test_expected_to_fail():
    with cupy_memstrat.using("async", check="redzone"):
        out_of_bounds()
""")
    r = run(pytester, "-rA", *args)
    r.assert_outcomes(xpassed=1)
    r.stdout.fnmatch_lines(["*gpumem checks*", "*out-of-bounds write*"])


def test_a_fixture_that_uses_cupys_own_allocator_for_a_while_does_not_stop_the_checks(pytester, fake_env):
    pytester.makepyfile(BUGS + """
@pytest.fixture
def cupy_pool():
    with cupy.cuda.using_allocator(cupy.cuda.memory._malloc):
        yield
@pytest.fixture
def no_pool_for_a_while():
    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(None)
    yield
    cupy.cuda.set_allocator(prev)
def test_a_uses_cupy_pool(cupy_pool):
    pass
def test_b_oob():
    out_of_bounds()
def test_c_no_pool(no_pool_for_a_while):
    pass
def test_d_waf():
    write_after_free()
""")
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2, failed=2, warnings=2)
    tests = _tests(pytester)
    a = tests["test_a_uses_cupy_pool"]
    assert a["checked"] is False and "cupy.cuda.using_allocator() of plain cudaMalloc" in a["unchecked"]
    assert tests["test_b_oob"]["n_findings"] >= 1 and tests["test_d_waf"]["n_findings"] >= 1
    r.stdout.fnmatch_lines(["*strategy 'pool' again before *test_d_waf: gpumem measures (and checks) through it*"])


def test_a_thread_a_fixture_starts_inside_using_is_seen(pytester, fake_env):
    pytester.makepyfile(BUGS + """
import queue, threading
@pytest.fixture(scope="module")
def worker():
    jobs, done = queue.Queue(), queue.Queue()
    def loop():
        with cupy_memstrat.using("async"):
            while (job := jobs.get()) is not None:
                job(); done.put(1)
    t = threading.Thread(target=loop)
    t.start()
    yield lambda job: (jobs.put(job), done.get())
    jobs.put(None); t.join()
def test_oob_in_the_worker(worker):
    worker(out_of_bounds)
""")
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, warnings=1)
    t = _tests(pytester)["test_oob_in_the_worker"]
    assert t["checked"] is False and "switched to strategy 'async'" in t["unchecked"]


def test_a_checked_conftest_strategy_judges_every_test_without_any_option(pytester, fake_env):
    pytester.makeconftest("import cupy_memstrat\ncupy_memstrat.use('pool', check='all', on_finding='record')\n")
    pytester.makepyfile(BUGS + PLAIN)
    r = run(pytester, "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=3)
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["settings"]["check"] == ["poison", "redzone", "streams"] and len(doc["tests"]) == 4


def test_findings_of_the_sessions_checks_fail_a_test_that_then_runs_unchecked(pytester, fake_env):
    pytester.makepyfile(BUGS + """
@pytest.fixture
def buggy_then_own():
    out_of_bounds()
    with cupy_memstrat.using("async"):
        yield
def test_it(buggy_then_own):
    pass
""")
    r = run(pytester, "--gpumem-check=all", "--gpumem-json=out.json")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*out-of-bounds write*"])
    assert _tests(pytester)["test_it"]["checked"] is False


def test_record_history_of_another_strategy_in_the_body_is_seen(pytester, fake_env):
    pytester.makepyfile(BUGS + """
def test_it():
    cupy_memstrat.record_history(strategy=cupy_memstrat.create("device"))
    out_of_bounds()
    cupy_memstrat.record_history(False)
""")
    run(pytester, "--gpumem-check=all", "--gpumem-json=out.json").assert_outcomes(passed=1, warnings=1)
    t = _tests(pytester)["test_it"]
    assert t["checked"] is False and "cupy_memstrat.record_history()" in t["unchecked"]


def test_a_finding_in_the_setup_of_a_test_that_skips_is_its_own(pytester, fake_env):
    pytester.makepyfile(BUGS + """
@pytest.fixture
def buggy():
    out_of_bounds()
    yield
@pytest.fixture
def needs_x():
    pytest.skip("feature X not available")
def test_a(buggy, needs_x):
    pass
def test_b_clean():
    pass
""")
    r = run(pytester, "--gpumem-check=all")
    r.assert_outcomes(passed=1, errors=1)
    r.stdout.fnmatch_lines(["*ERROR at setup of test_a*",
                            "gpumem: 1 check finding during the test's setup or teardown:"])
    run(pytester).assert_outcomes(passed=1, skipped=1)  # the control: no checks
