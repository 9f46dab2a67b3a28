"""The :class:`FakeBackend` class: one mixin per capability of
:mod:`cupy_memstrat.backends.protocols`, each in its module of this package."""

from __future__ import annotations

from ...sizes import parse_size
from .checks import _CheckMixin
from .core import MAX_DEVICES, FakeCUDAError, _CoreMixin
from .managed import _ManagedMixin
from .pools import _PoolMixin
from .streams import _StreamMixin
from .vmm import _VmmMixin


class FakeBackend(_CoreMixin, _StreamMixin, _PoolMixin, _ManagedMixin, _VmmMixin, _CheckMixin):
    """Simulated CUDA devices: every protocol of :mod:`cupy_memstrat.backends.protocols`
    (:class:`~cupy_memstrat.backends.Backend`), one mixin per capability, and
    the test helpers named in :mod:`cupy_memstrat.testing`.

    Args:
        devices: number of devices.
        memory: bytes per device (int or size string such as ``"80GiB"``), one
            value for all devices or a list with one per device.
        name: device name reported by ``device_properties``.
        concurrent_managed_access, pageable_memory_access,
        memory_pools_supported: device attributes (H200 values by default).
        driver_version, runtime_version: CUDA-encoded versions (13000 = 13.0).
        per_thread_default_stream: CuPy's default stream is the per-thread
            default stream (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``): handle
            ``cudaStreamPerThread`` (2) in every thread, a separate stream in
            each (its work, events and pool frees are per thread).

    Raises:
        ValueError: ``devices`` outside 1..:data:`MAX_DEVICES` or a bad ``memory`` value.
    """

    name = "fake"
    Error = FakeCUDAError

    def __init__(
        self,
        devices: int = 1,
        memory="140GiB",
        *,
        name: str = "Fake NVIDIA H200",
        concurrent_managed_access: int = 1,
        pageable_memory_access: int = 0,
        memory_pools_supported: int = 1,
        driver_version: int = 13000,
        runtime_version: int = 13000,
        per_thread_default_stream: bool = False,
        nvml: bool = True,
    ):
        if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES:
            raise ValueError(f"devices: expected an int from 1 to {MAX_DEVICES}, got {devices!r}")
        if not isinstance(nvml, bool):
            raise ValueError(f"nvml: expected True or False, got {nvml!r}")
        mems = memory if isinstance(memory, (list, tuple)) else [memory] * devices
        if len(mems) != devices:
            raise ValueError(f"memory: expected {devices} values (one per device), got {len(mems)}")
        props = {
            "name": name,
            "compute_capability": "9.0",
            "concurrent_managed_access": concurrent_managed_access,
            "pageable_memory_access": pageable_memory_access,
            "memory_pools_supported": memory_pools_supported,
        }
        versions = {"driver": driver_version, "runtime": runtime_version}
        self._init_core([parse_size(m, what="memory") for m in mems], props, versions)
        self._nvml = nvml
        self._init_streams(devices, per_thread_default_stream)
        self._init_pools(devices)  # after the streams: a pool's handle comes from the same counter
        self._init_checks()
        self._init_managed()
        self._init_vmm()
