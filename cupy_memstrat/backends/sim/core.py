"""The fake's core: device memory, devices and CUDA's sticky last error
(:class:`cupy_memstrat.backends.CoreBackend` and
:class:`~cupy_memstrat.backends.DeviceBackend`)."""

from __future__ import annotations

import operator

import threading

from .. import codes as _codes

_ALIGN = 256
_UINT64_MAX = (1 << 64) - 1
_DEVICE_STRIDE = 1 << 40  # each fake device's addresses live in their own TiB


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


#: the most simulated devices (a node has 16 GPUs at most today; each costs tables per device)
MAX_DEVICES = 64


class FakeCUDAError(RuntimeError):
    """A simulated CUDA runtime error; ``status`` is the ``cudaError_t`` code."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"{_codes.error_name(status)} (simulated by FakeBackend)")


class _CoreMixin:
    """``cudaMalloc`` / ``cudaFree``, the current device (per thread), device
    properties and the sticky last error. State shared with the other mixins:
    ``_capacity``, ``_used``, ``_live`` (ptr -> (size, device)) and ``_lock``."""

    def _init_core(self, capacities: list, props: dict, versions: dict) -> None:
        devices = len(capacities)
        self._capacity = capacities
        self._used = [0] * devices  # every process's bytes, as the device's free memory counts them
        self._elsewhere = [0] * devices  # of which other processes hold (hold_elsewhere)
        self._nvml = True  # NVML lists this process (process_used); FakeBackend(nvml=False): not
        self._next = [(d + 1) * _DEVICE_STRIDE for d in range(devices)]
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (size, device)
        self._lock = threading.Lock()
        self._local = threading.local()  # the current device is per thread, as in CUDA
        # Devices with a primary context: made by cudaSetDevice (CUDA 12+) or
        # the first allocation on the current device, as in CUDA.
        self._contexts: set[int] = set()
        self._last_error = threading.local()
        self._props = props
        self._versions = versions
        self.n_malloc_calls = 0
        self.n_free_calls = 0
        self.n_device_synchronize_calls = 0

    # -- errors ---------------------------------------------------------------
    def _fail(self, status: int):
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        self._last_error.status = status
        raise FakeCUDAError(status)

    def clear_last_error(self) -> int:
        status = getattr(self._last_error, "status", _codes.ERROR_SUCCESS)
        self._last_error.status = _codes.ERROR_SUCCESS
        return status

    def peek_last_error(self) -> int:
        """``cudaPeekAtLastError``: the sticky error, without clearing it."""
        return getattr(self._last_error, "status", _codes.ERROR_SUCCESS)

    # -- devices --------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._capacity)

    def get_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: int) -> None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: expected an int device ordinal, got {type(device).__name__} {device!r}")
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        self._local.device = device
        self._contexts.add(device)

    def context_active(self, device: int) -> bool:
        """Whether ``device`` has a primary context (``cuDevicePrimaryCtxGetState``):
        once it was made current or allocated on."""
        return device in self._contexts

    def mem_get_info(self, device: int) -> tuple[int, int]:
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        return self._capacity[device] - self._used[device], self._capacity[device]

    def process_used(self, device: int) -> int | None:
        """This process's bytes on ``device`` (NVML's per-process count): the device's used
        memory less what other processes hold (:meth:`hold_elsewhere`); None for a device
        that does not exist, and where NVML does not list this process (``nvml=False``)."""
        if not self._nvml or not self._is_device(device):
            return None
        return self._used[device] - self._elsewhere[device]

    def _is_device(self, device) -> bool:
        return type(device) is int and 0 <= device < len(self._capacity)

    def device_properties(self, device: int) -> dict:
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        return dict(self._props, total_memory=self._capacity[device])

    def versions(self) -> dict:
        return dict(self._versions)

    # -- cudaMalloc / cudaFree -----------------------------------------------
    def malloc(self, size: int) -> int:
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        size = operator.index(size)  # a size_t, as CUDA's wrappers take it: a float is a TypeError
        if size < 0:
            self._fail(_codes.ERROR_INVALID_VALUE)
        if size == 0:
            return 0
        device = self.get_device()
        self._contexts.add(device)
        rounded = -(-size // _ALIGN) * _ALIGN
        with self._lock:
            self.n_malloc_calls += 1
            if self._used[device] + rounded > self._capacity[device]:
                self._fail(_codes.ERROR_MEMORY_ALLOCATION)
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
            if self._free_managed(ptr):
                return
            entry = self._live.pop(ptr, None)
            if entry is None:
                self._fail(_codes.ERROR_INVALID_VALUE)
            rounded, device = entry
            if self._free_pool_block(ptr, rounded):  # cudaFree of a pool block: synchronous, back to its pool
                return
            self._used[device] -= rounded

    def device_synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize``: orders every pending free on ``device``
        and applies its pools' release thresholds."""
        with self._lock:
            self.n_device_synchronize_calls += 1
            self._synchronized(device, None)
            for key, n in self._submitted.items():
                if (key[0] if isinstance(key, tuple) else self._stream_device.get(key)) == device:
                    self._completed[key] = n

    # -- inspection, for tests ------------------------------------------------
    def is_allocated(self, ptr: int) -> bool:
        """Whether ``ptr`` is a live allocation of this fake."""
        return ptr in self._live or ptr in self._managed

    def hold_elsewhere(self, nbytes: int, device: int = 0) -> None:
        """Another process on the device takes ``nbytes`` (releases them, when negative):
        the device's free memory (``mem_get_info``) and what this process can allocate
        shrink; this process's own count (``process_used``) does not move.

        Raises:
            TypeError: ``nbytes`` or ``device`` not an int.
            ValueError: a device that does not exist, more than the device has free, or more
                released than other processes hold; nothing changes.
        """
        if type(nbytes) is not int:
            raise TypeError(f"hold_elsewhere: nbytes: expected an int (bytes), got {type(nbytes).__name__} {nbytes!r}")
        if not self._is_device(device):
            raise ValueError(f"hold_elsewhere: device: expected an int from 0 to {len(self._capacity) - 1}, "
                             f"got {device!r}")
        with self._lock:
            held, free = self._elsewhere[device], self._capacity[device] - self._used[device]
            if held + nbytes < 0:
                raise ValueError(f"hold_elsewhere({nbytes}): other processes hold {held} bytes on device {device}: "
                                 f"expected a release of at most {held}")
            if nbytes > free:
                raise ValueError(f"hold_elsewhere({nbytes}): device {device} has {free} bytes free")
            self._elsewhere[device] += nbytes
            self._used[device] += nbytes

    def used_bytes(self, device: int = 0) -> int:
        """Bytes the fake device has handed out to this process (256-byte rounded).

        Raises:
            ValueError: a device that does not exist."""
        if not self._is_device(device):
            raise ValueError(f"used_bytes: device: expected an int from 0 to {len(self._capacity) - 1}, got {device!r}")
        return self._used[device] - self._elsewhere[device]

    def owner_device(self, ptr: int) -> int:
        """Device that holds ``ptr``; KeyError if it is not live."""
        return self._live[ptr][1]
