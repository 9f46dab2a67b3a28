"""The ``torch`` strategy: CuPy allocates from PyTorch's caching allocator,
so CuPy and PyTorch share one pool, with the statistics every strategy keeps."""

from __future__ import annotations


from .. import backends as _backends
from ..errors import MemstratError
from .foreign_reserve import ForeignReserve
from .library_pool import LibraryPoolStrategy

__all__ = ["TorchStrategy"]


def _import_torch():
    """``torch``, with CUDA. Raises MemstratError naming what is missing."""
    try:
        import torch
    except ImportError as exc:
        raise MemstratError(
            f"strategy 'torch' needs PyTorch with CUDA: import torch failed ({exc}); "
            "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"
        ) from None
    if not torch.cuda.is_available():
        raise MemstratError(
            f"strategy 'torch' needs PyTorch with CUDA: torch {torch.__version__} reports no CUDA "
            f"(torch.cuda.is_available() is False; torch.version.cuda is {torch.version.cuda!r}); "
            "install a CUDA build of PyTorch"
        )
    return torch


class TorchStrategy(LibraryPoolStrategy):
    """Allocate from PyTorch's CUDA caching allocator
    (``torch.cuda.caching_allocator_alloc`` / ``caching_allocator_delete``),
    so CuPy's arrays and PyTorch's tensors share one pool: memory CuPy frees
    is cached by PyTorch and can serve a tensor, and the other way round.

    Streams: each block is allocated on CuPy's current stream (its handle
    passed to PyTorch), and PyTorch's allocator keeps it for that stream: a
    freed block is reused at once by the next allocation on the same stream,
    and by another stream only through its own events
    (:func:`cupy_memstrat.record_stream` adds them, as ``Tensor.record_stream``
    does). PyTorch keys its cache by the stream's handle; CUDA gives a
    destroyed stream's handle to the next new stream while the old stream's
    work may still run (docs/streams.md), so, as a precaution, after a
    ``cupy.cuda.Stream`` that allocated dies, the next allocation on its
    device first waits for the device (one ``cudaDeviceSynchronize`` per
    such stream; :class:`~cupy_memstrat.strategies.stream_deaths.DeadStreamGuard`).
    PyTorch's allocator is not known to hand out a dead stream's block even
    without the wait: it is a precaution (docs/interop.md).

    Statistics: ``bytes_in_use`` / ``peak_bytes_in_use``: CuPy's side
    exactly (sizes rounded up to 512 B, as PyTorch's and CuPy's pools both
    round). ``bytes_reserved`` is ``torch.cuda.memory_reserved(device)``:
    everything PyTorch's allocator holds from CUDA there, PyTorch's own
    tensors included; ``peak_bytes_reserved`` is the highest value seen when
    the statistics were read, never below ``peak_bytes_in_use``.
    ``torch.cuda.memory_stats()`` counts CuPy's blocks as PyTorch's
    allocations (it does not tell the two apart).

    :meth:`trim` calls ``torch.cuda.empty_cache()`` (PyTorch frees every
    cached block, on every device: it offers no per-device release).
    Out of memory: PyTorch frees its cache and retries by itself; then
    CuPy's order (give back, ``gc.collect()``, retry), then
    ``cupy.cuda.memory.OutOfMemoryError``.

    With the fake backend (``cupy_memstrat.testing.FakeBackend``) PyTorch is
    not used: blocks come from the fake's ``malloc`` and nothing is cached.

    Raises (at creation):
        MemstratError: PyTorch is not installed, or has no CUDA.
        ValueError: CuPy sees more devices than PyTorch (a different
            ``CUDA_VISIBLE_DEVICES`` for each is not supported).
    """

    name = "torch"
    aliases = ("pytorch",)
    block_granule = 512
    description = "PyTorch's CUDA caching allocator: one pool for CuPy and PyTorch, with per-allocation statistics"
    reserved_is_in_use = False
    requires = "torch"

    def __init__(self, *, backend=None, **options):
        super().__init__(backend=backend, **options)
        #: what PyTorch's allocator holds, read as bytes_reserved (:class:`~.foreign_reserve.ForeignReserve`)
        self.foreign = ForeignReserve(self.backend.device_count(), self._foreign_reserved)

    _import_library = staticmethod(_import_torch)

    def _check_library(self, torch, backend) -> None:
        if backend.device_count() > torch.cuda.device_count():
            raise ValueError(
                f"strategy 'torch': CuPy sees {backend.device_count()} devices and PyTorch "
                f"{torch.cuda.device_count()}; both must see the same devices (CUDA_VISIBLE_DEVICES)"
            )

    def _library_hooks(self, torch):
        alloc, OutOfMemory = torch.cuda.caching_allocator_alloc, torch.cuda.OutOfMemoryError
        Error, status = self._Error, _backends.ERROR_MEMORY_ALLOCATION

        def allocate_on(size, device, stream):
            try:
                return alloc(size, device, stream.ptr)
            except OutOfMemory:  # PyTorch already freed its cache and retried
                raise Error(status) from None

        return allocate_on, torch.cuda.caching_allocator_delete

    def _reserved(self, device: int) -> int:
        return int(self.library.cuda.memory_reserved(device))

    def _foreign_reserved(self, device: int) -> int | None:
        return None if self.library is None else self._reserved(device)

    def stats(self, device: int | None = None):
        """As :meth:`Strategy.stats`; ``bytes_reserved`` is what the other allocator holds on
        the device (the class docstring says which), and ``peak_bytes_reserved`` the highest
        of those reads and of the peak in use."""
        return self.foreign.adjust(super().stats(device))

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """As :meth:`Strategy.reset_peak`; the reserved peak restarts from what the other
        allocator holds now."""
        d = self._device_or_current(device)
        super().reset_peak(d, reserved=reserved)
        if reserved:
            self.foreign.restart_peak(d)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """``torch.cuda.empty_cache()``: PyTorch gives its cached (free)
        blocks back to CUDA; returns the bytes released on the devices asked
        for (``torch.cuda.memory_reserved`` before and after). PyTorch
        releases on every device at once and all or nothing: with
        ``keep_bytes`` > 0 it releases only where it holds more than that.
        Blocks in use are never released. Without CUDA (fake backend)
        nothing is cached and this returns 0.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = self._trim_devices(keep_bytes, device)
        self.deferred.flush()  # blocks waiting for recorded streams go back first
        if self.library is None:
            return 0
        before = {d: self._reserved(d) for d, _ in devices}
        if all(before[d] == 0 or (keep and before[d] <= keep) for d, keep in devices):
            return 0
        self.library.cuda.empty_cache()
        return sum(max(0, before[d] - self._reserved(d)) for d, _ in devices)
