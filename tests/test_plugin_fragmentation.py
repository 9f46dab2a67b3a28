"""The plugin's fragmentation limit on the fake backend: ``--gpumem-max-fragmentation`` (its
variable and ini key), the ``limit_fragmentation`` marker, their bad values, the trim that makes
the verdict independent of the tests that ran before, and the figures in the reports."""

import json
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("cupy", reason="the plugin's tests make CuPy arrays (no GPU needed)")

MiB = 1 << 20

HEAD = """
import numpy as np
import pytest
import cupy
MiB = 1 << 20
def alloc(n):
    return cupy.ndarray((n,), dtype=np.uint8)
def sixteen_then_32():
    a = [alloc(16 * MiB) for _ in range(8)]   # 128 MiB in use
    del a
    b = [alloc(32 * MiB) for _ in range(4)]   # 128 MiB in use again, in blocks twice the size
"""


def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def records(pytester, name="out.json"):
    return {t["nodeid"].split("::")[-1]: t for t in json.loads((pytester.path / name).read_text())["tests"]}


def test_a_strategy_that_keeps_the_small_blocks_fails_and_one_that_caches_nothing_passes(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_pattern():\n    sixteen_then_32()\n")
    r = run(pytester, "--gpumem-strategy=managed", "--gpumem-max-fragmentation=1.5", "--gpumem-json=out.json")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "reserved 256.0 MiB for a peak in use of 128.0 MiB (2.00x) > 1.5x + 32.0 MiB (--gpumem-max-fragmentation)",
        "*- gpumem -*",
        "strategy 'managed' at the end of the call: reserved 256.0 MiB, in use 0 B, largest free block *",
        "*peak*allocs*reserved*test*",
        "*128.0 MiB*12*256.0 MiB*test_pattern*[[]fragmentation[]]",
    ])
    t = records(pytester)["test_pattern"]
    assert t["verdict"] == "fragmentation"
    assert (t["peak_bytes"], t["peak_reserved_bytes"], t["reserved_over_in_use"]) == (128 * MiB, 256 * MiB, 2.0)
    assert t["limits"]["fragmentation"] == {"ratio": 1.5, "slack_bytes": 32 * MiB,
                                            "source": "--gpumem-max-fragmentation"}
    # the control: `device` reserves exactly what is in use
    r = run(pytester, "--gpumem-strategy=device", "--gpumem-max-fragmentation=1.5", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1)
    t = records(pytester)["test_pattern"]
    assert (t["peak_bytes"], t["peak_reserved_bytes"], t["verdict"]) == (128 * MiB, 128 * MiB, None)


@pytest.mark.parametrize("value, fails", [
    ("1.74", True), ("1.75", False), ("1.0+128MiB", False), ("1.0+127MiB", True), ("1+0", True), ("off", False),
])
def test_the_limit_is_ratio_times_the_peak_plus_the_slack(pytester, fake_env, value, fails):
    pytester.makepyfile(HEAD + "def test_pattern():\n    sixteen_then_32()\n")
    r = run(pytester, "--gpumem", "--gpumem-strategy=managed", f"--gpumem-max-fragmentation={value}")
    r.assert_outcomes(failed=int(fails), passed=int(not fails))


