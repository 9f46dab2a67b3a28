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
    return (f"cupy-memstrat {dist.version} installed for {sys.executable}"
            + ("" if plugin else " (without its pytest plugin)"))


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Each strategy test runs with both allocation hot paths: the C one
    (csrc/hotpath.c) and the Python closures; they must behave alike."""
    from cupy_memstrat.strategies import _support

    if request.param == "c" and _support.c_hotpath is None:
        pytest.skip(_support.C_MISSING)
    monkeypatch.setenv(_support.HOT_PATH_ENV, request.param)
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


@pytest.fixture
def fake_cupy(monkeypatch, hot_path):
    """CuPy on a process-wide 1 GiB fake backend: no recording or CUPY_MEMSTRAT_OOM_SNAPSHOT
    left over; afterwards a recording in progress is stopped and CuPy's allocator put back."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    from cupy_memstrat import backends as C
    from cupy_memstrat import history

    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")
    monkeypatch.delenv("CUPY_MEMSTRAT_OOM_SNAPSHOT", raising=False)
    monkeypatch.setattr(C, "_backend", None)
    monkeypatch.setattr(history, "_active", None)
    monkeypatch.setattr(history, "_last", None)
    prev = cupy.cuda.get_allocator()
    yield monkeypatch
    if history._active is not None:
        history.record_history(False)
    cupy.cuda.set_allocator(prev)


@pytest.fixture
def fake_env(monkeypatch):
    """An inner pytest session on a simulated 1 GiB device: nothing of the outer
    environment's GPUMEM_* settings leaks in; the process's backend and CuPy
    allocator are put back afterwards."""
    import os

    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    from cupy_memstrat import backends as C

    for k in list(os.environ):
        if k.startswith("GPUMEM"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("CUPY_MEMSTRAT_BACKEND", "fake:memory=1GiB")
    monkeypatch.setattr(C, "_backend", None)
    prev = cupy.cuda.get_allocator()
    yield monkeypatch
    cupy.cuda.set_allocator(prev)
