"""What a *backend* is: the interface between cupy_memstrat and CUDA.

Strategies, the checking layer and the fault counters never call CUDA
themselves: they call a backend object. Two implement every protocol below:
:class:`cupy_memstrat.backends.RealBackend` (CUDA) and
:class:`cupy_memstrat.testing.FakeBackend` (the simulator,
:mod:`cupy_memstrat.backends.sim`).

The interface is split by capability, one :class:`typing.Protocol` each:

* :class:`CoreBackend`: allocate and free device memory, the current device,
  free memory and CUDA's sticky last error. Every strategy needs it, and a
  strategy made with ``backend=`` refuses an object without it
  (:func:`require`);
* :class:`DeviceBackend`: device properties, versions, contexts, synchronisation;
* :class:`StreamBackend`: CuPy's current stream and what is known of a stream;
* :class:`PoolBackend`: stream-ordered pools (``cudaMemPool_t``), the ``async``
  strategy (docs/async.md);
* :class:`ManagedBackend`: managed memory, the ``managed`` strategy,
  :func:`cupy_memstrat.prefetch` and :func:`cupy_memstrat.advise` (docs/managed.md);
* :class:`VmmBackend`: CUDA's virtual memory management (an address range
  reserved once, physical memory mapped into it in pages of the allocation
  granularity), for a strategy whose blocks never fragment;
* :class:`CheckBackend`: stream queries, events, ``memset`` and the
  verification kernels of the checking layer (docs/checks.md);
* :class:`Backend`: all of them.

Handles (``pool``, ``stream``, ``event``) are raw CUDA handles as ints, and
sizes are in bytes. Errors from CUDA are raised as the backend's ``Error``
class with ``status`` set to the ``cudaError_t`` code (the codes are
``cupy_memstrat.backends.ERROR_*``, :mod:`cupy_memstrat.backends.codes`).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

__all__ = [
    "CoreBackend",
    "DeviceBackend",
    "StreamBackend",
    "PoolBackend",
    "ManagedBackend",
    "VmmBackend",
    "CheckBackend",
    "Backend",
    "VerifyKernels",
    "PROTOCOLS",
    "members",
    "missing",
    "require",
    "BACKEND_ENV",
    "ENV_VALUES",
]


class CoreBackend(Protocol):
    """Device memory and the current device: what every strategy calls.

    A strategy made with ``backend=`` checks these members (:func:`require`).
    """

    #: exception class raised by ``malloc``/``free`` and the other calls;
    #: instances carry ``status``, the CUDA runtime error code (``cudaError_t``),
    #: e.g. ``cupy_memstrat.backends.ERROR_MEMORY_ALLOCATION``.
    Error: type[BaseException]

    def malloc(self, size: int) -> int:
        """``cudaMalloc`` on the current device; ``size`` in bytes; returns the
        device pointer (0 for 0 bytes).

        Raises:
            Error: ``status`` ``cudaErrorMemoryAllocation`` when the device has
                not ``size`` bytes free; call :meth:`clear_last_error` after it
                (CUDA leaves the failure as its sticky last error,
                docs/development.md).
        """

    def free(self, ptr: int) -> None:
        """``cudaFree``; CUDA finds the owning device from the pointer (unified
        addressing), as CuPy's own ``Memory.__dealloc__`` relies on; ``free(0)``
        does nothing. Also frees ``malloc_managed`` memory.

        Raises:
            Error: ``cudaErrorInvalidValue`` for a pointer that is not live.
        """

    def get_device(self) -> int:
        """``cudaGetDevice``: the calling thread's current device ordinal."""

    def device_count(self) -> int:
        """``cudaGetDeviceCount``: the number of devices."""

    def mem_get_info(self, device: int) -> tuple[int, int]:
        """``cudaMemGetInfo`` on ``device``: ``(free_bytes, total_bytes)``
        (the current device is put back afterwards).

        Raises:
            Error: ``cudaErrorInvalidDevice`` for a device that does not exist.
        """

    def clear_last_error(self) -> int:
        """``cudaGetLastError``: clears CUDA's sticky "last error" and returns
        it (``cudaSuccess``, 0, when there was none)."""


