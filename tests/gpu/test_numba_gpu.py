"""Numba's device arrays through cupy_memstrat.numba on the GPU, under each strategy.

Numba reads NUMBA_CUDA_MEMORY_MANAGER when it creates its first context, so
every case runs in a child Python (sys.executable) that has it set; the child
installs the strategy with cupy_memstrat.use, checks as it goes and prints
what it measured as one JSON line, which the test checks again.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install numba-cuda)")

MiB = 1 << 20

CHILD = textwrap.dedent(r"""
    import gc, json, os, pickle, subprocess, sys, tempfile
    import numpy as np
    import cupy
    import cupy_memstrat
    from numba import cuda
    from cupy_memstrat.numba import IpcExportError, MemstratNumbaManager

    name = sys.argv[1]
    s = cupy_memstrat.use(name)
    out = {"strategy": s.name}
    N = 1 << 20                        # float32: 4 MiB per array
    NB = 4 * N

    @cuda.jit
    def axpy(out, a, x, y):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + y[i]

    def ptr(a):
        return a.__cuda_array_interface__["data"][0]

    def in_use():
        return cupy_memstrat.stats().bytes_in_use

    ctx = cuda.current_context()
    out["manager"] = type(ctx.memory_manager).__name__
    assert isinstance(ctx.memory_manager, MemstratNumbaManager), type(ctx.memory_manager)

    # Numba arrays: allocated by the strategy, in its stats and live table
    before = in_use()
    x = cuda.to_device(np.arange(N, dtype=np.float32))
    y = cuda.to_device(np.ones(N, dtype=np.float32))
    z = cuda.device_array_like(x)
    out["grew"] = in_use() - before
    live = {a.ptr: a.size for a in cupy_memstrat.live_allocations()}
    out["listed"] = [live.get(ptr(a)) for a in (x, y, z)]
    out["memory_type"] = s.backend.memory_type(ptr(z))

    # a kernel on Numba arrays
    axpy[(N + 255) // 256, 256](z, np.float32(2.0), x, y)
    out["numba_kernel_ok"] = bool(np.array_equal(z.copy_to_host(), 2 * np.arange(N, dtype=np.float32) + 1))

    # a CuPy array shared with Numba, and a Numba array seen by CuPy
    c = cupy.zeros(N, dtype=cupy.float32)
    axpy[(N + 255) // 256, 256](cuda.as_cuda_array(c), np.float32(3.0), x, y)
    cuda.synchronize()
    out["numba_writes_cupy_ok"] = bool(cupy.array_equal(c, 3 * cupy.arange(N, dtype=cupy.float32) + 1))
    cz = cupy.asarray(z)
    out["cupy_sees_numba"] = [cz.data.ptr == ptr(z), float(cz[-1]), float(cz.astype(cupy.float64).sum())]

    # a view keeps the block alive; everything is freed once Numba lets go
    tail = z[N // 2:]
    ptrs = [ptr(a) for a in (x, y, z)]
    held = in_use()
    del x, y, z, cz
    gc.collect()
    out["freed_with_view_alive"] = held - in_use()
    out["tail_ok"] = float(tail.copy_to_host()[0]) == 2 * (N // 2) + 1
    del tail
    gc.collect()
    out["freed"] = held - in_use()
    out["still_listed"] = [p for p in ptrs if p in {a.ptr for a in cupy_memstrat.live_allocations()}]

    # defer_cleanup holds the free until the block ends
    d = cuda.device_array(N, dtype=np.float32)
    with cuda.defer_cleanup():
        held = in_use()
        del d
        gc.collect()
        out["freed_in_defer"] = held - in_use()
    out["freed_after_defer"] = held - in_use()

    # memory info: CUDA's numbers for the device
    info = ctx.get_memory_info()
    free, total = cupy.cuda.runtime.memGetInfo()
    out["memory_info_total_ok"] = info.total == total
    out["memory_info_free_close"] = abs(info.free - free) <= 64 << 20

    # a Numba array allocated while a Numba stream is CuPy's current stream, used on that stream
    st = cuda.stream()
    with cupy.cuda.ExternalStream(int(st.handle)):
        before = in_use()
        w = cuda.device_array(N, dtype=np.float32)
        v = cuda.to_device(np.arange(N, dtype=np.float32), stream=st)
        axpy[(N + 255) // 256, 256, st](w, np.float32(1.0), v, v)
        res = w.copy_to_host(stream=st)
        st.synchronize()
        out["stream_kernel_ok"] = bool(np.array_equal(res, 2 * np.arange(N, dtype=np.float32)))
        del w, v
        gc.collect()
        out["stream_freed"] = before - in_use() == 0
    st.synchronize()

    # IPC: a view into the array, opened in another process
    src = cuda.to_device(np.arange(N, dtype=np.float32))
    view = src[1000:]
    try:
        h = view.get_ipc_handle()
    except IpcExportError as exc:
        out["ipc"] = {"error": str(exc), "names_strategy": exc.strategy == s.name and repr(s.name) in str(exc)}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "h.pickle")
            with open(path, "wb") as f:
                pickle.dump(h, f)
            opener = ("import pickle, sys; from numba import cuda; h = pickle.load(open(sys.argv[1], 'rb'));"
                      "a = h.open(); d = a.copy_to_host(); "
                      "print(float(d[0]), float(d.astype('float64').sum()), a.size);"
                      "h.close()")
            env = {k: v for k, v in os.environ.items() if k != "NUMBA_CUDA_MEMORY_MANAGER"}
            r = subprocess.run([sys.executable, "-c", opener, path], capture_output=True, text=True, env=env,
                               timeout=120)
        first, total_sum, size = (r.stdout.split() + ["", "", ""])[:3]
        expect = float(np.arange(1000, N, dtype=np.float64).sum())
        out["ipc"] = {"opened": r.returncode == 0, "stderr": r.stderr[-2000:],
                      "data_ok": r.returncode == 0 and float(first) == 1000.0 and int(size) == N - 1000
                      and float(total_sum) == expect}
    del view, src
    gc.collect()

    out["end_in_use"] = in_use()
    out["n_invalid_frees"] = cupy_memstrat.stats().n_invalid_frees
    print(json.dumps(out))
""")


# numba-cuda 0.30.4 with NumPy 2.5 (the H200 image): see numba_compat/sitecustomize.py
NUMBA_COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "numba_compat")


def _with_compat(pythonpath: str | None) -> str:
    return NUMBA_COMPAT + (os.pathsep + pythonpath if pythonpath else "")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("CUPY_MEMSTRAT", "CUPY_MEMSTRAT_BACKEND")}
    env["NUMBA_CUDA_MEMORY_MANAGER"] = "cupy_memstrat.numba"
    env["PYTHONPATH"] = _with_compat(env.get("PYTHONPATH"))
    return env


def _child(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(),
                       timeout=170)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu_exclusive  # reads or fills the whole device's free memory: run alone (ci/gpu.sh)
@pytest.mark.parametrize("name", ["device", "managed", "async", "pool"])
def test_numba_arrays_come_from_the_strategy(name):
    out = _child(CHILD, name)
    nb = 4 * MiB
    assert out["strategy"] == name and out["manager"] == "MemstratNumbaManager"
    assert out["grew"] == 3 * nb, out  # three 4 MiB Numba arrays, nothing else
    assert out["listed"] == [nb, nb, nb], out  # each in live_allocations() with its size
    assert out["memory_type"] == ("managed" if name == "managed" else "device")
    assert out["numba_kernel_ok"] and out["numba_writes_cupy_ok"], out
    n = 1 << 20
    assert out["cupy_sees_numba"] == [True, 2.0 * (n - 1) + 1, float(2 * sum(range(n)) + n)], out
    # z is still held by its view: only x and y are freed, then z with the view
    assert out["freed_with_view_alive"] == 2 * nb and out["tail_ok"], out
    assert out["freed"] == 3 * nb and out["still_listed"] == [], out
    assert out["freed_in_defer"] == 0 and out["freed_after_defer"] == nb, out
    assert out["memory_info_total_ok"] and out["memory_info_free_close"], out
    assert out["stream_kernel_ok"] and out["stream_freed"], out
    ipc = out["ipc"]
    if name in ("device", "pool"):  # cudaMalloc memory: exported, opened in another process at the view's offset
        assert ipc.get("opened") and ipc.get("data_ok"), ipc
    elif name == "managed":  # refused before CUDA is asked, naming the strategy
        assert "as managed memory" in ipc.get("error", "") and ipc["names_strategy"], ipc
    else:  # async: whichever CUDA does, a refusal is our error naming the strategy, an export opens right
        assert ipc.get("names_strategy") if "error" in ipc else ipc.get("data_ok"), ipc
    assert out["n_invalid_frees"] == 0, out


OOM = textwrap.dedent(r"""
    import json
    import numpy as np
    import cupy, cupy_memstrat
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError, binding
    s = cupy_memstrat.use("device")
    keep = cuda.to_device(np.arange(1 << 20, dtype=np.int32))
    _, total = cupy.cuda.runtime.memGetInfo()
    out = {}
    try:
        cuda.device_array(2 * total, dtype=np.uint8)
    except CudaAPIError as exc:
        out = {"code_is_oom": exc.code == binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
               "is_memstrat_oom": isinstance(exc, cupy_memstrat.OutOfMemoryError),
               "requested_ok": exc.requested == 2 * total, "message": str(exc)}
    out["n_failed"] = s.stats().n_failed
    out["keep_ok"] = int(keep.copy_to_host().sum()) == sum(range(1 << 20))
    out["next_ok"] = cuda.device_array(1 << 20, dtype=np.uint8).size == 1 << 20
    print(json.dumps(out))
""")


def test_out_of_memory_is_numbas_error_and_cupy_memstrats():
    out = _child(OOM)
    assert out.get("code_is_oom") and out["is_memstrat_oom"] and out["requested_ok"], out
    assert out["message"].startswith("device strategy: out of memory allocating"), out
    assert out["n_failed"] == 1 and out["keep_ok"] and out["next_ok"], out


NO_STRATEGY = textwrap.dedent(r"""
    import numpy as np
    from numba import cuda
    import cupy_memstrat
    try:
        cuda.device_array(1024, dtype=np.uint8)
    except cupy_memstrat.NoStrategyError as exc:
        print("refused:", exc)
    @cuda.jit
    def inc(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1
    import cupy
    c = cupy.zeros(256, dtype=cupy.int32)
    inc[1, 256](cuda.as_cuda_array(c))   # kernels on CuPy arrays need no strategy
    print("kernel:", int(c.sum()))
""")


def test_without_a_strategy_allocation_is_refused_but_kernels_on_cupy_arrays_run():
    r = subprocess.run([sys.executable, "-c", NO_STRATEGY], capture_output=True, text=True, env=_env(), timeout=170)
    assert r.returncode == 0, r.stderr[-5000:]
    assert "refused: cupy_memstrat.numba: Numba asked for 1.0 KiB (1,024 bytes) on device 0" in r.stdout, r.stdout
    assert "cupy_memstrat.use('pool')" in r.stdout
    assert "kernel: 256" in r.stdout


LEAKY = """
import numpy as np
from numba import cuda
KEEP = []
def test_leaks_a_numba_array():
    KEEP.append(cuda.device_array(1 << 20, dtype=np.uint8))
def test_frees_its_numba_arrays():
    a = cuda.to_device(np.ones(1 << 18, dtype=np.float32))
    assert a.copy_to_host().sum() == 1 << 18
"""


def test_the_plugin_reports_a_leaked_numba_array(pytester, monkeypatch):
    for k in list(os.environ):
        if k.startswith("GPUMEM") or k in ("CUPY_MEMSTRAT_BACKEND", "CUPY_MEMSTRAT"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NUMBA_CUDA_MEMORY_MANAGER", "cupy_memstrat.numba")
    monkeypatch.setenv("PYTHONPATH", _with_compat(os.environ.get("PYTHONPATH")))
    pytester.makepyfile(LEAKY)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpumem", "--gpumem-leaks=fail", "-ra")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*_ test_leaks_a_numba_array _*",
                            "leaked 1 allocation, 1.0 MiB > limit 0 B (--gpumem-leaks)*"])
    assert "FAILED test_the_plugin_reports_a_leaked_numba_array.py::test_frees_its_numba_arrays" not in r.stdout.str()
