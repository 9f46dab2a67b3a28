"""The ``device`` strategy: one ``cudaMalloc`` per allocation, no caching."""

from __future__ import annotations

from ..options import Option, as_size
from ._contract import ProvidedHooks
from .base import Strategy

__all__ = ["DeviceStrategy"]


def _as_granule(value, what: str) -> int:
    if isinstance(value, str) and "." in value:  # "512.9" would be cut to 512 bytes
        raise ValueError(f"{what}: expected a whole number of bytes (a power of two from 1 to 2 MiB), got {value!r}")
    n = as_size(value, what)
    if isinstance(n, str) or n < 1 or n & (n - 1) or n > 1 << 21:
        raise ValueError(f"{what}: expected a power of two of bytes from 1 to 2 MiB (512: as CuPy's pool), "
                         f"got {value!r}")
    return n


class DeviceStrategy(ProvidedHooks, Strategy):
    """One ``cudaMalloc`` per allocation and one ``cudaFree`` per free.

    Nothing is cached, so the statistics are exact: ``bytes_reserved`` equals
    ``bytes_in_use`` (bytes as requested; CUDA's own rounding is not visible)
    and memory goes back to CUDA the moment an array dies. This is the
    strategy for hunting leaks and for running under ``compute-sanitizer``,
    which sees every block with its true bounds (a pool hides overruns inside
    larger blocks).

    Cost: ``cudaMalloc``/``cudaFree`` take microseconds to about a hundred
    microseconds each, many times a pool's allocation, and ``cudaFree``
    synchronises the device (docs/benchmarks.md).

    Allocates on CuPy's current device; a block is accounted to, and freed
    for, the device that allocated it whatever device is current at the free.

    Block sizes: by default CuPy's arrays see exactly the bytes they asked
    for (``memptr.mem.size``), as with CuPy's own unpooled allocator
    (``cupy.cuda.set_allocator(None)``), so ``compute-sanitizer`` sees each
    block's true end. CuPy's pool reports sizes rounded up to 512 B, and at
    least one CuPy test relies on that
    (``statistics_tests/test_order.py::TestQuantile::test_percentile_memory_access``
    fails under ``device`` for that reason alone, docs/strategies.md);
    ``granule=512`` rounds as the pool does.

    Options (besides ``track_origins``):
        granule: round each allocation up to a multiple of this many bytes,
            a power of two from 1 (default: exact) to 2 MiB; 512 as CuPy's pool.

    Streams: ``cudaFree`` synchronises the device, so a block is never reused
    while any stream still uses it: :func:`cupy_memstrat.record_stream` has
    nothing to add and returns False.
    """

    name = "device"
    aliases = ("malloc",)
    free_waits_for_all_streams = True  # cudaFree synchronises the device
    description = "one cudaMalloc per allocation, one cudaFree per free, no caching: exact accounting"

    options = (
        Option("granule", _as_granule, 1,
               "round each allocation up to a multiple of this many bytes (512: as CuPy's pool); default 1, exact"),
    )

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        self.block_granule = self.config.get("granule", type(self).block_granule)  # (a subclass may drop the option)
        # cudaMalloc / cudaFree bound directly: no Python frame of our own
        # (unless a subclass defines its own hooks).
        self._provide_hooks(self.backend.malloc, self.backend.free)