class DeviceBackend(Protocol):
    """What a backend says of its devices, and device-wide synchronisation."""

    #: the backend's short name: ``"cuda"`` (real) or ``"fake"`` (simulated)
    name: str

    def set_device(self, device: int) -> None:
        """``cudaSetDevice``: make ``device`` current in the calling thread
        (CUDA 12 and later: this creates its primary context).

        Raises:
            Error: ``cudaErrorInvalidDevice`` for a device that does not exist.
        """

    def device_properties(self, device: int) -> dict:
        """``cudaGetDeviceProperties`` and ``cudaDeviceGetAttribute``: a dict of
        ``name``, ``total_memory`` (bytes), ``compute_capability`` (``"9.0"``),
        ``concurrent_managed_access``, ``pageable_memory_access`` and
        ``memory_pools_supported`` (ints, CUDA's device attributes)."""

    def versions(self) -> dict:
        """``cudaDriverGetVersion`` / ``cudaRuntimeGetVersion``: ``driver`` and
        ``runtime`` as CUDA encodes them (13000 = 13.0)."""

    def context_active(self, device: int) -> bool:
        """``cuDevicePrimaryCtxGetState``: whether ``device``'s primary context
        exists in this process, asked without creating it (memory can only be
        held on a device that has one). True where the driver cannot tell."""

    def device_synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize`` on ``device`` (the current device is put
        back afterwards): waits for its queued work and orders every pending
        stream-ordered free there."""

    def process_used(self, device: int) -> int | None:
        """The device memory this process holds on ``device`` (bytes), as NVML
        counts it (``nvmlDeviceGetComputeRunningProcesses``): unlike
        :meth:`mem_get_info`, other processes on the device do not move it.
        None where it cannot be read: no NVML, NVML does not list this process
        (a container with its own process IDs), or the driver does not report
        a process's memory (some virtualised GPUs). Never raises."""


class StreamBackend(Protocol):
    """CuPy's current stream, and what is known of a stream object."""

    def current_stream(self, device: int = -1) -> Any:
        """CuPy's current stream for ``device`` (-1: the current device) in
        the calling thread (``cupy.cuda.get_current_stream``): an object with
        ``.ptr``, the ``cudaStream_t``; weak-referenceable; it destroys its
        stream when it dies."""

    def current_stream_ptr(self, device: int) -> int:
        """The handle of CuPy's current stream on ``device`` (``.ptr`` of
        :meth:`current_stream`): 0 for the legacy default stream,
        ``cupy_memstrat.backends.STREAM_PER_THREAD`` (2) for the per-thread default
        stream (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) in every thread."""

    def current_stream_ptr_capsule(self) -> Any:
        """The same as a C function ``intptr_t (int device)`` in a PyCapsule,
        for the C hot path (CuPy's own ``cupy_backends.cuda.stream.get_stream_ptr``,
        where CuPy keeps each thread's current streams, docs/streams.md), or
        None where there is none (the C path then calls
        :meth:`current_stream_ptr`)."""

    def stream_owns_handle(self, stream: Any) -> bool:
        """Whether the stream object destroys its handle when it dies (a
        ``cupy.cuda.Stream``: True); False for a wrapper of a stream someone
        else owns (``cupy.cuda.ExternalStream``, or a ``Stream.from_external``
        of CuPy 14, e.g. around a PyTorch stream), which a program may make
        afresh for the same live stream at every step."""

    def stream_destroyed(self, stream: int) -> bool:
        """True only where the backend knows the handle ``stream`` was
        destroyed. CUDA has no safe way to ask: ``cudaStreamQuery`` on a
        destroyed handle can crash the process (SIGSEGV, docs/streams.md),
        so the real backend always says False and a stream's handle must
        outlive its use, as CUDA requires."""


