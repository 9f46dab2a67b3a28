"""pytest_gpumem end to end on the GPU with real CuPy: each inner session runs
in a subprocess (the outer process has CUDA initialised)."""

import json
import os
import xml.etree.ElementTree as ET

import pytest

HEAD = """
import ctypes
import numpy as np
import pytest
import cupy
import cupy_memstrat
MiB = 1 << 20
KEEP = []
"""

CASES = HEAD + """
@pytest.mark.limit_gpu_memory("64MiB")
def test_over_budget():
    x = cupy.zeros(128 * MiB, dtype=cupy.uint8)
    x += 1
    assert int(x[-1]) == 1
@pytest.mark.limit_gpu_memory("256MiB")
def test_clean():
    x = cupy.ones(64 * MiB, dtype=cupy.uint8)
    assert int(x.sum()) == 64 * MiB
def test_leak():
    KEEP.append(cupy.zeros(16 * MiB, dtype=cupy.uint8))
def test_traceback_keeps_an_array_alive():
    def f():
        x = cupy.zeros(8 * MiB, dtype=cupy.uint8)
        raise ValueError("boom")
    try:
        f()
    except ValueError as e:
        KEEP.append(e)
def test_fft_plan_cache_is_not_a_leak():
    y = cupy.fft.fft(cupy.ones(1 << 20, dtype=cupy.complex64))
    assert abs(complex(y[0]) - (1 << 20)) < 1
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    for k in list(os.environ):
        if k.startswith("GPUMEM") or k == "CUPY_MEMSTRAT_BACKEND":
            monkeypatch.delenv(k)
    return pytester


def test_budget_leaks_and_reports_with_real_cupy(inner):
    inner.makepyfile(CASES)
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-leaks=fail", "--gpumem-json=out.json",
                                   "--junitxml=junit.xml", "-ra")
    r.assert_outcomes(passed=2, failed=3)
    r.stdout.fnmatch_lines(["gpumem: measuring every test through strategy 'pool' on * device*"])
    r.stdout.fnmatch_lines(["peak 128.0 MiB* > budget 64.0 MiB (limit_gpu_memory marker)"])  # "on device 0" with 2 GPUs
    r.stdout.fnmatch_lines(["leaked 1 allocation, 16.0 MiB > limit 0 B (--gpumem-leaks)", "*- gpumem -*",
                            "*allocations made by the test and still live*", "*16.0 MiB  device 0  0x*"])
    r.stdout.fnmatch_lines(["*_ test_traceback_keeps_an_array_alive _*", "leaked 1 allocation, 8.0 MiB > limit 0 B*"])
    doc = json.loads((inner.path / "out.json").read_text())
    assert doc["machine"]["backend"] == "cuda" and doc["machine"]["devices"][0]["name"]
    assert doc["machine"]["driver_version"] >= 12000 and doc["packages"]["cupy"]
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    assert tests["test_over_budget"]["peak_bytes"] == 128 * 2**20
    assert tests["test_over_budget"]["verdict"] == "budget"
    assert tests["test_clean"]["leaked_bytes"] == 0 and tests["test_clean"]["outcome"] == "passed"
    assert tests["test_fft_plan_cache_is_not_a_leak"]["leaked_bytes"] == 0
    assert tests["test_leak"]["leaked_bytes"] == 16 * 2**20
    root = ET.parse(inner.path / "junit.xml").getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_over_budget"].iter("property")}
    assert props["gpumem_peak_bytes"] == str(128 * 2**20)


def test_the_fixture_with_real_cupy(inner):
    inner.makepyfile(HEAD + """
def test_fixture(gpumem):
    with gpumem.measure() as m:
        x = cupy.empty(32 * MiB, dtype=cupy.uint8)
        del x
    assert m.peak == 32 * MiB and m.leaked == 0
    y = cupy.empty(MiB, dtype=cupy.uint8)
    assert gpumem.in_use == MiB
    del y
    gpumem.assert_no_leaks()
def test_each_strategy(gpumem_strategy):
    x = cupy.arange(1000, dtype=cupy.float32)
    assert float(x.sum()) == 499500.0
    assert gpumem_strategy.stats().bytes_in_use >= 4000
""")
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    r.assert_outcomes(passed=5)


FAULTS = HEAD + """
N = 64 * MiB
def managed_array():
    with cupy_memstrat.using("managed"):
        x = cupy.empty(N, dtype=cupy.uint8)
    return x
def write_on_host(x):
    h = np.ctypeslib.as_array(ctypes.cast(x.data.ptr, ctypes.POINTER(ctypes.c_uint8)), shape=(x.nbytes,))
    h[:] = 1                      # the pages are now on the host
@pytest.mark.limit_page_faults(gpu=0)
def test_migrates_on_faults():
    x = managed_array()
    write_on_host(x)
    x += 1                        # the GPU faults the pages over
    cupy.cuda.Device().synchronize()
    assert int(x[0]) == 2
@pytest.mark.limit_page_faults(gpu=0, migrated="1GiB")
def test_prefetched_stays_under_budget():
    x = managed_array()
    write_on_host(x)
    cupy_memstrat.prefetch(x)     # one transfer, no faults
    x += 1
    cupy.cuda.Device().synchronize()
    assert int(x[0]) == 2
@pytest.mark.limit_page_faults(migrated="1MiB")
def test_migrated_bytes_over_budget():
    x = managed_array()
    write_on_host(x)
    cupy_memstrat.prefetch(x)
    cupy.cuda.Device().synchronize()
"""


def test_page_fault_budgets_on_a_managed_migration(inner):
    from cupy_memstrat import faults

    a = faults.available()
    if a.get("driver") and a.get("cupti"):
        pytest.skip(f"no page-fault counters here: {a}")
    inner.makepyfile(FAULTS)
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-json=out.json", "-ra")
    r.assert_outcomes(passed=1, failed=2)
    r.stdout.fnmatch_lines(["* GPU page faults > limit 0 (limit_page_faults marker; *)"])
    r.stdout.fnmatch_lines(["migrated * > limit 1.0 MiB (limit_page_faults marker; *)"])
    tests = {t["nodeid"].split("::")[1]: t for t in json.loads((inner.path / "out.json").read_text())["tests"]}
    f = tests["test_migrates_on_faults"]["faults"]
    assert f["gpu_faults"] > 0
    if f["exact"]:
        assert f["bytes_htod"] >= 60 * 2**20  # the 64 MiB came over (exact driver counters)
    assert tests["test_prefetched_stays_under_budget"]["faults"]["gpu_faults"] == 0
