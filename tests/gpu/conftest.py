"""tests/gpu: real CuPy on a real device. Skipped, with the reason, without one."""

import pytest

try:
    from cupy_memstrat.cuda import get_backend

    get_backend()
    _NO_GPU = None
except Exception as exc:  # CuPy missing, no driver, no device
    _NO_GPU = f"needs a CUDA device: {exc}"


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
