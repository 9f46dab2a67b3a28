"""The real backend: :class:`RealBackend`, CUDA through CuPy's Cython runtime
wrappers on the allocation hot path (``cupy.cuda.runtime.malloc`` / ``free``
cost no Python frame of their own) and ``cuda.bindings`` where CuPy has no
wrapper; :class:`CheckKernels`, the checking layer's kernels compiled through
CuPy (NVRTC).

The interface it implements, with its methods' units, errors and the CUDA calls
behind them, is :mod:`cupy_memstrat.backends.protocols`; the simulator beside it
is :mod:`cupy_memstrat.backends.sim`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..errors import CuPyNotInstalledError, NoDeviceError
from .codes import (
    ERROR_SUCCESS,
    ERROR_NOT_READY,
    HOST,
    MEMORY_TYPES,
)

__all__ = ["RealBackend", "CheckKernels", "kernel_source"]

# cudaDeviceAttr values (CUDA runtime API).
_ATTR_PAGEABLE_MEMORY_ACCESS = 88
_ATTR_CONCURRENT_MANAGED_ACCESS = 89
_ATTR_MEMORY_POOLS_SUPPORTED = 115


def _import_runtime():
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError as exc:
        raise CuPyNotInstalledError(
            "CuPy is not installed, and cupy_memstrat needs it for GPU memory: install "
            "a CuPy wheel, e.g. pip install 'cupy-memstrat[cuda13]' (or [cuda12]) "
            f"({exc})"
        ) from exc
    return runtime


# The seam's members that are CuPy's own runtime wrappers (cupy_backends.cuda.api.runtime), by the
# name the backend protocols give them: the hot path (malloc, free, the device) and the stream-ordered
# pools. RealBackend binds each to its instance.
_CUPY_RUNTIME = {
    "malloc": "malloc",
    "free": "free",
    "get_device": "getDevice",
    "set_device": "setDevice",
    "device_count": "getDeviceCount",
    "malloc_from_pool_async": "mallocFromPoolAsync",
    "free_async": "freeAsync",
    "pool_destroy": "memPoolDestroy",
    "pool_trim_to": "memPoolTrimTo",
    "pool_get_attribute": "memPoolGetAttribute",
    "pool_set_attribute": "memPoolSetAttribute",
    "device_default_pool": "deviceGetDefaultMemPool",
    "device_current_pool": "deviceGetMemPool",
}


class RealBackend:
    """CUDA through CuPy's runtime (hot path) and ``cuda.bindings``.

    Raises:
        CuPyNotInstalledError: CuPy is not importable.
        NoDeviceError: CUDA reports no usable device (no driver, no GPU, a
            driver older than CuPy's runtime); the message carries CUDA's reason.
    """

    name = "cuda"
    # Bound in __init__ to CuPy's Cython wrappers (cupy_memstrat.backends.protocols says
    # what each does); declared here so that the class shows the whole seam.
    Error: type[BaseException]
    malloc: Callable[[int], int]
    free: Callable[[int], None]
    get_device: Callable[[], int]
    set_device: Callable[[int], None]
    device_count: Callable[[], int]
    current_stream: Callable[..., Any]
    malloc_from_pool_async: Callable[[int, int, int], int]
    free_async: Callable[[int, int], None]
    pool_destroy: Callable[[int], None]
    pool_trim_to: Callable[[int, int], None]
    pool_get_attribute: Callable[[int, int], int]
    pool_set_attribute: Callable[[int, int, int], None]
    device_default_pool: Callable[[int], int]
    device_current_pool: Callable[[int], int]

    def __init__(self):
        runtime = _import_runtime()
        try:
            n = runtime.getDeviceCount()
        except runtime.CUDARuntimeError as exc:
            raise NoDeviceError(f"no CUDA device is available: {exc}{_no_device_hint()}") from exc
        if n == 0:
            raise NoDeviceError(f"no CUDA device is available: CUDA reports 0 devices{_no_device_hint()}")
        self._runtime = runtime
        self.Error = runtime.CUDARuntimeError
        # Hot path: CuPy's Cython wrappers, bound directly (no Python frame).
        # CuPy's check_status() calls cudaGetLastError before it raises, so a
        # failed cudaMalloc through these leaves no sticky error behind
        # (cupy_backends/cuda/api/runtime.pyx, v14.2.0).
        for name, wrapper in _CUPY_RUNTIME.items():
            setattr(self, name, getattr(runtime, wrapper))
        from cupy.cuda.stream import get_current_stream

        self.current_stream = get_current_stream
        self._get_current_stream = get_current_stream
        self._check_kernels = None

    # -- managed memory ----------------------------------------------------------
    def malloc_managed(self, size: int) -> int:
        return self._runtime.mallocManaged(size, 1)  # cudaMemAttachGlobal

    def memory_type(self, ptr: int) -> str:
        try:
            kind = self._runtime.pointerGetAttributes(ptr).type
        except self.Error:
            return "unregistered"
        return MEMORY_TYPES.get(kind, "unregistered")

    @staticmethod
    def _location(cudart, location: int):
        loc = cudart.cudaMemLocation()
        if location == HOST:
            loc.type = cudart.cudaMemLocationType.cudaMemLocationTypeHost
            loc.id = 0
        else:
            loc.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
            loc.id = location
        return loc

    def _check_bindings(self, cudart, err) -> None:
        if int(err) != ERROR_SUCCESS:
            cudart.cudaGetLastError()
            raise self.Error(int(err))

    def mem_advise(self, ptr: int, size: int, advice: int, location: int) -> None:
        """``cudaMemAdvise`` with a ``cudaMemLocation`` (through cuda.bindings:
        CuPy 14's ``memAdvise`` takes an int device and on CUDA 13 cannot name
        the host: it always builds a device location)."""
        cudart = _bindings_runtime()
        loc = self._location(cudart, location)
        advise = getattr(cudart, "cudaMemAdvise_v2", None)  # CUDA 12 bindings
        if advise is None:
            advise = cudart.cudaMemAdvise  # CUDA 13: takes the location
        (err,) = advise(ptr, size, cudart.cudaMemoryAdvise(advice), loc)
        self._check_bindings(cudart, err)

    def mem_prefetch(self, ptr: int, size: int, location: int, stream: int) -> None:
        """``cudaMemPrefetchAsync`` to a ``cudaMemLocation`` on ``stream``."""
        cudart = _bindings_runtime()
        loc = self._location(cudart, location)
        prefetch = getattr(cudart, "cudaMemPrefetchAsync_v2", None)  # CUDA 12 bindings
        if prefetch is None:
            prefetch = cudart.cudaMemPrefetchAsync  # CUDA 13: (ptr, size, location, flags, stream)
        (err,) = prefetch(ptr, size, loc, 0, stream)
        self._check_bindings(cudart, err)

    def device_can_access_peer(self, device: int, peer: int) -> bool:
        return bool(self._runtime.deviceCanAccessPeer(device, peer))

    def pool_set_access(self, pool: int, devices) -> None:
        from cuda.bindings import runtime as cudart

        descs = []
        for d in devices:
            desc = cudart.cudaMemAccessDesc()
            desc.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
            desc.location.id = d
            desc.flags = cudart.cudaMemAccessFlags.cudaMemAccessFlagsProtReadWrite
            descs.append(desc)
        (err,) = cudart.cudaMemPoolSetAccess(cudart.cudaMemPool_t(pool), descs, len(descs))
        if int(err) != ERROR_SUCCESS:
            cudart.cudaGetLastError()
            raise self.Error(int(err))

    def mem_get_info(self, device: int) -> tuple[int, int]:
        cur = self.get_device()
        if cur != device:
            self.set_device(device)
        try:
            free, total = self._runtime.memGetInfo()
        finally:
            if cur != device:
                self.set_device(cur)
        return int(free), int(total)

    def device_synchronize(self, device: int) -> None:
        cur = self.get_device()
        if cur != device:
            self.set_device(device)
        try:
            self._runtime.deviceSynchronize()
        finally:
            if cur != device:
                self.set_device(cur)

    def process_used(self, device: int) -> int | None:
        """This process's memory on ``device`` as NVML counts it, through
        ``cuda.bindings.nvml`` (``nvmlDeviceGetComputeRunningProcesses_v3``, the
        device found by its PCI bus ID); None where it cannot be read
        (:class:`~cupy_memstrat.backends.DeviceBackend`). NVML is initialised
        once, on the first call; a device NVML cannot read is not asked again."""
        if type(device) is not int:
            return None
        handles = self.__dict__.setdefault("_nvml_handles", {})
        if device not in handles:
            handles[device] = self._nvml_handle(device)
        h = handles[device]
        if h is None:
            return None
        try:
            import numpy

            procs = self._nvml.device_get_compute_running_processes_v3(h)
            pids = numpy.atleast_1d(numpy.asarray(procs.pid)).tolist()
            used = numpy.atleast_1d(numpy.asarray(procs.used_gpu_memory)).tolist()
        except Exception:  # noqa: BLE001 - NVML refused (permissions, a lost GPU): no reading
            return None
        for pid, n in zip(pids, used):
            if int(pid) == os.getpid():
                # NVML_VALUE_NOT_AVAILABLE (all ones): the driver does not report it here
                return None if int(n) >= (1 << 64) - 1 else int(n)
        return None  # not listed: another PID namespace, or no context on the device yet

    def _nvml_handle(self, device: int):
        """NVML's handle of ``device``, or None where NVML cannot be used."""
        try:
            bus = self._runtime.deviceGetPCIBusId(device)
        except Exception:  # noqa: BLE001 - no such device: CUDA's error is not left behind
            self.clear_last_error()
            return None
        try:
            if getattr(self, "_nvml", None) is None:
                from cuda.bindings import nvml

                nvml.init_v2()
                self._nvml = nvml
            return self._nvml.device_get_handle_by_pci_bus_id_v2(bus)
        except Exception:  # noqa: BLE001 - no NVML (cuda-bindings without it, no library)
            return None

    def pool_create(self, device: int, max_size: int = 0) -> int:
        """``cudaMemPoolCreate`` through ``cuda.bindings`` (CuPy's wrapper
        cannot set ``maxSize``). Falls back to CuPy's wrapper when
        ``cuda.bindings`` is missing and no ``max_size`` is asked for.

        Raises:
            self.Error: CUDA refused (``status`` set).
            RuntimeError: ``max_size`` given but ``cuda.bindings`` is missing.
        """
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            if max_size:
                raise RuntimeError(
                    "a pool max_size needs cuda.bindings: pip install 'cupy-memstrat[cuda13]' (or [cuda12])"
                ) from None
            rt = self._runtime
            # cudaMemAllocationTypePinned = 1, cudaMemHandleTypeNone = 0,
            # cudaMemLocationTypeDevice = 1 (driver_types.h)
            props = rt.MemPoolProps(1, 0, 1, device)
            return rt.memPoolCreate(props)
        props = cudart.cudaMemPoolProps()
        props.allocType = cudart.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.handleTypes = cudart.cudaMemAllocationHandleType.cudaMemHandleTypeNone
        props.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = device
        props.maxSize = max_size
        err, pool = cudart.cudaMemPoolCreate(props)
        if int(err) != ERROR_SUCCESS:
            cudart.cudaGetLastError()
            raise self.Error(int(err))
        return int(pool)

    # -- virtual memory management (cuda.bindings' driver API) --------------------
    def _driver(self):
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise CuPyNotInstalledError(
                "virtual memory management needs cuda.bindings (the cuda-python bindings): "
                "pip install 'cupy-memstrat[cuda13]' (or [cuda12])") from exc
        return driver

    def _check_driver(self, err) -> None:
        # CUresult's codes the seam names have the runtime's values (codes.ERROR_NOT_SUPPORTED)
        if int(err) != ERROR_SUCCESS:
            raise self.Error(int(err))

    def _vmm_prop(self, driver, device: int):
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    def vmm_granularity(self, device: int) -> int:
        driver = self._driver()
        err, g = driver.cuMemGetAllocationGranularity(
            self._vmm_prop(driver, device), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self._check_driver(err)
        return int(g)

    def vmm_reserve(self, size: int, alignment: int = 0, hint: int = 0) -> int:
        driver = self._driver()
        err, ptr = driver.cuMemAddressReserve(size, alignment, hint, 0)
        self._check_driver(err)
        return int(ptr)

    def vmm_free_address(self, ptr: int, size: int) -> None:
        (err,) = self._driver().cuMemAddressFree(ptr, size)
        self._check_driver(err)

    def vmm_create(self, device: int, size: int) -> int:
        driver = self._driver()
        cur = self.get_device()
        if cur != device:  # the driver API works in the current context: the device's primary one
            self.set_device(device)
        try:
            err, handle = driver.cuMemCreate(size, self._vmm_prop(driver, device), 0)
        finally:
            if cur != device:
                self.set_device(cur)
        self._check_driver(err)
        return int(handle)

    def vmm_release(self, handle: int) -> None:
        driver = self._driver()
        (err,) = driver.cuMemRelease(driver.CUmemGenericAllocationHandle(handle))
        self._check_driver(err)

    def vmm_map(self, ptr: int, size: int, handle: int) -> None:
        driver = self._driver()
        (err,) = driver.cuMemMap(ptr, size, 0, driver.CUmemGenericAllocationHandle(handle), 0)
        self._check_driver(err)

    def vmm_set_access(self, ptr: int, size: int, device: int) -> None:
        driver = self._driver()
        desc = driver.CUmemAccessDesc()
        desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        (err,) = driver.cuMemSetAccess(ptr, size, [desc], 1)
        self._check_driver(err)

    def vmm_unmap(self, ptr: int, size: int) -> None:
        (err,) = self._driver().cuMemUnmap(ptr, size)
        self._check_driver(err)

    def device_properties(self, device: int) -> dict:
        rt = self._runtime
        props = rt.getDeviceProperties(device)
        name = props["name"]
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return {
            "name": name,
            "total_memory": int(props["totalGlobalMem"]),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "concurrent_managed_access": rt.deviceGetAttribute(
                _ATTR_CONCURRENT_MANAGED_ACCESS, device
            ),
            "pageable_memory_access": rt.deviceGetAttribute(_ATTR_PAGEABLE_MEMORY_ACCESS, device),
            "memory_pools_supported": rt.deviceGetAttribute(_ATTR_MEMORY_POOLS_SUPPORTED, device),
        }

    def context_active(self, device: int) -> bool:
        """Whether ``device``'s primary CUDA context exists in this process,
        asked without creating it (``cuDevicePrimaryCtxGetState``). Memory can
        only be held on a device that has one, and making one is costly
        (seconds): reading CuPy's pool total on a second device makes each
        pytest-xdist worker create a context there. True where the driver
        cannot tell (the caller then asks anyway).
        """
        from cuda.bindings import driver

        err, dev = driver.cuDeviceGet(device)
        if int(err) != 0:
            return True
        err, _flags, active = driver.cuDevicePrimaryCtxGetState(dev)
        return bool(active) if int(err) == 0 else True

    def versions(self) -> dict:
        rt = self._runtime
        return {"driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion()}

    # -- streams, events, memset: the checking layer (cupy_memstrat.checks) ------------
    def stream_busy(self, stream: int) -> bool:
        """``cudaStreamQuery``: True while ``stream`` has work queued that has
        not finished. ``cudaErrorNotReady`` is not an error and is not left
        as CUDA's last error; any other status (a destroyed handle) counts as
        idle."""
        status = self._runtime.streamQuery(stream)
        if status == ERROR_SUCCESS:
            return False
        if status == ERROR_NOT_READY:
            return True
        self.clear_last_error()
        return False

    def current_stream_ptr(self, device: int) -> int:
        return self._get_current_stream(device).ptr

    def stream_owns_handle(self, stream) -> bool:
        from cupy.cuda.stream import ExternalStream

        if isinstance(stream, ExternalStream):
            return False
        # cupy.cuda.Stream.from_external(obj) (CuPy 14, which deprecates ExternalStream): a
        # Stream that keeps the foreign object in _foreign_stream_ref and destroys nothing
        # (as in CuPy 14.2)
        return getattr(stream, "_foreign_stream_ref", None) is None

    def current_stream_ptr_capsule(self):
        """CuPy's C function ``get_stream_ptr(device)``
        (``cupy_backends.cuda.stream``, exported in the module's
        ``__pyx_capi__``; docs/streams.md), or None if this CuPy build does not export it
        (the hot path then calls :meth:`current_stream_ptr`)."""
        try:
            from cupy_backends.cuda import stream

            capsule = stream.__pyx_capi__["get_stream_ptr"]
        except (ImportError, AttributeError, KeyError):
            return None
        import ctypes

        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        return capsule if get_name(capsule) == b"intptr_t (int)" else None

    def stream_destroyed(self, stream: int) -> bool:
        """False: CUDA cannot tell a destroyed handle from a live one without
        undefined behaviour (``cudaStreamQuery`` on one can crash the
        process, docs/streams.md)."""
        return False

    def stream_non_blocking(self, stream: int) -> bool:
        """Whether ``stream`` was created with ``cudaStreamNonBlocking`` (it
        does not synchronise with the legacy default stream)."""
        if stream in (0, 1):
            return False
        return bool(self._runtime.streamGetFlags(stream) & 1)

    def event_create(self) -> int:
        """``cudaEventCreateWithFlags(cudaEventDisableTiming)`` on the current device."""
        return self._runtime.eventCreateWithFlags(2)

    def event_record(self, event: int, stream: int) -> None:
        self._runtime.eventRecord(event, stream)

    def event_done(self, event: int) -> bool:
        """``cudaEventQuery``: True once the work before the record has finished."""
        status = self._runtime.eventQuery(event)
        if status == ERROR_NOT_READY:
            return False
        if status != ERROR_SUCCESS:
            self.clear_last_error()
        return True

    def event_destroy(self, event: int) -> None:
        self._runtime.eventDestroy(event)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """``cudaMemsetAsync``: ``nbytes`` bytes at ``ptr`` set to the byte
        ``value``, on ``stream``."""
        self._runtime.memsetAsync(ptr, value, nbytes, stream)

    def check_kernels(self) -> "CheckKernels":
        """The checking layer's kernels (compiled on first use)."""
        k = self._check_kernels
        if k is None:
            k = self._check_kernels = CheckKernels(self)
        return k

    def clear_last_error(self) -> int:
        # CuPy's runtime already cleared its own copy (see __init__). Code that
        # also uses cuda.bindings' runtime keeps a separate last-error state:
        # clear that one too, but only if it is loaded (no import, no init).
        rt = sys.modules.get("cuda.bindings.runtime")
        if rt is None:
            return ERROR_SUCCESS
        (err,) = rt.cudaGetLastError()
        return int(err)


def kernel_source(name: str) -> str:
    """The text of ``csrc/<name>``: from the installed package data
    (``cupy_memstrat.csrc``), or from the source tree's ``csrc/``.

    Raises:
        FileNotFoundError: neither has it (a broken install).
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cupy_memstrat/
    for path in (os.path.join(package, "csrc", name), os.path.join(os.path.dirname(package), "csrc", name)):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    try:
        from importlib.resources import files

        return (files("cupy_memstrat.csrc") / name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, TypeError):
        pass
    raise FileNotFoundError(f"cupy_memstrat: kernel source csrc/{name} is missing from this installation")


class CheckKernels:
    """The GPU side of :mod:`cupy_memstrat.checks`: ``memstrat_verify``
    (csrc/checks.cu) compiled through CuPy (NVRTC) on first use, a results
    buffer of :attr:`SLOTS` slots per device (``cudaMalloc``, never the
    allocator being checked) and one host-mapped flag word
    (``cudaHostAlloc(cudaHostAllocPortable | cudaHostAllocMapped)``) that a
    kernel sets when it finds damage.

    A slot holds two uint64: the number of bytes that differed, and the first
    differing offset (``2**64 - 1`` for none).
    """

    SLOTS = 1 << 14
    _BLOCK = 256

    def __init__(self, backend: RealBackend):
        import numpy as np
        import ctypes

        rt = backend._runtime
        self._backend, self._rt, self._np = backend, rt, np
        self._flag_ptr = rt.hostAlloc(64, 3)  # portable | mapped; UVA: the same address on the device
        self._flag = np.ctypeslib.as_array((ctypes.c_uint32 * 16).from_address(self._flag_ptr))
        self._flag[:] = 0
        self._results: dict[int, int] = {}
        self._kernel = None

    def _kernel_fn(self):
        if self._kernel is None:
            import cupy

            module = cupy.RawModule(code=kernel_source("checks.cu"), options=("--std=c++14",))
            self._kernel = module.get_function("memstrat_verify")
        return self._kernel

    def _results_of(self, device: int) -> int:
        ptr = self._results.get(device)
        if ptr is None:
            ptr = self._rt.malloc(16 * self.SLOTS)  # cudaMalloc on the current device (= device)
            self._reset_all(ptr)
            self._results[device] = ptr
        return ptr

    def _reset_all(self, ptr: int) -> None:
        np = self._np
        host = np.zeros(2 * self.SLOTS, dtype=np.uint64)
        host[1::2] = np.iinfo(np.uint64).max
        self._rt.memcpy(ptr, host.ctypes.data, host.nbytes, 1)  # cudaMemcpyHostToDevice

    def verify(self, device: int, ptr: int, start: int, end: int, pattern: int, slot: int, stream: int) -> None:
        """Queue a check of bytes ``[start, end)`` of ``ptr`` against the byte
        ``pattern`` on ``stream`` (of ``device``); the result lands in ``slot``."""
        rt = self._rt
        cur = rt.getDevice()
        if cur != device:
            rt.setDevice(device)
        try:
            results = self._results_of(device)
            n = end - start
            blocks = max(1, min(1024, (n // 8 + self._BLOCK - 1) // self._BLOCK))
            self._kernel_fn()(
                (blocks,), (self._BLOCK,),
                (ptr, start, end, pattern, results, slot, self._flag_ptr),
                stream=_ExternalStreamPtr(stream),
            )
        finally:
            if cur != device:
                rt.setDevice(cur)

    def flagged(self) -> bool:
        """Whether a kernel has reported damage since :meth:`clear_flag`."""
        return bool(self._flag[0])

    def clear_flag(self) -> None:
        self._flag[0] = 0

    def read(self, device: int) -> "dict[int, tuple[int, int]]":
        """``{slot: (bytes that differed, first differing offset)}`` for the
        slots of ``device`` that found damage; those slots are reset.
        Synchronise the device first: this reads what has finished."""
        np = self._np
        ptr = self._results.get(device)
        if ptr is None:
            return {}
        host = np.empty(2 * self.SLOTS, dtype=np.uint64)
        rt = self._rt
        cur = rt.getDevice()
        if cur != device:
            rt.setDevice(device)
        try:
            rt.memcpy(host.ctypes.data, ptr, host.nbytes, 2)  # cudaMemcpyDeviceToHost
            bad = np.flatnonzero(host[0::2])
            if bad.size:
                self._reset_all(ptr)
        finally:
            if cur != device:
                rt.setDevice(cur)
        return {int(i): (int(host[2 * i]), int(host[2 * i + 1])) for i in bad}


class _ExternalStreamPtr:
    """What CuPy's kernel launch reads of a stream: ``.ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _bindings_runtime():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise CuPyNotInstalledError(
            "advice and prefetch need cuda.bindings (the cuda-python bindings): "
            "pip install 'cupy-memstrat[cuda13]' (or [cuda12])"
        ) from exc
    return cudart


def _no_device_hint() -> str:
    if not os.path.exists("/dev/nvidiactl") and sys.platform.startswith("linux"):
        return (
            " (this machine has no NVIDIA driver or GPU at all: /dev/nvidiactl is missing; "
            "to try strategies without a GPU, set CUPY_MEMSTRAT_BACKEND=fake or pass "
            "backend=cupy_memstrat.testing.FakeBackend())"
        )
    return ""
