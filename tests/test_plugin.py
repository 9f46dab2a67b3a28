"""The pytest plugin's --gpumem-strategy, run in a child pytest (pytester)."""

import pytest



def test_no_option_changes_nothing(pytester):
    pytester.makepyfile("def test_ok():\n    assert True\n")
    r = pytester.runpytest_subprocess()
    r.assert_outcomes(passed=1)
    assert "gpumem" not in r.stdout.str()


def test_bad_strategy_is_a_usage_error_naming_the_source(pytester):
    pytester.makepyfile("def test_ok():\n    pass\n")
    r = pytester.runpytest_subprocess("--gpumem-strategy=nope")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--gpumem-strategy='nope': unknown strategy 'nope'; available: async*device*"])


def test_bad_option_from_ini_names_the_ini_key(pytester):
    pytester.makeini("[pytest]\ngpumem_strategy = device:track_origins=perhaps\n")
    pytester.makepyfile("def test_ok():\n    pass\n")
    r = pytester.runpytest_subprocess()
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*ini key gpumem_strategy='device:track_origins=perhaps'*expected true or false*"])


def test_without_gpu_the_session_runs_and_the_header_says_why(pytester):
    try:
        from cupy_memstrat.backends import get_backend

        get_backend()
        pytest.skip("a GPU is present")
    except Exception:
        pass
    pytester.makepyfile("def test_ok():\n    pass\n")
    r = pytester.runpytest_subprocess("--gpumem-strategy=device")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["gpumem: strategy 'device' not installed, tests run with CuPy's own allocator: "
                            "no CUDA device*"])


def test_an_empty_option_switches_off_the_ini_setting(pytester):
    pytester.makeini("[pytest]\ngpumem_strategy = nope\n")
    pytester.makepyfile("def test_ok():\n    pass\n")
    r = pytester.runpytest_subprocess("--gpumem-strategy=")
    r.assert_outcomes(passed=1)


def test_the_session_allocator_is_restored_afterwards(pytester, monkeypatch):
    cupy = pytest.importorskip("cupy")
    import cupy_memstrat
    import cupy_memstrat.backends as C
    from cupy_memstrat.testing import FakeBackend

    monkeypatch.setattr(C, "_backend", FakeBackend())
    before = cupy.cuda.get_allocator()
    pytester.makepyfile("import cupy_memstrat\ndef test_ok():\n    assert cupy_memstrat.current().name == 'device'\n")
    r = pytester.runpytest_inprocess("--gpumem-strategy=device", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)
    assert cupy.cuda.get_allocator() == before and cupy_memstrat.current() is None
