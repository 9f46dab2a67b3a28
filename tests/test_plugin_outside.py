"""pytest_gpumem's reading of the driver beside the strategy's count, on the simulated GPU
(CUPY_MEMSTRAT_BACKEND=fake): memory a test holds outside the strategy, the leak and budget
verdicts on it, the tolerance, the report. The simulated device's free memory counts every
allocation made through the backend, as cudaMemGetInfo does; a test that calls the backend's
``malloc`` itself stands for a library that allocates on its own (a raw cudaMalloc)."""

import json

import pytest

pytest.importorskip("cupy", reason="the plugin's tests make CuPy arrays (no GPU needed)")

HEAD = """
import numpy as np
import pytest
import cupy
import cupy_memstrat
MiB = 1 << 20
KEEP = []
def raw(n):  # memory the strategy never sees, as a library's own cudaMalloc
    return cupy_memstrat.current().backend.malloc(n)
def alloc(n):  # an array through the strategy (no kernel: the simulated GPU runs none)
    return cupy.ndarray((n,), dtype=np.uint8)
"""

TESTS = HEAD + """
def test_clean():
    a = alloc(MiB)
    assert a.nbytes == MiB

def test_keeps_raw_memory():
    KEEP.append(raw(256 * MiB))

def test_frees_its_raw_memory():
    b = cupy_memstrat.current().backend
    b.free(raw(256 * MiB))

def test_keeps_a_little_raw_memory():
    KEEP.append(raw(MiB))

def test_keeps_an_array():
    KEEP.append(alloc(MiB))
"""


def run(pytester, *args):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def _tests(pytester):
    doc = json.loads((pytester.path / "out.json").read_text())
    return {t["nodeid"].split("::")[1]: t for t in doc["tests"]}


@pytest.mark.parametrize("strategy", ["pool", "device", "async", "managed", "expandable"])
def test_memory_kept_outside_the_strategy_is_a_leak_under_every_strategy(pytester, fake_env, strategy):
    pytester.makepyfile(TESTS)
    r = run(pytester, "--gpumem-leaks=fail", f"--gpumem-strategy={strategy}", "--gpumem-json=out.json",
            "--gpumem-outside-tolerance=64MiB")
    r.assert_outcomes(failed=2, passed=3)
    r.stdout.fnmatch_lines([
        "*_ test_keeps_raw_memory _*",
        "leaked 256.0 MiB outside the strategy (not explained by a library 256.0 MiB) > limit 0 B (--gpumem-leaks)",
        "*- gpumem -*",
        "GPU memory held outside the strategy after the teardown, gc.collect() and emptying the caches*",
        "   256.0 MiB  on device 0, which no library the plugin reads explains: a raw cudaMalloc, another CuPy "
        "memory pool, or a library's own cache (the tolerance is 64.0 MiB, --gpumem-outside-tolerance)",
    ])
    r.stdout.fnmatch_lines(["*_ test_keeps_an_array _*", "leaked 1 allocation, 1.0 MiB > limit 0 B*"])
    t = _tests(pytester)
    keep = t["test_keeps_raw_memory"]
    assert keep["leaked_bytes"] == keep["leaked_outside_bytes"] == 256 << 20 and keep["leaked_count"] == 0
    assert keep["outside"]["unexplained"] == [256 << 20] and keep["outside"]["by"] == {"unexplained": 256 << 20}
    # the driver's reading, before and after the call, beside the strategy's count
    before, after = keep["driver_used_before_bytes_per_device"][0], keep["driver_used_after_bytes_per_device"][0]
    assert after - before == 256 << 20 and keep["outside_bytes_per_device"] == [256 << 20]
    assert t["test_frees_its_raw_memory"]["leaked_bytes"] == 0
    assert t["test_keeps_a_little_raw_memory"]["leaked_bytes"] == 0  # below the tolerance
    assert t["test_keeps_a_little_raw_memory"]["outside"]["unexplained"] == [1 << 20]
    assert t["test_clean"]["leaked_bytes"] == 0 and t["test_clean"]["outside"]["outside"] == [0]


