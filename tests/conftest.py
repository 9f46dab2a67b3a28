import os

# This suite chooses its backends itself (FakeBackend objects, and subprocesses that set
# CUPY_MEMSTRAT_BACKEND where they test it): a value inherited from the shell must not leak in.
os.environ.pop("CUPY_MEMSTRAT_BACKEND", None)
os.environ.pop("CUPY_MEMSTRAT", None)  # the strategy for run / use_from_env / the plugin
os.environ.pop("CUPY_MEMSTRAT_HOT_PATH", None)

import pytest

from cupy_memstrat.testing import FakeBackend


def pytest_report_header(config):
    """Whether this Python has the project installed: the tests that start a
    subprocess (``python -m cupy_memstrat run``, a pytest session with the
    plugin) find it only then, not through the checkout's folder."""
    import importlib.metadata
    import sys

    try:
        dist = importlib.metadata.distribution("cupy-memstrat")
    except importlib.metadata.PackageNotFoundError:
        return (f"cupy-memstrat: NOT installed for {sys.executable}: the tests that start a subprocess will "
                f"fail; install it for this Python: {sys.executable} -m pip install -e .")
    plugin = any(ep.name == "gpumem" or ep.value.startswith("pytest_gpumem")
                 for ep in dist.entry_points if ep.group == "pytest11")
    return f"cupy-memstrat {dist.version} installed for {sys.executable}" + ("" if plugin else " (without its pytest plugin)")


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
