"""The ``device`` strategy: one ``cudaMalloc`` per allocation, no caching."""

from __future__ import annotations

from .base import Strategy

__all__ = ["DeviceStrategy"]


class DeviceStrategy(Strategy):
    """One ``cudaMalloc`` per allocation and one ``cudaFree`` per free.

    Nothing is cached, so the statistics are exact: ``bytes_reserved`` equals
    ``bytes_in_use`` (bytes as requested; CUDA's own rounding is not visible)
    and memory goes back to CUDA the moment an array dies. This is the
    strategy for hunting leaks and for running under ``compute-sanitizer``,
    which sees every block with its true bounds (a pool hides overruns inside
    larger blocks).

    Cost: ``cudaMalloc``/``cudaFree`` take microseconds to about a hundred
    microseconds each and ``cudaFree`` synchronises the device (measured on
    the H200: 3.2 us per pair at 512 B, 72 us at 1 MiB, 91 us at 32 MiB,
    against ~0.7 us for CuPy's pool; see docs/benchmarks.md).

    Allocates on CuPy's current device; a block is accounted to, and freed
    for, the device that allocated it whatever device is current at the free.

    Options: only the common ones (``track_origins``).
    """

    name = "device"
    aliases = ("malloc",)
    description = "one cudaMalloc per allocation, one cudaFree per free, no caching: exact accounting"

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        # cudaMalloc / cudaFree bound directly: no Python frame of our own
        # (unless a subclass defines its own hooks).
        if type(self)._allocate is Strategy._allocate:
            self._allocate = self.backend.malloc
        if type(self)._deallocate is Strategy._deallocate:
            self._deallocate = self.backend.free