def test_without_the_driver_reading_memory_outside_the_strategy_passes_unseen(pytester, fake_env):
    """The control: what the plugin did before it read the driver (--gpumem-outside=off)."""
    pytester.makepyfile(TESTS)
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-outside=off", "--gpumem-outside-tolerance=64MiB",
            "--gpumem-json=out.json")
    r.assert_outcomes(failed=1, passed=4)  # only the array kept through the strategy
    t = _tests(pytester)
    assert t["test_keeps_raw_memory"]["leaked_bytes"] == 0
    assert "driver_used_before_bytes_per_device" not in t["test_keeps_raw_memory"]
    assert "outside" not in t["test_keeps_raw_memory"]


def test_the_tolerance_decides_what_unexplained_growth_is_a_leak(pytester, fake_env):
    pytester.makepyfile(TESTS)
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-outside-tolerance=0", "-k", "little or clean")
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["leaked 1.0 MiB outside the strategy (not explained by a library 1.0 MiB) > limit 0 B*"])
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-outside-tolerance=512MiB", "-k", "keeps_raw")
    r.assert_outcomes(passed=1)
    # the default, 1 GiB per device: above what CUDA sets aside on its own at a first reduction
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-json=out.json", "-k", "keeps_raw")
    r.assert_outcomes(passed=1)
    assert _tests(pytester)["test_keeps_raw_memory"]["outside"]["tolerance"] == 1 << 30


def test_the_leak_marker_counts_memory_outside_the_strategy(pytester, fake_env):
    pytester.makepyfile(HEAD + """
@pytest.mark.limit_gpu_leaks("300MiB")
def test_within():
    KEEP.append(raw(256 * MiB))

@pytest.mark.limit_gpu_leaks("100MiB")
def test_over():
    KEEP.append(raw(128 * MiB))
""")
    r = run(pytester, "--gpumem-outside-tolerance=64MiB")
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["leaked 128.0 MiB outside the strategy (*) > limit 100.0 MiB (limit_gpu_leaks marker)"])


BUDGET = HEAD + """
@pytest.mark.limit_gpu_memory("16MiB")
def test_raw_memory_under_a_budget():
    KEEP.append(raw(256 * MiB))

@pytest.mark.limit_gpu_memory("16MiB")
def test_within_budget():
    a = alloc(MiB)
    assert a.nbytes == MiB
"""


def test_a_budget_on_the_driver_reading_counts_memory_from_any_library(pytester, fake_env):
    pytester.makepyfile(BUDGET)
    r = run(pytester, "--gpumem-budget-reading=driver", "--gpumem-json=out.json")
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines([
        "driver-level peak 256.0 MiB > budget 16.0 MiB (limit_gpu_memory marker); through the strategy: peak in "
        "use 0 B, peak reserved 0 B; outside it, this process's memory, as NVML counts it, grew by 256.0 MiB by "
        "the end of the call",
    ])
    t = _tests(pytester)
    assert t["test_raw_memory_under_a_budget"]["budget_reading"] == "driver"
    assert t["test_raw_memory_under_a_budget"]["driver_peak_bytes_per_device"] == [256 << 20]
    # the control: by default the budget judges the strategy's peak in use
    r = run(pytester)
    r.assert_outcomes(passed=2)


