"""tools/compare_junit.py decides whether a strategy is drop-in for CuPy's suite."""

import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location(
    "compare_junit", pathlib.Path(__file__).parents[1] / "tools" / "compare_junit.py"
)
compare_junit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_junit)


def _xml(path, cases):
    body = "".join(
        f'<testcase classname="m" name="{n}">{"" if k == "passed" else f"<{k}/>"}</testcase>' for n, k in cases
    )
    path.write_text(f'<testsuites><testsuite time="2.0">{body}</testsuite></testsuites>')
    return str(path)


def test_same_outcomes_including_the_same_failures(tmp_path):
    a = _xml(tmp_path / "a.xml", [("t1", "passed"), ("t2", "failure")])
    b = _xml(tmp_path / "b.xml", [("t1", "passed"), ("t2", "failure")])
    r = compare_junit.compare(a, b)
    assert r["same_outcomes"] and r["new_failures"] == [] and r["candidate"]["failed"] == 1
    assert compare_junit.main([a, b]) == 0


def test_a_new_failure_or_missing_test_is_reported(tmp_path):
    a = _xml(tmp_path / "a.xml", [("t1", "passed"), ("t2", "passed"), ("t3", "passed")])
    b = _xml(tmp_path / "b.xml", [("t1", "error"), ("t2", "passed")])
    r = compare_junit.compare(a, b)
    assert r["new_failures"] == ["m::t1", "m::t3"]
    assert r["differ"]["m::t3"] == ["passed", "missing"]
    assert compare_junit.main([a, b]) == 1
