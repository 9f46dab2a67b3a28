import os

# This suite chooses its backends itself (FakeBackend objects, and subprocesses that set
# CUPY_MEMSTRAT_BACKEND where they test it): a value inherited from the shell must not leak in.
os.environ.pop("CUPY_MEMSTRAT_BACKEND", None)
os.environ.pop("CUPY_MEMSTRAT", None)  # the strategy for run / use_from_env / the plugin
os.environ.pop("CUPY_MEMSTRAT_HOT_PATH", None)

import pytest

from cupy_memstrat.testing import FakeBackend


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Each strategy test runs with both allocation hot paths: the C one
    (csrc/hotpath.c) and the Python closures; they must behave alike."""
    from cupy_memstrat.strategies import base

    if request.param == "c" and base._c_hotpath is None:
        pytest.skip(base._C_MISSING)
    monkeypatch.setenv(base.HOT_PATH_ENV, request.param)
    return request.param


@pytest.fixture
def fake(hot_path):
    """One simulated 1 GiB device (the test runs once per hot path)."""
    return FakeBackend(devices=1, memory="1GiB")


@pytest.fixture
def fake2(hot_path):
    """Two simulated devices of 1 GiB and 2 GiB (the test runs once per hot path)."""
    return FakeBackend(devices=2, memory=["1GiB", "2GiB"])


@pytest.fixture
def restore_cupy_allocator():
    """Put CuPy's allocator back after a test that installs strategies."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    prev = cupy.cuda.get_allocator()
    yield cupy
    cupy.cuda.set_allocator(prev)
