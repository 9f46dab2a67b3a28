"""A fake CUDA backend for machines without a GPU.

:class:`FakeBackend` simulates the CUDA behaviour that cupy_memstrat relies on,
as measured on the H200 machine (``shared/FACTS.md``) or documented by CUDA.
It is a simulator, not a mock: it keeps per-device capacities, a current
device, live allocations and CUDA's sticky last error, and it fails the way
CUDA fails. Third-party strategy authors can test against it too::

    from cupy_memstrat.testing import FakeBackend
    s = cupy_memstrat.strategies.DeviceStrategy(backend=FakeBackend(memory="1GiB"))
    ptr = s.raw_malloc(4096)

What it simulates (``cudaMalloc`` path):

* ``malloc(0)`` succeeds with the null pointer; pointers are 256-byte aligned
  (CUDA's documented minimum for ``cudaMalloc``) and unique per device.
* A request beyond the device's free memory fails with
  ``cudaErrorMemoryAllocation`` *and* leaves it as the last error until
  ``clear_last_error()`` (FACTS.md: sticky OOM error).
* ``free`` of an unknown or already-freed pointer fails with
  ``cudaErrorInvalidValue`` (and sets the last error); ``free(0)`` is a no-op.
* ``free`` finds the owning device from the pointer, whatever device is current.

What it does not simulate: memory contents, the driver's page-size rounding of
large ``cudaMalloc`` calls (not measured; the fake rounds to 256 bytes).
"""

from __future__ import annotations

import threading

from . import cuda as _cuda
from .sizes import parse_size

__all__ = ["FakeBackend", "FakeCUDAError"]

_ALIGN = 256
_DEVICE_STRIDE = 1 << 40  # each fake device's addresses live in their own TiB


class FakeCUDAError(RuntimeError):
    """A simulated CUDA runtime error; ``status`` is the ``cudaError_t`` code."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"{_cuda.error_name(status)} (simulated by FakeBackend)")


class FakeBackend:
    """Simulated CUDA devices.

    Args:
        devices: number of devices.
        memory: bytes per device (int or size string such as ``"80GiB"``), one
            value for all devices or a list with one per device.
        name: device name reported by ``device_properties``.
        concurrent_managed_access, pageable_memory_access,
        memory_pools_supported: device attributes (H200 values by default).
        driver_version, runtime_version: CUDA-encoded versions (13000 = 13.0).

    Raises:
        ValueError: ``devices`` < 1 or a bad ``memory`` value.
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
    ):
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices: expected an int >= 1, got {devices!r}")
        mems = memory if isinstance(memory, (list, tuple)) else [memory] * devices
        if len(mems) != devices:
            raise ValueError(f"memory: expected {devices} values (one per device), got {len(mems)}")
        self._capacity = [parse_size(m, what="memory") for m in mems]
        self._used = [0] * devices
        self._next = [(d + 1) * _DEVICE_STRIDE for d in range(devices)]
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (size, device)
        self._lock = threading.Lock()
        self._local = threading.local()  # the current device is per thread, as in CUDA
        self._last_error = threading.local()
        self._props = {
            "name": name,
            "compute_capability": "9.0",
            "concurrent_managed_access": concurrent_managed_access,
            "pageable_memory_access": pageable_memory_access,
            "memory_pools_supported": memory_pools_supported,
        }
        self._versions = {"driver": driver_version, "runtime": runtime_version}
        self.n_malloc_calls = 0
        self.n_free_calls = 0

    # -- errors ---------------------------------------------------------------
    def _fail(self, status: int):
        self._last_error.status = status
        raise FakeCUDAError(status)

    def clear_last_error(self) -> int:
        status = getattr(self._last_error, "status", _cuda.ERROR_SUCCESS)
        self._last_error.status = _cuda.ERROR_SUCCESS
        return status

    def peek_last_error(self) -> int:
        """``cudaPeekAtLastError``: the sticky error, without clearing it."""
        return getattr(self._last_error, "status", _cuda.ERROR_SUCCESS)

    # -- devices --------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._capacity)

    def get_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: int) -> None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: expected an int device ordinal, got {type(device).__name__} {device!r}")
        if not 0 <= device < len(self._capacity):
            self._fail(_cuda.ERROR_INVALID_DEVICE)
        self._local.device = device

    def mem_get_info(self, device: int) -> tuple[int, int]:
        if not 0 <= device < len(self._capacity):
            self._fail(_cuda.ERROR_INVALID_DEVICE)
        return self._capacity[device] - self._used[device], self._capacity[device]

    def device_properties(self, device: int) -> dict:
        if not 0 <= device < len(self._capacity):
            self._fail(_cuda.ERROR_INVALID_DEVICE)
        return dict(self._props, total_memory=self._capacity[device])

    def versions(self) -> dict:
        return dict(self._versions)

    # -- cudaMalloc / cudaFree -----------------------------------------------
    def malloc(self, size: int) -> int:
        if size < 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        if size == 0:
            return 0
        device = self.get_device()
        rounded = -(-size // _ALIGN) * _ALIGN
        with self._lock:
            self.n_malloc_calls += 1
            if self._used[device] + rounded > self._capacity[device]:
                self._fail(_cuda.ERROR_MEMORY_ALLOCATION)
            ptr = self._next[device]
            self._next[device] += rounded
            self._used[device] += rounded
            self._live[ptr] = (rounded, device)
        return ptr

    def free(self, ptr: int) -> None:
        if ptr == 0:
            return
        with self._lock:
            self.n_free_calls += 1
            entry = self._live.pop(ptr, None)
            if entry is None:
                self._fail(_cuda.ERROR_INVALID_VALUE)
            rounded, device = entry
            self._used[device] -= rounded

    # -- inspection, for tests ------------------------------------------------
    def is_allocated(self, ptr: int) -> bool:
        """Whether ``ptr`` is a live allocation of this fake."""
        return ptr in self._live

    def used_bytes(self, device: int = 0) -> int:
        """Bytes the fake device has handed out (256-byte rounded)."""
        return self._used[device]

    def owner_device(self, ptr: int) -> int:
        """Device that holds ``ptr``; KeyError if it is not live."""
        return self._live[ptr][1]
