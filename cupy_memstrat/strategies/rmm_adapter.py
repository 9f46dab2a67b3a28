"""The ``rmm`` strategy: CuPy allocates through RMM (RAPIDS Memory Manager),
with the statistics every strategy keeps."""

from __future__ import annotations

from dataclasses import replace

from .. import backends as _backends
from ..errors import MemstratError
from ..options import Option
from ..stats import Stats
from .library_pool import LibraryPoolStrategy

__all__ = ["RMMStrategy"]


def _import_rmm():
    """``rmm``. Raises MemstratError naming what to install."""
    try:
        import rmm
        import rmm.mr  # noqa: F401
    except ImportError as exc:
        raise MemstratError(
            f"strategy 'rmm' needs RMM: import rmm failed ({exc}); "
            "install it with pip install rmm-cu13 (CUDA 13) or rmm-cu12 (CUDA 12)"
        ) from None
    return rmm


def _as_resource(value, what: str):
    """None, or an ``rmm.mr.DeviceMemoryResource`` (given in Python: a spec string cannot carry one)."""
    if value is None:
        return None
    expected = f"{what}: expected an rmm.mr.DeviceMemoryResource (e.g. rmm.mr.CudaAsyncMemoryResource())"
    if isinstance(value, str):
        raise TypeError(f"{expected}, got str {value!r} (a resource cannot be written in a spec string: pass it "
                        "in Python, use('rmm', resource=rmm.mr.PoolMemoryResource(...)))")
    try:
        import rmm.mr
    except ImportError:  # then no object is one
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r} (and RMM is not installed: "
                        "pip install rmm-cu13 or rmm-cu12)") from None
    if not isinstance(value, rmm.mr.DeviceMemoryResource):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    cls = type(value)
    if cls is rmm.mr.DeviceMemoryResource or not cls.__module__.startswith("rmm."):
        # the abstract base holds no C++ resource: RMM aborts the process (std::bad_optional_access)
        # at its first allocation; a Python subclass is no resource either (rmm.mr.CallbackMemoryResource
        # is RMM's way to allocate from Python)
        raise TypeError(f"{expected}, got an instance of {cls.__module__}.{cls.__qualname__}, which is not one of "
                        "RMM's resources (the abstract base, or a Python subclass of it: use "
                        "rmm.mr.CallbackMemoryResource to allocate from Python)")
    return value


class RMMStrategy(LibraryPoolStrategy):
    """Allocate through RMM: each block is an ``rmm.DeviceBuffer`` made on
    CuPy's current stream from RMM's current device resource
    (``rmm.mr.get_current_device_resource()`` at each allocation, as
    ``rmm.allocators.cupy.rmm_cupy_allocator`` does), or from the resource
    given with ``resource=``. The buffer is kept until CuPy frees the array,
    then dropped: RMM deallocates it on the stream it was allocated on.

    Streams (RMM's semantics): a free is stream-ordered on the allocation
    stream. RMM's pool resources keep a freed block for that stream and hand
    it to another stream only after an event of their own; RMM keys those
    caches by the stream's handle, and CUDA gives a destroyed stream's
    handle to the next new stream while the old stream's work may still run
    (docs/streams.md), so, as a precaution, after a ``cupy.cuda.Stream``
    that allocated dies, the next allocation on its device first waits for
    the device (one ``cudaDeviceSynchronize`` per such stream;
    :class:`~cupy_memstrat.strategies.stream_deaths.DeadStreamGuard`). RMM's
    pools are not known to hand out a dead stream's block even without the
    wait: it is a precaution (docs/interop.md).
    :func:`cupy_memstrat.record_stream` works as with every strategy.

    Statistics: ``bytes_in_use`` as requested by CuPy, rounded up to 512 B
    (as CuPy's pool rounds; RMM aligns to 256 B). ``bytes_reserved``: the
    resource's ``pool_size()`` where it has one (``PoolMemoryResource``);
    otherwise RMM reports nothing comparable and it equals ``bytes_in_use``.

    :meth:`trim` releases nothing (RMM's resources have no release call) and
    returns 0. Out of memory: RMM raises ``MemoryError``; then CuPy's order
    (give back other caches, ``gc.collect()``, retry), then
    ``cupy.cuda.memory.OutOfMemoryError``.

    With the fake backend (``cupy_memstrat.testing.FakeBackend``) RMM is not
    used: blocks come from the fake's ``malloc`` (a given ``resource`` is
    still checked).

    Options (besides the common ones):
        resource: an ``rmm.mr.DeviceMemoryResource`` to allocate from
            (Python only; default: RMM's current device resource).

    Raises (at creation):
        MemstratError: RMM is not installed.
        TypeError: ``resource`` is not an RMM device memory resource.
    """

    name = "rmm"
    block_granule = 512
    description = "RMM's current device resource (or one given), with per-allocation statistics"
    requires = "rmm"
    options = (
        Option("resource", _as_resource, None,
               "an rmm.mr.DeviceMemoryResource (Python only); default: RMM's current device resource"),
    )

    _import_library = staticmethod(_import_rmm)

    def _guard_key(self, rmm):
        # RMM's current resource (per device, replaceable) is the process's: one guard for RMM; a
        # resource given is the user's, with a guard of its own (kept nowhere else)
        return rmm if self.config["resource"] is None else None

    def _library_hooks(self, rmm):
        from rmm.pylibrmm.device_buffer import DeviceBuffer
        from rmm.pylibrmm.stream import Stream

        resource = self.config["resource"]
        buffers: dict = {}  # ptr -> DeviceBuffer: holds the block
        Error, status = self._Error, _backends.ERROR_MEMORY_ALLOCATION

        def allocate_on(size, device, stream):
            try:
                buf = DeviceBuffer(size=size, stream=Stream(obj=stream), mr=resource)
            except MemoryError:
                raise Error(status) from None
            ptr = buf.ptr
            buffers[ptr] = buf
            return ptr

        return allocate_on, buffers.pop  # dropping the buffer deallocates it on its stream

    def stats(self, device: int | None = None) -> Stats:
        """As :meth:`Strategy.stats`; ``bytes_reserved`` is the resource's
        ``pool_size()`` where it has one (see the class docstring)."""
        st = super().stats(device)
        if self.library is None:
            return st
        mr = self.config["resource"]
        if mr is None:
            with self._rmm_device(st.device):
                mr = self.library.mr.get_current_device_resource()
        pool_size = getattr(mr, "pool_size", None)
        if pool_size is None:
            return st
        reserved = int(pool_size())
        return replace(st, bytes_reserved=reserved, peak_bytes_reserved=max(st.peak_bytes_reserved, reserved))

    def _rmm_device(self, device: int):
        import cupy

        return cupy.cuda.Device(device)