class PoolBackend(Protocol):
    """Stream-ordered pools (``cudaMemPool_t``), used by the ``async``
    strategy (docs/async.md); ``pool`` and ``stream`` are raw handles."""

    def pool_create(self, device: int, max_size: int = 0) -> int:
        """``cudaMemPoolCreate``: a new pool of device memory on ``device``;
        ``max_size`` bytes (0: no limit besides the device).

        Raises:
            Error: CUDA refused (``status`` set).
            RuntimeError: the real backend without ``cuda.bindings`` and a
                ``max_size`` asked for.
        """

    def pool_destroy(self, pool: int) -> None:
        """``cudaMemPoolDestroy`` (CUDA releases it once its last block is freed).

        Raises:
            Error: ``cudaErrorInvalidValue`` for a device's default pool or a
                handle that is not a live pool.
        """

    def device_default_pool(self, device: int) -> int:
        """``cudaDeviceGetDefaultMemPool``: the handle of ``device``'s default pool."""

    def device_current_pool(self, device: int) -> int:
        """``cudaDeviceGetMemPool``: the pool ``cudaMallocAsync`` uses on
        ``device`` (the default pool until ``cudaDeviceSetMemPool``)."""

    def malloc_from_pool_async(self, size: int, pool: int, stream: int) -> int:
        """``cudaMallocFromPoolAsync``: ``size`` bytes from ``pool``, ordered on
        ``stream``; 0 bytes gives the null pointer.

        Raises:
            Error: ``cudaErrorMemoryAllocation`` when the pool cannot grow
                (sticky, as for ``malloc``).
        """

    def free_async(self, ptr: int, stream: int) -> None:
        """``cudaFreeAsync``: the block goes back to its pool, ordered on ``stream``.

        Raises:
            Error: ``cudaErrorInvalidValue`` for a pointer not from a pool.
        """

    def pool_trim_to(self, pool: int, keep_bytes: int) -> None:
        """``cudaMemPoolTrimTo``: give idle memory back to the device until the
        pool reserves at most ``keep_bytes`` bytes (or what is in use)."""

    def pool_set_access(self, pool: int, devices: Any) -> None:
        """``cudaMemPoolSetAccess``: read-write access for each device in
        ``devices`` (pool memory ignores ``cudaDeviceEnablePeerAccess``).

        Raises:
            Error: ``cudaErrorInvalidDevice`` for the pool's own device or one
                that does not exist.
        """

    def device_can_access_peer(self, device: int, peer: int) -> bool:
        """``cudaDeviceCanAccessPeer``: whether ``device`` can access ``peer``'s memory."""

    def pool_get_attribute(self, pool: int, attr: int) -> int:
        """``cudaMemPoolGetAttribute``; ``attr`` is one of
        ``cupy_memstrat.backends.POOL_ATTR_*`` (bytes for each of them).

        Raises:
            Error: ``cudaErrorInvalidValue`` for an unknown ``attr``.
        """

    def pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        """``cudaMemPoolSetAttribute``; ``attr`` is one of
        ``cupy_memstrat.backends.POOL_ATTR_*``: the release threshold (bytes, up to
        ``RELEASE_THRESHOLD_MAX``), or a high-water mark reset by setting it to 0.

        Raises:
            Error: ``cudaErrorInvalidValue`` for another ``attr`` or value.
        """


class ManagedBackend(Protocol):
    """Managed memory (``cudaMallocManaged``), used by the ``managed`` strategy
    and :func:`cupy_memstrat.prefetch` / :func:`~cupy_memstrat.advise`
    (docs/managed.md); a *location* is a device ordinal or
    ``cupy_memstrat.backends.HOST`` (-1, ``cudaCpuDeviceId``)."""

    def malloc_managed(self, size: int) -> int:
        """``cudaMallocManaged(..., cudaMemAttachGlobal)``; ``size`` in bytes;
        freed with ``free``.

        Raises:
            Error: ``cudaErrorInvalidValue`` for 0 bytes (CUDA refuses them),
                ``cudaErrorMemoryAllocation`` when it cannot be had.
        """

    def memory_type(self, ptr: int) -> str:
        """``cudaPointerGetAttributes``: ``"managed"``, ``"device"``, ``"host"``
        (pinned) or ``"unregistered"``; interior pointers work."""

    def mem_advise(self, ptr: int, size: int, advice: int, location: int) -> None:
        """``cudaMemAdvise`` of ``size`` bytes at ``ptr`` with a ``cudaMemLocation``;
        ``advice`` is one of ``cupy_memstrat.backends.ADVISE_*``.

        Raises:
            Error: ``cudaErrorInvalidValue`` (a range outside a managed
                allocation, an unknown advice) or ``cudaErrorInvalidDevice``
                (a location that does not exist).
            CuPyNotInstalledError: the real backend without ``cuda.bindings``.
        """

    def mem_prefetch(self, ptr: int, size: int, location: int, stream: int) -> None:
        """``cudaMemPrefetchAsync`` of ``size`` bytes at ``ptr`` to ``location``
        on ``stream`` (a raw handle).

        Raises:
            Error: as :meth:`mem_advise`; ``cudaErrorInvalidDevice`` for a
                device location without concurrent managed access.
            CuPyNotInstalledError: the real backend without ``cuda.bindings``.
        """


