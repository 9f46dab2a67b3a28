"""Pytest plugin for probes: run a suite with CuPy's own MemoryAsyncPool as the
allocator (``-p cupy_async_alloc``, ``PYTHONPATH=tools/probes``), to compare its
outcomes with cupy_memstrat's ``async`` strategy."""
import cupy


def pytest_configure(config):
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