@pytest.mark.parametrize("args, message", [
    (["--gpumem-outside-tolerance=10%"], "--gpumem-outside-tolerance='10%': expected a size >= 0 such as '64MiB' "
                                         "or '1GiB' (a share of the device is not taken)"),
    (["--gpumem-outside-tolerance=-1MiB"], "--gpumem-outside-tolerance='-1MiB': expected a size >= 0 such as"),
    (["--gpumem-outside-tolerance=lots"], "--gpumem-outside-tolerance='lots': expected a size >= 0 such as"),
    (["--gpumem-budget-reading=peak"], "--gpumem-budget-reading='peak': expected one of strategy, driver"),
    (["--gpumem-outside=maybe"], "--gpumem-outside='maybe': expected one of"),
])
def test_bad_values_are_refused_at_start_up_by_name(pytester, fake_env, args, message):
    pytester.makepyfile(HEAD + "def test_x():\n    pass\n")
    r = run(pytester, "--gpumem", *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert message in r.stderr.str()


def test_the_record_holds_built_in_types_only_for_pytest_xdist():
    """pytest-xdist's serializer (execnet) takes no NumPy integer and no int subclass: the
    figures a library or CUDA hands back go into the record as plain ints."""
    np = pytest.importorskip("numpy")
    from pytest_gpumem.outside import plain

    rec = plain({"driver_growth": [np.int64(5)], "libraries": {"torch": {"held": (np.uint64(2),)}}, "tolerance": True,
                 "by": {"unexplained": np.int32(7)}, "ratio": np.float32(0.5), "none": None})
    assert rec == {"driver_growth": [5], "libraries": {"torch": {"held": [2]}}, "tolerance": True,
                   "by": {"unexplained": 7}, "ratio": 0.5, "none": None}
    assert type(rec["driver_growth"][0]) is int and type(rec["by"]["unexplained"]) is int
    execnet = pytest.importorskip("execnet")
    execnet.gateway_base.dumps_internal(rec)  # what a pytest-xdist worker does with the report


def test_the_header_names_the_driver_reading_settings(pytester, fake_env):
    pytester.makepyfile(HEAD + "def test_x():\n    pass\n")
    r = run(pytester, "--gpumem-budget=16MiB", "--gpumem-budget-reading=driver", "--gpumem-outside-tolerance=8MiB")
    r.stdout.fnmatch_lines(["gpumem: measuring every test * budget 16.0 MiB (--gpumem-budget) on the driver's "
                            "reading (--gpumem-budget-reading); "
                            "outside tolerance 8.0 MiB (--gpumem-outside-tolerance)"])
    r = run(pytester, "--gpumem", "--gpumem-outside=off")
    r.stdout.fnmatch_lines(["gpumem: measuring every test * driver's reading off (--gpumem-outside)"])


def test_a_driver_budget_failure_says_the_peak_is_outside_the_strategy_and_ranks_by_it(pytester, fake_env):
    pytester.makepyfile(BUDGET)
    r = run(pytester, "--gpumem-budget-reading=driver", "--gpumem-top=1")
    r.assert_outcomes(failed=1, passed=1)
    r.stdout.fnmatch_lines(["the peak is memory outside the strategy: a library that allocates on its own*"])
    assert "gpumem.measure() blocks narrow the peak down" not in r.stdout.str()
    # the table ranks by the peak the budget judged: the failing test first
    r.stdout.fnmatch_lines(["*top 1 of 2*", "*256.0 MiB*test_raw_memory_under_a_budget*[budget]*"])


def test_the_native_toml_table_takes_a_boolean_for_the_driver_reading(pytester, fake_env):
    if pytest.version_tuple < (9,):
        pytest.skip("the native [tool.pytest] table is pytest 9's")
    pytester.makepyfile(TESTS)
    pytester.makepyprojecttoml("[tool.pytest]\ngpumem_leaks = \"fail\"\ngpumem_outside = false\n")
    r = run(pytester, "--gpumem-json=out.json")
    r.assert_outcomes(failed=1, passed=4)
    assert "outside" not in _tests(pytester)["test_keeps_raw_memory"]


SAMPLED = HEAD + """
import time

@pytest.mark.limit_gpu_memory("16MiB")
def test_raw_memory_freed_before_the_call_ends():
    b = cupy_memstrat.current().backend
    p = raw(256 * MiB)
    time.sleep(0.2)
    b.free(p)
"""


def test_sampling_the_driver_sees_memory_freed_before_the_call_ends(pytester, fake_env):
    pytester.makepyfile(SAMPLED)
    r = run(pytester, "--gpumem-budget-reading=driver", "--gpumem-driver-sample=5", "--gpumem-json=out.json")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["driver-level peak 256.0 MiB > budget 16.0 MiB (limit_gpu_memory marker)*"])
    rec = _tests(pytester)["test_raw_memory_freed_before_the_call_ends"]
    assert rec["driver_readings"] >= 3 and rec["driver_peak_bytes_per_device"] == [256 << 20]
    # the control: read at the call's start and end only, the memory came and went unseen
    r = run(pytester, "--gpumem-budget-reading=driver", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1)
    assert "driver_readings" not in _tests(pytester)["test_raw_memory_freed_before_the_call_ends"]


