"""CUDA's numbers that both backends use: ``cudaError_t`` codes, pool attributes,
the per-thread default stream's handle, the host as a location and the managed-memory
advice values, with the values of the CUDA runtime API's ``driver_types.h`` (the same
in CUDA 12 and 13). Re-exported by :mod:`cupy_memstrat.backends`."""

from __future__ import annotations

__all__ = [
    "ERROR_SUCCESS", "ERROR_INVALID_VALUE", "ERROR_MEMORY_ALLOCATION", "ERROR_INSUFFICIENT_DRIVER",
    "ERROR_NO_DEVICE", "ERROR_INVALID_DEVICE", "ERROR_INVALID_RESOURCE_HANDLE", "ERROR_NOT_READY",
    "ERROR_NOT_SUPPORTED",
    "POOL_ATTR_RELEASE_THRESHOLD", "POOL_ATTR_RESERVED_MEM_CURRENT", "POOL_ATTR_RESERVED_MEM_HIGH",
    "POOL_ATTR_USED_MEM_CURRENT", "POOL_ATTR_USED_MEM_HIGH", "STREAM_PER_THREAD", "RELEASE_THRESHOLD_MAX",
    "HOST", "ADVISE_SET_READ_MOSTLY", "ADVISE_UNSET_READ_MOSTLY", "ADVISE_SET_PREFERRED_LOCATION",
    "ADVISE_UNSET_PREFERRED_LOCATION", "ADVISE_SET_ACCESSED_BY", "ADVISE_UNSET_ACCESSED_BY", "MEMORY_TYPES",
    "error_name",
]

# cudaError_t values (CUDA runtime API, driver_types.h); the same in CUDA 12 and 13.
ERROR_SUCCESS = 0
ERROR_INVALID_VALUE = 1
ERROR_MEMORY_ALLOCATION = 2
ERROR_INSUFFICIENT_DRIVER = 35
ERROR_NO_DEVICE = 100
ERROR_INVALID_DEVICE = 101
ERROR_INVALID_RESOURCE_HANDLE = 400
ERROR_NOT_READY = 600
#: also CUresult's CUDA_ERROR_NOT_SUPPORTED; the driver API's codes the seam raises (the virtual
#: memory calls: CUDA_ERROR_INVALID_VALUE 1, CUDA_ERROR_OUT_OF_MEMORY 2) have the runtime's values
ERROR_NOT_SUPPORTED = 801

_ERROR_NAMES = {
    ERROR_SUCCESS: "cudaSuccess",
    ERROR_INVALID_VALUE: "cudaErrorInvalidValue",
    ERROR_MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
    ERROR_INSUFFICIENT_DRIVER: "cudaErrorInsufficientDriver",
    ERROR_NO_DEVICE: "cudaErrorNoDevice",
    ERROR_INVALID_DEVICE: "cudaErrorInvalidDevice",
    ERROR_INVALID_RESOURCE_HANDLE: "cudaErrorInvalidResourceHandle",
    ERROR_NOT_READY: "cudaErrorNotReady",
    ERROR_NOT_SUPPORTED: "cudaErrorNotSupported",
}

# cudaMemPoolAttr values (CUDA runtime API, driver_types.h).
POOL_ATTR_RELEASE_THRESHOLD = 4
POOL_ATTR_RESERVED_MEM_CURRENT = 5
POOL_ATTR_RESERVED_MEM_HIGH = 6
POOL_ATTR_USED_MEM_CURRENT = 7
POOL_ATTR_USED_MEM_HIGH = 8
#: cudaStreamPerThread: the per-thread default stream's handle, the same value in every thread
STREAM_PER_THREAD = 2
#: largest release threshold: the pool keeps all freed memory (cudaMemPoolAttrReleaseThreshold is a cuuint64_t).
RELEASE_THRESHOLD_MAX = (1 << 64) - 1

# Managed memory: cudaCpuDeviceId, the host as a location, and cudaMemoryAdvise values.
HOST = -1
ADVISE_SET_READ_MOSTLY = 1
ADVISE_UNSET_READ_MOSTLY = 2
ADVISE_SET_PREFERRED_LOCATION = 3
ADVISE_UNSET_PREFERRED_LOCATION = 4
ADVISE_SET_ACCESSED_BY = 5
ADVISE_UNSET_ACCESSED_BY = 6
#: cudaMemoryType -> name (cudaPointerGetAttributes)
MEMORY_TYPES = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}


def error_name(status: int) -> str:
    """Name of a ``cudaError_t`` code, e.g. ``2 -> "cudaErrorMemoryAllocation"``."""
    return _ERROR_NAMES.get(status, f"cudaError({status})")
