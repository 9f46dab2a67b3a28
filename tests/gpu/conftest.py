"""tests/gpu: real CuPy on a real device. Skipped, with the reason, without one."""

import os
import re

import pytest


def _short_reason(exc: BaseException) -> str:
    """One short line for the skip summary (pytest -ra prints it once per file)."""
    text = str(exc)
    code = re.search(r"cudaError\w+", text)
    why = code.group(0) if code else text.split(";")[0].split(" (")[0][:80]
    if "/dev/nvidiactl is missing" in text:
        why += ", no NVIDIA driver on this machine"
    return f"needs a CUDA device ({why})"


try:
    from cupy_memstrat.backends import get_backend

    get_backend()
    _NO_GPU = None
except Exception as exc:  # CuPy missing, no driver, no device
    _NO_GPU = _short_reason(exc)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_exclusive: reads or fills the whole device's free memory, so other tests on the same "
        "GPU would change its outcome: ci/gpu.sh runs these alone, after the others (which may run in parallel)")


def pytest_collection_modifyitems(config, items):
    if _NO_GPU is None:
        return
    skip = pytest.mark.skip(reason=_NO_GPU)
    for item in items:
        if "tests/gpu" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def cp():
    """CuPy, with the process allocator restored after the test."""
    import cupy

    prev = cupy.cuda.get_allocator()
    yield cupy
    cupy.cuda.set_allocator(prev)


@pytest.fixture
def n_devices():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


# The "long kernels" are one block of 256 threads that waits, then walks the
# whole array: they hold one SM, so work on other streams runs beside them at
# once (a full grid of waiting blocks would hold every SM and serialise it).
# SPIN clock cycles are ~50 ms on an H200. slow_copy and slow_fill are the ones
# bench streams uses (cupy_memstrat.bench.streams.KERNELS).
_FILL_N = r"""
extern "C" __global__ void fill_n(float* x, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""


@pytest.fixture
def k(cp):
    """The long kernels: ``slow_copy(x, y, n, cycles)``, ``slow_fill(x, n, v,
    cycles)`` (one block; wait, then walk the array) and ``fill_n``."""
    from cupy_memstrat.bench.streams import KERNELS

    m = cp.RawModule(code=KERNELS + _FILL_N)
    return {name: m.get_function(name) for name in ("slow_copy", "slow_fill", "fill_n")}


@pytest.fixture
def inner(pytester, monkeypatch):
    """pytester for an inner session that sees none of the outer run's GPUMEM_* settings, its
    CUPY_MEMSTRAT_BACKEND, nor, under pytest-xdist, its worker's PYTEST_XDIST_* (the inner
    session is a session of its own: plugins such as pytest-benchmark would take it for a worker)."""
    for k in list(os.environ):
        if k.startswith(("GPUMEM", "PYTEST_XDIST_")) or k == "CUPY_MEMSTRAT_BACKEND":
            monkeypatch.delenv(k)
    return pytester