class VmmBackend(Protocol):
    """CUDA's virtual memory management (driver API ``cuMem*``): reserve a range of
    addresses, create physical memory on a device, map it into the range and grant the
    device access; unmap and release. Addresses and handles are ints, sizes bytes.

    Measured on an H100 (driver 580, CUDA 13.0; docs/results/h100/vmm-facts.json): the
    granularity is 2 MiB (minimum and recommended alike); reserved ranges start on a
    32 MiB boundary or the alignment asked for; 64 TiB of addresses can be reserved at
    once, 256 TiB cannot (out of memory); memory is unusable until its access is set, and
    again after it was unmapped and mapped anew.
    """

    def vmm_granularity(self, device: int) -> int:
        """``cuMemGetAllocationGranularity`` (minimum) of pinned device memory on
        ``device``: the unit of every size and address below, in bytes."""

    def vmm_reserve(self, size: int, alignment: int = 0, hint: int = 0) -> int:
        """``cuMemAddressReserve``: ``size`` bytes of addresses (a multiple of the
        granularity), aligned to ``alignment`` (0: the driver's choice), at ``hint`` where
        that range is free. No memory is used.

        Raises:
            Error: ``cudaErrorInvalidValue`` for 0 or a size off the granularity,
                ``cudaErrorMemoryAllocation`` when the addresses cannot be had.
        """

    def vmm_free_address(self, ptr: int, size: int) -> None:
        """``cuMemAddressFree`` of a whole range :meth:`vmm_reserve` returned.

        Raises:
            Error: ``cudaErrorInvalidValue`` for a range not reserved (or freed already).
        """

    def vmm_create(self, device: int, size: int) -> int:
        """``cuMemCreate``: ``size`` bytes of physical memory on ``device`` (a multiple of
        the granularity); the device's free memory drops by ``size`` at once. Returns the
        handle.

        Raises:
            Error: ``cudaErrorInvalidValue`` for 0 or a size off the granularity,
                ``cudaErrorMemoryAllocation`` when the device lacks the memory (not
                sticky: the next call works).
        """

    def vmm_release(self, handle: int) -> None:
        """``cuMemRelease``: give the physical memory back; while it is still mapped it
        stays until :meth:`vmm_unmap`.

        Raises:
            Error: ``cudaErrorInvalidValue`` for an unknown handle.
        """

    def vmm_map(self, ptr: int, size: int, handle: int) -> None:
        """``cuMemMap`` of the whole of ``handle`` (``size`` bytes, offset 0) at ``ptr`` in a
        reserved range. The memory is not usable before :meth:`vmm_set_access`.

        Raises:
            Error: ``cudaErrorInvalidValue`` for an address off the granularity, outside
                a reserved range, a size other than the handle's, or pages mapped already.
        """

    def vmm_set_access(self, ptr: int, size: int, device: int) -> None:
        """``cuMemSetAccess``: read and write access from ``device`` to ``size`` mapped
        bytes at ``ptr`` (one call may span several mappings).

        Raises:
            Error: ``cudaErrorInvalidValue`` where part of the range is not mapped.
        """

    def vmm_unmap(self, ptr: int, size: int) -> None:
        """``cuMemUnmap`` of whole mappings (one call may span several); the range needs
        :meth:`vmm_set_access` again if it is mapped anew.

        Raises:
            Error: ``cudaErrorInvalidValue`` for a range that is not mapped or cuts a
                mapping in two.
        """


class VerifyKernels(Protocol):
    """What :meth:`CheckBackend.check_kernels` returns: the checking layer's
    verification kernel, a results buffer of ``SLOTS`` slots per device and a
    host-mapped flag word the kernel sets when it finds damage (docs/checks.md)."""

    #: result slots per device
    SLOTS: int

    def verify(self, device: int, ptr: int, start: int, end: int, pattern: int, slot: int, stream: int) -> None:
        """Queue a check of bytes ``[start, end)`` of ``ptr`` against the byte
        ``pattern`` on ``stream`` (of ``device``); the result lands in ``slot``."""

    def flagged(self) -> bool:
        """Whether a kernel has reported damage since :meth:`clear_flag`."""

    def clear_flag(self) -> None:
        """Reset the damage flag."""

    def read(self, device: int) -> dict:
        """``{slot: (bytes that differed, first differing offset)}`` for the
        slots of ``device`` that found damage; those slots are reset.
        Synchronise the device first: this reads what has finished."""


