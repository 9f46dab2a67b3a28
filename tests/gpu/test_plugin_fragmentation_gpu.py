"""The plugin's fragmentation limit on the GPU, in a subprocess session with real CuPy: a
strategy that keeps freed 16 MiB blocks for 16 MiB requests fails the limit, `device` (which
reserves what is in use) passes it, and the verdict does not depend on the test before."""

import json

import pytest

MiB = 1 << 20

CASES = """
import cupy
import pytest
MiB = 1 << 20
def sixteen_then_32():
    a = [cupy.ones(16 * MiB, dtype=cupy.uint8) for _ in range(8)]
    del a
    b = [cupy.ones(32 * MiB, dtype=cupy.uint8) for _ in range(4)]
    assert int(b[-1][-1]) == 1
def test_a_warms_the_cache():
    b = [cupy.ones(32 * MiB, dtype=cupy.uint8) for _ in range(4)]
    del b
    c = [cupy.ones(8 * MiB, dtype=cupy.uint8) for _ in range(8)]
def test_b_pattern():
    sixteen_then_32()
"""


def _records(inner):
    return {t["nodeid"].split("::")[-1]: t for t in json.loads((inner.path / "out.json").read_text())["tests"]}


@pytest.mark.parametrize("strategy, fails", [("pool", True), ("managed", True), ("device", False)])
def test_the_limit_on_real_strategies(inner, strategy, fails):
    inner.makepyfile(CASES)
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", f"--gpumem-strategy={strategy}",
                                   "--gpumem-max-fragmentation=1.5", "--gpumem-json=out.json", "-k", "test_b")
    r.assert_outcomes(failed=int(fails), passed=int(not fails))
    t = _records(inner)["test_b_pattern"]
    assert t["peak_bytes"] == 128 * MiB
    if fails:
        r.stdout.fnmatch_lines(["reserved 256.0 MiB for a peak in use of 128.0 MiB (2.00x) > 1.5x + 32.0 MiB*"])
        assert t["peak_reserved_bytes"] == 256 * MiB and t["verdict"] == "fragmentation"
    else:
        assert t["peak_reserved_bytes"] == 128 * MiB and t["verdict"] is None


def test_the_verdict_does_not_depend_on_the_test_before(inner):
    inner.makepyfile(CASES)
    args = ["-p", "no:cacheprovider", "--gpumem-strategy=pool", "--gpumem-json=out.json"]
    r = inner.runpytest_subprocess(*args, "--gpumem-max-fragmentation=1.5")
    r.assert_outcomes(passed=1, failed=1)
    assert _records(inner)["test_b_pattern"]["peak_reserved_bytes"] == 256 * MiB
    # the control: without the limit (no trim before the call) CuPy's pool serves the second
    # test's 16 MiB arrays from the 32 MiB blocks the first left cached
    r = inner.runpytest_subprocess(*args, "--gpumem")
    r.assert_outcomes(passed=2)
    assert _records(inner)["test_b_pattern"]["peak_reserved_bytes"] < 256 * MiB