def test_the_marker_overrides_the_option_and_works_alone(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.mark.limit_fragmentation(None)
def test_switched_off():
    sixteen_then_32()
@pytest.mark.limit_fragmentation(3)
def test_looser():
    sixteen_then_32()
@pytest.mark.limit_fragmentation(1.0, slack="64MiB")
def test_stricter():
    sixteen_then_32()
@pytest.mark.limit_fragmentation("1.0+64MiB")
def test_stricter_as_on_the_command_line():
    sixteen_then_32()
def test_by_the_option():
    sixteen_then_32()
""")
    r = run(pytester, "--gpumem-strategy=managed", "--gpumem-max-fragmentation=1.5", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2, failed=3)
    r.stdout.fnmatch_lines(["*> 1x + 64.0 MiB (limit_fragmentation marker)"])
    recs = records(pytester)
    assert recs["test_switched_off"]["verdict"] is None and "fragmentation" not in recs["test_switched_off"]["limits"]
    assert recs["test_looser"]["verdict"] is None
    assert recs["test_stricter"]["verdict"] == recs["test_by_the_option"]["verdict"] == "fragmentation"
    assert recs["test_stricter_as_on_the_command_line"]["limits"]["fragmentation"] == \
        recs["test_stricter"]["limits"]["fragmentation"]
    # the marker alone, with no option at all, measures its test
    pytester.makepyfile(HEAD + "@pytest.mark.limit_fragmentation(1.5)\ndef test_a():\n    sixteen_then_32()\n")
    r = run(pytester, "--gpumem-strategy=managed")
    r.assert_outcomes(failed=1)


def test_environment_variable_and_ini_key(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_pattern():\n    sixteen_then_32()\n")
    pytester.makeini("[pytest]\ngpumem_max_fragmentation = 1.5\n")
    r = run(pytester, "--gpumem-strategy=managed")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["gpumem: measuring every test*max fragmentation 1.5x + 32.0 MiB (ini key*",
                            "*> 1.5x + 32.0 MiB (ini key gpumem_max_fragmentation)"])
    fake_env.setenv("GPUMEM_MAX_FRAGMENTATION", "2+1MiB")
    r = run(pytester, "--gpumem-strategy=managed")
    r.assert_outcomes(passed=1)


ORDER = HEAD + """
def test_a_warms_the_cache():
    b = [alloc(32 * MiB) for _ in range(4)]
    del b
    b = [alloc(8 * MiB) for _ in range(8)]
def test_b_pattern():
    sixteen_then_32()
"""


def test_the_verdict_does_not_depend_on_the_tests_that_ran_before(pytester, fake_env):
    pytester.makepyfile(ORDER)
    alone = run(pytester, "--gpumem-strategy=managed", "--gpumem-max-fragmentation=1.5", "-k", "test_b",
                "--gpumem-json=out.json")
    alone.assert_outcomes(failed=1)
    b_alone = records(pytester)["test_b_pattern"]
    after = run(pytester, "--gpumem-strategy=managed", "--gpumem-max-fragmentation=1.5", "--gpumem-json=out.json")
    after.assert_outcomes(passed=1, failed=1)
    b_after = records(pytester)["test_b_pattern"]
    assert b_after["verdict"] == b_alone["verdict"] == "fragmentation"
    assert b_after["peak_reserved_bytes"] == b_alone["peak_reserved_bytes"] == 256 * MiB
    # the control: without the limit (no trim before the call) the cache left by the first test
    # hides half of what the second reserves
    run(pytester, "--gpumem", "--gpumem-strategy=managed", "--gpumem-json=out.json").assert_outcomes(passed=2)
    assert records(pytester)["test_b_pattern"]["peak_reserved_bytes"] < 256 * MiB


def test_every_measured_test_reports_its_peak_reserved_in_json_and_junit(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_a():\n    x = alloc(3 * MiB)\n")
    r = run(pytester, "--gpumem", "--gpumem-strategy=device", "--gpumem-json=out.json", "--junitxml=j.xml")
    r.assert_outcomes(passed=1)
    t = records(pytester)["test_a"]
    assert t["peak_reserved_bytes"] == t["peak_bytes"] == 3 * MiB
    assert t["peak_reserved_bytes_per_device"] == [3 * MiB]
    props = {p.get("name"): p.get("value") for p in ET.parse(pytester.path / "j.xml").iter("property")}
    assert props["gpumem_peak_reserved_bytes"] == str(3 * MiB)
    header = next(line for line in r.stdout.lines if line.strip().startswith("peak"))
    # a reserved column only with a fragmentation limit (the driver's peak is there with --gpumem-outside)
    assert header.split() == ["peak", "allocs", "driver", "peak", "test"]


@pytest.mark.parametrize("value, message", [
    ("lots", "ratio: expected a number >= 1 such as 1.5 (ASCII digits), got 'lots'"),
    ("0.5", "ratio: expected a finite number >= 1 (reserved memory is never below the memory in use), got '0.5'"),
    ("nan", "ratio: expected a number >= 1 such as 1.5 (ASCII digits), got 'nan'"),
    ("inf", "ratio: expected a number >= 1 such as 1.5 (ASCII digits), got 'inf'"),
    ("1_5", "ratio: expected a number >= 1 such as 1.5 (ASCII digits), got '1_5'"),
    ("\uff11.5", "ratio: expected a number >= 1 such as 1.5 (ASCII digits)"),
    ("1.5+", "expected RATIO or RATIO+SLACK such as 1.5 or 1.5+64MiB, got '1.5+'"),
    ("+64MiB", "expected RATIO or RATIO+SLACK such as 1.5 or 1.5+64MiB, got '+64MiB'"),
    ("1.5+lots", "slack: cannot parse 'lots' as a size"),
    ("1.5+10%", "slack: expected a size such as 64MiB, got '10%'"),
    ("1.5+-1MiB", "slack:"),
])
@pytest.mark.parametrize("where", ["option", "env", "ini"])
def test_bad_values_are_usage_errors_naming_the_source(pytester, fake_env, value, message, where):
    pytester.makepyfile("def test_a():\n    raise AssertionError('BODY RAN')\n")
    args = []
    if where == "option":
        args, label = [f"--gpumem-max-fragmentation={value}"], f"--gpumem-max-fragmentation={value!r}"
    elif where == "env":
        fake_env.setenv("GPUMEM_MAX_FRAGMENTATION", value)
        label = f"environment variable GPUMEM_MAX_FRAGMENTATION={value!r}"
    else:
        pytester.makeini(f"[pytest]\ngpumem_max_fragmentation = {value}\n")
        label = f"ini key gpumem_max_fragmentation={value!r}"
    r = run(pytester, *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{label}: " in r.stderr.str() and message in r.stderr.str(), r.stderr.str()
    assert "BODY RAN" not in r.stdout.str()


@pytest.mark.parametrize("marker, message", [
    ("limit_fragmentation()", "*missing the ratio argument, e.g. limit_fragmentation(1.5)"),
    ("limit_fragmentation(0.9)", "*ratio: expected a finite number >= 1*got 0.9"),
    ("limit_fragmentation('x')", "*ratio: expected a number >= 1 such as 1.5 (ASCII digits), got 'x'"),
    ("limit_fragmentation(True)", "*ratio: expected a number >= 1 such as 1.5, got True"),
    ("limit_fragmentation(b'1.5')", "*ratio: expected a number >= 1 such as 1.5, got b'1.5'"),
    ("limit_fragmentation(1.5, slack='lots')", "*slack: cannot parse 'lots' as a size*"),
    ("limit_fragmentation(1.5, 1, 2)", "*expected at most two arguments, ratio and slack, got 3"),
    ("limit_fragmentation(1.5, ratio=2)", "*the ratio given twice: 1.5 and ratio=2"),
    ("limit_fragmentation('1.5+64MiB', slack='1MiB')", "*the slack given twice: in '1.5+64MiB' and as '1MiB'"),
    ("limit_fragmentation(ratio=1.5, rate=2)", "*unknown argument 'rate'; expected ratio, slack"),
    ("limit_fragmentation(None, slack='1MiB')", "*slack='1MiB' given with no ratio; give a ratio such as 1.5"),
])
def test_bad_markers_are_usage_errors_at_collection(pytester, fake_env, marker, message):
    pytester.makepyfile(f"import pytest\n@pytest.mark.{marker}\ndef test_a():\n    raise AssertionError('BODY RAN')\n")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: marker {marker.replace('(', '[(]').replace(')', '[)]')} on *::test_a: "
                            + message.lstrip("*")])
    assert "BODY RAN" not in r.stdout.str()


def test_the_option_and_the_marker_are_listed(pytester):
    r = pytester.runpytest_subprocess("--help")
    assert "--gpumem-max-fragmentation=RATIO[+SLACK]" in r.stdout.str()
    assert "  gpumem_max_fragmentation " in r.stdout.str()
    r = pytester.runpytest_subprocess("--markers")
    r.stdout.fnmatch_lines(["@pytest.mark.limit_fragmentation(ratio, slack='32MiB')*"])