@pytest.mark.parametrize("value", ["-5", "1.5", "fast", "100000"])
def test_a_bad_sampling_interval_is_refused_at_start_up(pytester, fake_env, value):
    pytester.makepyfile(HEAD + "def test_x():\n    pass\n")
    r = run(pytester, "--gpumem", f"--gpumem-driver-sample={value}")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert f"--gpumem-driver-sample={value!r}: expected" in r.stderr.str()


@pytest.mark.parametrize("args", [["--gpumem-budget-reading=driver"], ["--gpumem-driver-sample=5"]])
def test_reading_the_driver_with_the_reading_off_is_refused(pytester, fake_env, args):
    pytester.makepyfile(HEAD + "def test_x():\n    pass\n")
    r = run(pytester, "--gpumem", "--gpumem-outside=off", *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    option, value = args[0].split("=")
    assert (f"{option}={value!r} reads the driver, which --gpumem-outside='off' switches off: give one of the two"
            in r.stderr.str())


def test_the_native_toml_table_takes_a_number_for_the_sampling_interval(pytester, fake_env):
    if pytest.version_tuple < (9,):
        pytest.skip("the native [tool.pytest] table is pytest 9's")
    pytester.makepyfile(HEAD + "def test_x():\n    pass\n")
    pytester.makepyprojecttoml("[tool.pytest]\ngpumem = true\ngpumem_driver_sample = 5\n")
    r = run(pytester, "--gpumem-json=out.json")
    r.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["settings"]["driver_sample_ms"] == 5 and doc["tests"][0]["driver_readings"] >= 1


MiB = 1 << 20

OTHERS = HEAD + """
def test_another_process_takes_memory_meanwhile():
    cupy_memstrat.current().backend.hold_elsewhere(512 * MiB)  # pytest-xdist's next worker, another job
    a = alloc(MiB)
    assert a.nbytes == MiB

def test_keeps_raw_memory():
    KEEP.append(raw(256 * MiB))
"""


def test_nvml_s_count_of_this_process_keeps_other_processes_out_of_the_verdict(pytester, fake_env):
    pytester.makepyfile(OTHERS)
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-outside-tolerance=64MiB", "--gpumem-json=out.json")
    r.assert_outcomes(passed=1, failed=1)
    t = _tests(pytester)
    other, kept = t["test_another_process_takes_memory_meanwhile"], t["test_keeps_raw_memory"]
    assert other["driver_source_per_device"] == ["process"] and other["leaked_bytes"] == 0
    assert other["outside_bytes_per_device"] == [0]
    # the device's reading moved by the other process's 512 MiB; this process's count did not
    assert other["driver_used_after_bytes_per_device"][0] - other["driver_used_before_bytes_per_device"][0] >= 512 * MiB
    assert kept["leaked_bytes"] == 256 * MiB and kept["outside_bytes_per_device"] == [256 * MiB]


def test_without_nvml_s_count_another_process_s_memory_is_judged_by_the_device_reading(pytester, fake_env, monkeypatch):
    # the control: where NVML does not list this process (a container), only the device's
    # reading is left, and another process's growth is above the tolerance
    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB,nvml=off")
    pytester.makepyfile(OTHERS)
    r = run(pytester, "--gpumem-leaks=fail", "--gpumem-outside-tolerance=64MiB", "--gpumem-json=out.json",
            "-k", "meanwhile")
    r.assert_outcomes(failed=1)
    t = _tests(pytester)["test_another_process_takes_memory_meanwhile"]
    assert t["driver_source_per_device"] == ["device"] and t["leaked_bytes"] == 512 * MiB
    r.stdout.fnmatch_lines(["*which no library the plugin reads explains: a raw cudaMalloc, another CuPy memory "
                            "pool, or a library's own cache, or another process on the device (pytest-xdist's "
                            "other workers, another job) (the tolerance is 64.0 MiB*"])
