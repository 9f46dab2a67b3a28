"""pytest_gpumem end to end on the GPU with real CuPy: each inner session runs
in a subprocess (the outer process has CUDA initialised)."""

import json
import xml.etree.ElementTree as ET

import pytest

MiB = 1 << 20

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
    import cupy_memstrat
    from cupy_memstrat.registry import get_registry

    missing = [n for n in cupy_memstrat.available() if get_registry().get(n).unavailable()]
    r.assert_outcomes(passed=1 + len(cupy_memstrat.available()) - len(missing), skipped=len(missing))


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


@pytest.mark.gpu_exclusive  # the driver's fault counters count the whole device: run alone (ci/gpu.sh)
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


ROBUST = HEAD + """
@pytest.mark.limit_gpu_leaks("2MiB")
def test_inside_using():
    with cupy_memstrat.using("device"):
        x = cupy.ones(4 * MiB, dtype=cupy.uint8)
        assert int(x.sum()) == 4 * MiB
def test_with_the_fixture(gpumem_strategy):
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    assert float(x[-1]) == (1 << 20) - 1
@pytest.mark.limit_gpu_memory("16MiB")
def test_over_after():
    x = cupy.zeros(32 * MiB, dtype=cupy.uint8)
    x += 1
def test_leaks_a_little():
    KEEP.append(cupy.zeros(MiB, dtype=cupy.uint8))
"""


def test_robust_paths_with_real_cupy(inner):
    """Issue 16's plugin paths with real CuPy: history inside using() and
    under the gpumem_strategy fixture (never an INTERNALERROR), each fixture
    strategy measured through itself and named on its row without a warning
    (-W error), every limit and its source in the JSON, the user's unit,
    leak warnings at the test's line."""
    inner.makepyfile(ROBUST)
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error::pytest.PytestWarning",
                                   "--gpumem-history", "--gpumem-budget=200MB", "--gpumem-json=out.json",
                                   "--gpumem-top=20", "-v")
    assert r.ret == 1, r.stdout.str()  # test_over_after fails its budget; nothing else, no INTERNALERROR
    assert "INTERNALERROR" not in r.stdout.str() + r.stderr.str()
    outcomes = r.parseoutcomes()
    assert outcomes["failed"] == 1 and outcomes["passed"] >= 6, outcomes  # one per registered strategy
    r.stdout.fnmatch_lines(["*budget 200MB (190.7 MiB) (--gpumem-budget)*"])
    r.stdout.fnmatch_lines(["peak 32.0 MiB > budget 16.0 MiB (limit_gpu_memory marker)"])
    out = r.stdout.str()
    for name in ("device", "managed", "async"):
        assert f"[strategy {name}]" in out, out
    assert "GpuMemAllocatorWarning" not in out
    doc = json.loads((inner.path / "out.json").read_text())
    assert doc["strategy"]["name"] == "pool" and doc["settings"]["measure"] is True
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    t = tests["test_inside_using"]  # its using() block allocates from a strategy of its own (docs/pytest.md)
    assert t["outcome"] == "passed" and "history" not in t
    assert t["limits"]["leaks"] == {"mode": "fail", "limit_bytes": 2 * MiB, "source": "limit_gpu_leaks marker"}
    assert t["limits"]["budget"]["as_given"] == "200MB"
    assert tests["test_over_after"]["history"]["events"], tests["test_over_after"]  # recorded: it failed
    fixture_rows = [v for k, v in tests.items() if k.startswith("test_with_the_fixture")]
    assert {v["strategy"] for v in fixture_rows if "strategy" in v} >= {"device", "managed", "async"}
    assert all(v["peak_bytes"] >= 4 * MiB for v in fixture_rows if v.get("strategy") != "pool")

    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-leaks=warn", "-k", "leaks_a_little")
    line = ROBUST.lstrip("\n").splitlines().index("def test_leaks_a_little():") + 1
    r.stdout.fnmatch_lines([f"*test_robust_paths_with_real_cupy.py:{line}: GpuMemLeakWarning: *leaked 1 allocation*"])


def test_usage_errors_come_before_any_test_with_real_cupy(inner):
    """A JSON path that cannot be written and every bad marker: exit 4 before
    a test runs, no traceback, nothing left behind."""
    inner.makepyfile(HEAD + """
@pytest.mark.limit_gpu_memory("lots")
def test_a():
    raise AssertionError("BODY RAN")
@pytest.mark.limit_page_faults(gpu=-1)
def test_b():
    raise AssertionError("BODY RAN")
""")
    (inner.path / "adir").mkdir()
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem-json=adir")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--gpumem-json='adir': 'adir' is a directory*"])
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: 2 bad gpumem markers:", "marker limit_gpu_memory('lots')*",
                            "marker limit_page_faults(gpu=-1)*"])
    assert "BODY RAN" not in r.stdout.str() and "Traceback" not in r.stderr.str()
    assert sorted(p.name for p in inner.path.iterdir() if p.name.startswith("adir") or ".tmp" in p.name) == ["adir"]


def test_xdist_workers_name_the_strategy_with_real_cupy(inner):
    pytest.importorskip("xdist")
    inner.makepyfile(HEAD + """
def test_a():
    assert int(cupy.ones(MiB, dtype=cupy.uint8).sum()) == MiB
def test_b():
    assert int(cupy.ones(2 * MiB, dtype=cupy.uint8).sum()) == 2 * MiB
""")
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--gpumem",
                                   "--gpumem-strategy=device:track_origins=yes,check=all", "--gpumem-json=out.json")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["gpumem: measuring every test through strategy *device* on each pytest-xdist worker*",
                            "*gpumem: top 2 of 2 measured tests by peak GPU memory (strategy device)*"])
    doc = json.loads((inner.path / "out.json").read_text())
    assert doc["strategy"]["name"] == "device"
    assert doc["strategy"]["options"]["track_origins"] is True
    assert doc["strategy"]["options"]["check"] == "streams,poison,redzone"
    assert {t["worker"] for t in doc["tests"]} <= {"gw0", "gw1"}


GROWTH = HEAD + """
def test_peak():
    x = cupy.ones({size}, dtype=cupy.uint8)
    assert int(x[-1]) == 1
"""


def test_the_growth_gate_with_real_cupy(inner, tmp_path):
    """--gpumem-compare against the --gpumem-json of an earlier run, on the GPU: a test whose
    peak grew by 25% fails at 10% allowed and names both numbers; at 30% it passes."""
    base = tmp_path / "base.json"
    inner.makepyfile(test_grow=GROWTH.format(size="4 * MiB"))
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem", f"--gpumem-json={base}")
    r.assert_outcomes(passed=1)
    inner.makepyfile(test_grow=GROWTH.format(size="5 * MiB"))
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", f"--gpumem-compare={base}", "--gpumem-max-growth=10%")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*peak 5.0 MiB grew by 25.00% (1,048,576 B) over the baseline's 4.0 MiB (4,194,304 B; "
                            f"{base}), more than the 10% allowed (--gpumem-max-growth)*"])
    r = inner.runpytest_subprocess("-p", "no:cacheprovider", f"--gpumem-compare={base}", "--gpumem-max-growth=30%")
    r.assert_outcomes(passed=1)
