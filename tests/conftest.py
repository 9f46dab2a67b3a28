import os

# This suite chooses its backends itself (FakeBackend objects, and subprocesses that set
# CUPY_MEMSTRAT_BACKEND where they test it): a value inherited from the shell must not leak in.
os.environ.pop("CUPY_MEMSTRAT_BACKEND", None)

import pytest

from cupy_memstrat.testing import FakeBackend


@pytest.fixture
def fake():
    """One simulated 1 GiB device."""
    return FakeBackend(devices=1, memory="1GiB")


@pytest.fixture
def fake2():
    """Two simulated devices of 1 GiB and 2 GiB."""
    return FakeBackend(devices=2, memory=["1GiB", "2GiB"])


@pytest.fixture
def restore_cupy_allocator():
    """Put CuPy's allocator back after a test that installs strategies."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    prev = cupy.cuda.get_allocator()
    yield cupy
    cupy.cuda.set_allocator(prev)
