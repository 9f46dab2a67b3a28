"""Testing without a GPU: the simulated GPU of :mod:`cupy_memstrat.backends.sim`.

:class:`FakeBackend` simulates the CUDA behaviour that cupy_memstrat relies on,
as CUDA documents it or as a GPU shows it (docs/claims.md, docs/async.md,
docs/managed.md): per-device capacities, a current device, live allocations,
streams, stream-ordered pools, managed memory with page residency, and CUDA's
sticky last error. It is a simulator, not a mock: it fails the way CUDA fails.
Third-party strategy authors can test against it too::

    from cupy_memstrat.testing import FakeBackend
    s = cupy_memstrat.strategies.DeviceStrategy(backend=FakeBackend(memory="1GiB"))
    ptr = s.raw_malloc(4096)

``CUPY_MEMSTRAT_BACKEND=fake[:options]`` makes it the process's backend
(:func:`backend_from_env`). What it simulates, and what it does not, is listed
in :mod:`cupy_memstrat.backends.sim`.
"""

from __future__ import annotations

from ..backends.sim import FakeBackend, FakeCheckKernels, FakeCUDAError, FakeStream, backend_from_env

__all__ = ["FakeBackend", "FakeCUDAError", "FakeCheckKernels", "FakeStream", "backend_from_env"]

# The public classes are named where users import them (reprs, pickles and the API reference).
for _cls in (FakeBackend, FakeCUDAError, FakeStream):
    _cls.__module__ = __name__
del _cls