class CheckBackend(Protocol):
    """The checking layer (:mod:`cupy_memstrat.checks`, docs/checks.md):
    queued work, events and contents; ``stream`` and ``event`` are raw handles."""

    def stream_busy(self, stream: int) -> bool:
        """``cudaStreamQuery``: True while ``stream`` has work queued that has
        not finished. ``cudaErrorNotReady`` is not an error and is not left as
        CUDA's last error; any other status (a destroyed handle) counts as idle."""

    def stream_non_blocking(self, stream: int) -> bool:
        """``cudaStreamGetFlags``: whether ``stream`` was created with
        ``cudaStreamNonBlocking`` (it does not synchronise with the legacy
        default stream); False for the default streams."""

    def event_create(self) -> int:
        """``cudaEventCreateWithFlags(cudaEventDisableTiming)`` on the current
        device: an event without timing."""

    def event_record(self, event: int, stream: int) -> None:
        """``cudaEventRecord`` of ``event`` on ``stream``.

        Raises:
            Error: ``cudaErrorInvalidResourceHandle`` for an unknown event or a
                destroyed stream (the fake; real CUDA: undefined behaviour).
        """

    def event_done(self, event: int) -> bool:
        """``cudaEventQuery``: True once the work queued before the record has
        finished (also for an event never recorded)."""

    def event_destroy(self, event: int) -> None:
        """``cudaEventDestroy``."""

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """``cudaMemsetAsync``: ``nbytes`` bytes at ``ptr`` set to the byte
        ``value``, on ``stream``."""

    def check_kernels(self) -> VerifyKernels:
        """The checking layer's verification kernel and its result slots
        (:class:`VerifyKernels`; compiled on first use on a real device)."""


class Backend(CoreBackend, DeviceBackend, StreamBackend, PoolBackend, ManagedBackend, VmmBackend, CheckBackend,
              Protocol):
    """Every capability: what :class:`cupy_memstrat.backends.RealBackend` and
    :class:`cupy_memstrat.testing.FakeBackend` implement."""


#: the capability protocols, in the order of this module
PROTOCOLS = (CoreBackend, DeviceBackend, StreamBackend, PoolBackend, ManagedBackend, VmmBackend, CheckBackend)

_NOT_MEMBERS = frozenset(vars(Protocol)) | {"__annotations__", "__dict__", "__weakref__", "__module__", "__doc__"}


def members(protocol: type) -> tuple[str, ...]:
    """The member names of ``protocol`` (methods and declared attributes, its
    bases' included), in the order they are defined."""
    names: list[str] = []
    for cls in protocol.__mro__:
        if cls is Protocol or cls is object or Protocol not in cls.__mro__ or cls.__name__ == "Generic":
            continue
        for name in list(inspect.get_annotations(cls)) + list(vars(cls)):
            if not name.startswith("_") and name not in _NOT_MEMBERS and name not in names:
                names.append(name)
    return tuple(names)


def missing(backend: Any, protocol: type = CoreBackend) -> list[str]:
    """The members of ``protocol`` that ``backend`` lacks (an empty list when
    it has them all)."""
    return [name for name in members(protocol) if not hasattr(backend, name)]


def require(backend: Any, protocol: type = CoreBackend) -> None:
    """Refuse ``backend`` unless it is an object (not a class) with every
    member of ``protocol``.

    Raises:
        TypeError: ``backend`` is a class, or lacks members; the message names
            the protocol and the missing members.
    """
    lacks = missing(backend, protocol)
    if isinstance(backend, type) or lacks:
        why = (
            f"it lacks {', '.join(lacks)} of cupy_memstrat.backends.{protocol.__name__}"
            if lacks
            else "pass an instance, not the class"
        )
        raise TypeError(
            "backend: expected a CUDA backend object such as cupy_memstrat.testing.FakeBackend() "
            f"(with {', '.join(members(protocol))}), got {type(backend).__name__} {backend!r}: {why}"
        )


#: the environment variable that chooses a process's backend (:func:`cupy_memstrat.backends.from_env`)
BACKEND_ENV = "CUPY_MEMSTRAT_BACKEND"
#: the values ``CUPY_MEMSTRAT_BACKEND`` takes, for error messages
ENV_VALUES = "'cuda' (the default), 'fake' or 'fake:devices=N,memory=SIZE[/SIZE...],name=NAME,nvml=on|off'"
