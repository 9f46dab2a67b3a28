"""A fake CUDA backend for machines without a GPU.

:class:`FakeBackend` simulates the CUDA behaviour that cupy_memstrat relies on,
as measured on the H200 machine (docs/claims.md, docs/async.md, docs/managed.md) or
documented by CUDA.
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
  ``clear_last_error()`` (measured on the H200: a sticky OOM error).
* ``free`` of an unknown or already-freed pointer fails with
  ``cudaErrorInvalidValue`` (and sets the last error); ``free(0)`` is a no-op.
* ``free`` finds the owning device from the pointer, whatever device is current.
  It does not complete the device's queued work (real ``cudaFree`` waits for
  the device; the checking layer's tests rely on work staying queued).

Streams (CuPy's current stream, per thread and device):

* :meth:`FakeBackend.stream` makes a stream; ``with s:`` makes it current;
  ``s.destroy()`` (or the stream object dying, as CuPy's ``Stream`` does)
  destroys its handle. Each device has a null stream (handle 0).
* The next new stream of that device gets a destroyed stream's handle back
  (latest destroyed first), even while the destroyed stream's work is still
  queued, and is not ordered after that work (measured on the H200; CUDA does
  not always reuse, the fake always does). :meth:`FakeBackend.busy_destroyed_streams`
  counts destroyed streams whose work is not done.
* Work on a destroyed handle not yet given back fails with
  ``cudaErrorInvalidResourceHandle`` (real CUDA gives undefined behaviour: the
  fake makes it visible).

Stream-ordered pools (``cudaMallocFromPoolAsync`` path, docs/async.md):

* Each device has a default pool (also its current pool until
  :meth:`FakeBackend.device_set_pool`); :meth:`FakeBackend.pool_create` makes
  more. A pool reserves device memory in 32 MiB steps (1 B -> 32 MiB,
  40 MiB + 7 B -> 64 MiB) and ``max_size`` acts as rounded up to 32 MiB.
* A 0-byte request gives the null pointer; a failed one sets the sticky
  last error, as ``cudaMalloc`` does.
* A block freed with ``free_async`` is reused at once by the same stream; by
  other streams only after a synchronisation (``stream_synchronize`` /
  ``device_synchronize``) has ordered the free before them.
* At each synchronisation a pool releases idle memory down to its release
  threshold (CUDA's default threshold is 0: everything idle goes back);
  ``pool_trim_to`` releases idle, synchronised memory down to a floor.
* Attributes: release threshold, reserved and used current/high; a high can
  be reset by setting it to 0.

Managed memory (``cudaMallocManaged`` path, docs/managed.md):

* ``malloc_managed`` returns 2 MiB-aligned pointers (as measured on the H200)
  and takes no device memory until pages are populated there.
* Residency is kept per 64 KiB page: unpopulated, host, or a device.
  :meth:`FakeBackend.touch` simulates a processor accessing a range: a GPU
  touch of host-resident pages counts one GPU fault and 64 KiB host-to-device
  per page (the real driver services several faults per page: 84k-95k per
  GiB; the fake counts the 16 384 migrations); a CPU touch of device pages
  counts one CPU fault and 64 KiB device-to-host per page. Unpopulated pages
  are populated where they are first touched, with a fault and no transfer.
* ``mem_prefetch`` moves pages without faults, counting the bytes moved;
  prefetching unpopulated pages populates them at the destination.
* Device-resident managed pages count as used device memory
  (``mem_get_info``); when a device is full, other managed pages are evicted
  to the host, as the driver does.
* ``mem_advise`` validates its arguments and records the advice per range
  (:meth:`FakeBackend.advice`); it does not change the fault simulation
  (docs/claims.md: a preferred location alone does not avoid faults).
* :meth:`FakeBackend.uvm_counters` gives the cumulative counters that the
  driver's ``/dev/nvidia-uvm-tools`` interface reports.

Work, events and contents (the checking layer, :mod:`cupy_memstrat.checks`):

* :meth:`FakeBackend.launch` queues simulated work on a stream, which stays
  busy (``stream_busy``) until :meth:`FakeBackend.finish` or a
  synchronisation; an event recorded on a stream is done once the work
  queued before it has finished. Streams may be non-blocking.
* ``memset_async`` and :meth:`FakeBackend.write` set bytes of a contents
  model; the check kernels compare byte ranges with it. Bytes never written
  are unknown and match nothing.

What it does not simulate: the contents of memory other than through
``memset_async`` / ``write``, the driver's page-size rounding of
large ``cudaMalloc`` calls (not measured; the fake rounds to 256 bytes), and
how a pool splits and coalesces its blocks: it reuses same-size blocks at
once, and merges all idle blocks into free space only when it cannot grow
(on the H200 a pool served a request from idle blocks of another size;
tests/gpu/test_async_gpu.py).
"""

from __future__ import annotations

import threading

from . import cuda as _cuda
from .sizes import parse_size

__all__ = ["FakeBackend", "FakeCUDAError", "FakeStream"]

_ALIGN = 256
_POOL_GRANULE = 32 << 20  # a pool reserves device memory in 32 MiB steps (docs/claims.md)
_UINT64_MAX = (1 << 64) - 1


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
_DEVICE_STRIDE = 1 << 40  # each fake device's addresses live in their own TiB
_MANAGED_BASE = 1 << 46  # managed memory lives in its own range, 2 MiB aligned
_MANAGED_ALIGN = 2 << 20
_PAGE = 64 << 10  # the driver migrates managed memory in 64 KiB pages (docs/claims.md)
_UNPOPULATED, _HOST_RES = -2, -1  # page residency codes; >= 0: a device


class _Managed:
    __slots__ = ("ptr", "size", "pages", "advice")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size = ptr, size
        self.pages = [_UNPOPULATED] * (-(-size // _PAGE))
        self.advice: list[tuple[int, int, int, int]] = []  # (offset, size, advice, location)


class FakeCUDAError(RuntimeError):
    """A simulated CUDA runtime error; ``status`` is the ``cudaError_t`` code."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"{_cuda.error_name(status)} (simulated by FakeBackend)")


class FakeStream:
    """A simulated CUDA stream, standing in for ``cupy.cuda.Stream``: ``ptr``
    (the handle), ``device_id``; ``with s:`` makes it the current stream of
    its device in this thread; destroyed by :meth:`destroy` or when it dies."""

    owns_handle = True  # destroys its handle when it dies (cupy.cuda.Stream)

    def __init__(self, backend: "FakeBackend", device: int, ptr: int, non_blocking: bool = False):
        self._backend = backend
        self.device_id = device
        self.ptr = ptr
        self.non_blocking = non_blocking
        self._destroyed = False

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """``cudaStreamDestroy`` (the default streams, handles 0-2, cannot be destroyed)."""
        b = self._backend
        if self.ptr > 2 and self.ptr not in b._destroyed_streams and not self._destroyed:
            self._destroyed = True
            b._destroyed_streams.add(self.ptr)
            b._destroyed_order.append(self.ptr)

    def synchronize(self) -> None:
        self._backend.stream_synchronize(self.ptr)

    def __enter__(self):
        self._backend._stream_stack(self.device_id).append(self)
        return self

    def __exit__(self, *exc):
        self._backend._stream_stack(self.device_id).pop()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"<FakeStream 0x{self.ptr:x} on device {self.device_id}>"


class _FakeExternalStream(FakeStream):
    """:meth:`FakeBackend.external_stream`: a stream someone else owns."""

    owns_handle = False

    def destroy(self) -> None:
        pass


class _FakePool:
    def __init__(self, handle: int, device: int, max_size: int, is_default: bool):
        self.handle, self.device, self.is_default = handle, device, is_default
        self.max_size = _round_up(max_size, _POOL_GRANULE) if max_size else 0
        self.release_threshold = 0  # CUDA's default for every pool
        self.reserved = self.used = self.idle = 0
        self.reserved_high = self.used_high = 0
        self.free: list[list] = []  # [ptr, size, tag]; tag None once a sync ordered the free
        self.live: dict[int, int] = {}  # ptr -> rounded size
        self.access: set[int] = set()  # peer devices granted access (cudaMemPoolSetAccess)
        self.destroyed = False


#: the most simulated devices (a node has 16 GPUs at most today; each costs tables per device)
MAX_DEVICES = 64


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
    ):
        if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES:
            raise ValueError(f"devices: expected an int from 1 to {MAX_DEVICES}, got {devices!r}")
        mems = memory if isinstance(memory, (list, tuple)) else [memory] * devices
        if len(mems) != devices:
            raise ValueError(f"memory: expected {devices} values (one per device), got {len(mems)}")
        self._capacity = [parse_size(m, what="memory") for m in mems]
        self._used = [0] * devices
        self._next = [(d + 1) * _DEVICE_STRIDE for d in range(devices)]
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (size, device)
        self._lock = threading.Lock()
        self._local = threading.local()  # the current device is per thread, as in CUDA
        # Devices with a primary context: made by cudaSetDevice (CUDA 12+) or
        # the first allocation on the current device, as in CUDA.
        self._contexts: set[int] = set()
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
        # streams and pools
        self._null_streams = [FakeStream(self, d, 0) for d in range(devices)]
        # CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: CuPy's default stream is then
        # cudaStreamPerThread, handle 2 in every thread, one stream per thread
        self.per_thread_default_stream = bool(per_thread_default_stream)
        self._ptds = [FakeStream(self, d, _cuda.STREAM_PER_THREAD) for d in range(devices)]
        self._destroyed_streams: set[int] = set()
        self._destroyed_order: list[int] = []  # handles a new stream may get back (see stream())
        self._n_ghosts = 0
        self._stream_device: dict[int, int] = {}
        self._next_handle = 0x1000
        self._pools: dict[int, _FakePool] = {}
        self._default_pool = [self._new_pool(d, 0, is_default=True).handle for d in range(devices)]
        self._current_pool = list(self._default_pool)
        self.n_device_synchronize_calls = 0
        self._stream_flags: dict[int, int] = {}
        self._submitted: dict = {}
        self._completed: dict = {}
        self._events: dict[int, object] = {}
        self._contents = _Contents()
        self._check_kernels = None
        # managed memory
        self._managed: dict[int, _Managed] = {}
        self._next_managed = _MANAGED_BASE
        self._counters = dict(bytes_htod=0, bytes_dtoh=0, cpu_faults=0, gpu_faults=0)
        self.n_prefetch_calls = 0
        self.n_advise_calls = 0

    # -- errors ---------------------------------------------------------------
    def _fail(self, status: int):
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
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
        self._contexts.add(device)

    def context_active(self, device: int) -> bool:
        """Whether ``device`` has a primary context (``cuDevicePrimaryCtxGetState``):
        once it was made current or allocated on."""
        return device in self._contexts

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
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if size < 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        if size == 0:
            return 0
        device = self.get_device()
        self._contexts.add(device)
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
            m = self._managed.pop(ptr, None)
            if m is not None:
                for loc in m.pages:
                    if loc >= 0:
                        self._used[loc] -= _PAGE
                return
            entry = self._live.pop(ptr, None)
            if entry is None:
                self._fail(_cuda.ERROR_INVALID_VALUE)
            rounded, device = entry
            for p in self._pools.values():  # cudaFree of a pool block: synchronous, back to its pool
                if p.live.pop(ptr, None) is not None:
                    p.used -= rounded
                    p.free.append([ptr, rounded, None])
                    p.idle += rounded
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

    def _synchronized(self, device: int, key) -> None:
        # A sync ordered the frees queued on stream `key` (None: every stream)
        # of `device`: any stream may reuse those blocks now, and the pools
        # give idle memory back down to their release thresholds.
        for pool in self._pools.values():
            if pool.device == device:
                for block in pool.free:
                    if key is None or block[2] == key:
                        block[2] = None
                self._apply_threshold(pool)

    # -- streams --------------------------------------------------------------
    def stream(self, device: int | None = None, non_blocking: bool = False) -> FakeStream:
        """A new stream on ``device`` (default: the current device);
        ``non_blocking``: created with ``cudaStreamNonBlocking`` (no implicit
        ordering with the legacy default stream)."""
        device = self.get_device() if device is None else device
        if not 0 <= device < len(self._capacity):
            self._fail(_cuda.ERROR_INVALID_DEVICE)
        with self._lock:
            handle = self._reusable_handle(device)
            if not handle:
                self._next_handle += 0x100
                handle = self._next_handle
            self._stream_device[handle] = device
            self._stream_flags[handle] = 1 if non_blocking else 0
            return FakeStream(self, device, handle, non_blocking)

    def _reusable_handle(self, device: int) -> int:
        # CUDA may give a new stream the handle of a destroyed one at once,
        # while the destroyed stream's queued work still runs, and the new
        # stream's work is not ordered after it (measured on the H200:
        # tools/probes/dead_stream_trace.py). The fake always does so, latest
        # destroyed first; the old work stays queued under a key of its own
        # until a synchronisation or finish() completes it.
        for handle in reversed(self._destroyed_order):
            if self._stream_device.get(handle) == device:
                self._destroyed_order.remove(handle)
                self._destroyed_streams.discard(handle)
                done = self._completed.pop(handle, 0)
                left = self._submitted.pop(handle, 0) - done
                ghost = None
                if left > 0:
                    self._n_ghosts += 1
                    ghost = (device, "destroyed", self._n_ghosts)
                    self._submitted[ghost] = left
                for ev, rec in list(self._events.items()):  # events recorded on the old stream stay its own
                    if rec is not None and rec[0] == handle:
                        self._events[ev] = None if ghost is None or rec[1] <= done else (ghost, rec[1] - done)
                return handle
        return 0

    def busy_destroyed_streams(self, device: int | None = None) -> int:
        """How many destroyed streams still have queued work (their handles
        given to new streams or not): a block of theirs handed to another
        stream now could still be written by that work."""
        with self._lock:
            n = 0
            for key, sub in self._submitted.items():
                if self._completed.get(key, 0) >= sub:
                    continue
                if isinstance(key, tuple):
                    n += len(key) == 3 and key[1] == "destroyed" and (device is None or key[0] == device)
                elif key in self._destroyed_streams and (device is None or self._stream_device.get(key) == device):
                    n += 1
            return n

    # -- work on streams (the checking layer) ------------------------------------
    # A stream's queue is a count of items submitted and completed; nothing
    # completes until the test says so (finish) or a synchronisation does.
    def _work_key(self, stream: int):
        if stream == _cuda.STREAM_PER_THREAD:  # one stream per thread behind the one handle
            return (self.get_device(), 2, threading.get_ident())
        return (self.get_device(), 0) if stream <= 2 else stream

    def launch(self, stream, writes=()) -> None:
        """Simulate a kernel queued on ``stream`` (an object with ``.ptr`` or a
        handle): the stream is busy until :meth:`finish` or a synchronisation.
        ``writes``: ``(address, bytes)`` pairs the kernel writes, applied at
        once (the contents model does not order them)."""
        handle = getattr(stream, "ptr", stream)
        key = self._work_key(handle)
        with self._lock:
            self._submitted[key] = self._submitted.get(key, 0) + 1
        for addr, data in writes:
            self.write(addr, data)

    def finish(self, stream=None) -> None:
        """Complete the queued work of ``stream`` (default: every stream)."""
        with self._lock:
            if stream is None:
                self._completed.update(self._submitted)
            else:
                key = self._work_key(getattr(stream, "ptr", stream))
                self._completed[key] = self._submitted.get(key, 0)

    def stream_busy(self, stream: int) -> bool:
        """``cudaStreamQuery``: True while :meth:`launch` work is unfinished."""
        key = self._work_key(stream)
        return self._completed.get(key, 0) < self._submitted.get(key, 0)

    def stream_non_blocking(self, stream: int) -> bool:
        return bool(self._stream_flags.get(stream, 0))

    def stream_destroyed(self, stream: int) -> bool:
        """Whether ``stream`` was destroyed (real CUDA cannot say safely)."""
        return stream in self._destroyed_streams

    def event_create(self) -> int:
        with self._lock:
            self._next_handle += 0x100
            self._events[self._next_handle] = None
            return self._next_handle

    def event_record(self, event: int, stream: int) -> None:
        key = self._stream_key(stream)  # a destroyed stream fails
        with self._lock:
            if event not in self._events:
                self._fail(_cuda.ERROR_INVALID_RESOURCE_HANDLE)
            self._events[event] = (key, self._submitted.get(key, 0))

    def event_done(self, event: int) -> bool:
        rec = self._events.get(event)
        if rec is None:
            return True
        key, ticket = rec
        return self._completed.get(key, 0) >= ticket

    def event_destroy(self, event: int) -> None:
        with self._lock:
            self._events.pop(event, None)

    # -- memory contents (the checking layer) ------------------------------------------
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """``cudaMemsetAsync``: applied at once in the contents model."""
        self._stream_key(stream)  # a destroyed stream fails
        if nbytes:
            self._contents.set(ptr, ptr + nbytes, value & 0xFF)

    def write(self, ptr: int, data: bytes) -> None:
        """Simulate a kernel (or copy) writing ``data`` at address ``ptr``."""
        for i, b in enumerate(bytes(data)):
            self._contents.set(ptr + i, ptr + i + 1, b)

    def read(self, ptr: int, nbytes: int) -> list:
        """The simulated bytes at ``ptr`` (None where nothing was written)."""
        return [self._contents.get(ptr + i) for i in range(nbytes)]

    def check_kernels(self) -> "_FakeCheckKernels":
        if self._check_kernels is None:
            self._check_kernels = _FakeCheckKernels(self)
        return self._check_kernels

    def _stream_stack(self, device: int) -> list:
        stacks = getattr(self._local, "streams", None)
        if stacks is None:
            stacks = self._local.streams = [[] for _ in self._capacity]
        return stacks[device]

    def null_stream(self, device: int | None = None) -> FakeStream:
        """The legacy default stream of ``device`` (``cupy.cuda.Stream.null``);
        ``with fake.null_stream():`` makes it current, as code that hard-codes
        it does."""
        return self._null_streams[self.get_device() if device is None else device]

    def current_stream(self, device: int = -1) -> FakeStream:
        """The calling thread's current stream on ``device`` (CuPy's
        ``get_current_stream``): the innermost ``with`` stream, else the null stream."""
        if device == -1:
            device = self.get_device()
        stack = self._stream_stack(device)
        if stack:
            return stack[-1]
        return (self._ptds if self.per_thread_default_stream else self._null_streams)[device]

    def current_stream_ptr(self, device: int) -> int:
        """The handle of the calling thread's current stream on ``device``."""
        return self.current_stream(device).ptr

    def external_stream(self, stream) -> "FakeStream":
        """A wrapper of ``stream`` (an object with ``.ptr``) that does not own
        it, as ``cupy.cuda.ExternalStream`` wraps a stream someone else made:
        ``with`` makes it current; it destroys nothing when it dies."""
        return _FakeExternalStream(self, stream.device_id, stream.ptr, getattr(stream, "non_blocking", False))

    def stream_owns_handle(self, stream) -> bool:
        """Whether ``stream`` destroys its handle when it dies."""
        return bool(getattr(stream, "owns_handle", True))

    def current_stream_ptr_capsule(self):
        """None: the fake has no C function for :meth:`current_stream_ptr`."""
        return None

    def _stream_key(self, stream: int):
        if stream in self._destroyed_streams:
            self._fail(_cuda.ERROR_INVALID_RESOURCE_HANDLE)
        # handles 0-2 (legacy / per-thread default) mean the current device's;
        # cudaStreamPerThread (2) is the calling thread's own stream
        return self._work_key(stream)

    def stream_synchronize(self, stream: int) -> None:
        """``cudaStreamSynchronize``: orders the frees queued on ``stream``
        and applies the release thresholds of its device's pools."""
        with self._lock:
            key = self._stream_key(stream)
            self._synchronized(key[0] if isinstance(key, tuple) else self._stream_device[key], key)
            self._completed[key] = self._submitted.get(key, 0)

    # -- stream-ordered pools -----------------------------------------------
    def _new_pool(self, device: int, max_size: int, is_default: bool = False) -> _FakePool:
        self._next_handle += 0x100
        pool = _FakePool(self._next_handle, device, max_size, is_default)
        self._pools[pool.handle] = pool
        return pool

    def _pool(self, handle: int) -> _FakePool:
        pool = self._pools.get(handle)
        if pool is None or pool.destroyed:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        return pool

    def pool_create(self, device: int, max_size: int = 0) -> int:
        if not 0 <= device < len(self._capacity):
            self._fail(_cuda.ERROR_INVALID_DEVICE)
        if max_size < 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        self._contexts.add(device)
        with self._lock:
            return self._new_pool(device, max_size).handle

    def pool_destroy(self, pool: int) -> None:
        with self._lock:
            p = self._pool(pool)
            if p.is_default:
                self._fail(_cuda.ERROR_INVALID_VALUE)
            p.destroyed = True
            if not p.live:  # else CUDA releases it once the last block is freed
                self._release_pool(p)

    def _release_pool(self, p: _FakePool) -> None:
        self._used[p.device] -= p.reserved
        p.reserved = p.idle = 0
        p.free.clear()

    def device_can_access_peer(self, device: int, peer: int) -> bool:
        return device != peer and 0 <= peer < len(self._capacity)

    def pool_set_access(self, pool: int, devices) -> None:
        p = self._pool(pool)
        for d in devices:
            if d == p.device or not 0 <= d < len(self._capacity):
                self._fail(_cuda.ERROR_INVALID_DEVICE)
        p.access.update(devices)

    def pool_access(self, pool: int) -> set:
        """Devices other than its own that may use the pool's memory (for tests)."""
        return set(self._pool(pool).access)

    def device_default_pool(self, device: int) -> int:
        return self._default_pool[device]

    def device_current_pool(self, device: int) -> int:
        return self._current_pool[device]

    def device_set_pool(self, device: int, pool: int) -> None:
        """``cudaDeviceSetMemPool`` (what CuPy's ``MemoryAsyncPool()`` does to every device)."""
        self._pool(pool)
        self._current_pool[device] = pool

    def malloc_from_pool_async(self, size: int, pool: int, stream: int) -> int:
        if size < 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        with self._lock:
            p = self._pool(pool)
            key = self._stream_key(stream)
            if size == 0:
                return 0
            self.n_malloc_calls += 1
            rounded = _round_up(size, _ALIGN)
            ptr = self._reuse(p, rounded, key)
            if ptr is None:
                if not self._make_room(p, rounded):
                    self._fail(_cuda.ERROR_MEMORY_ALLOCATION)
                ptr = self._next[p.device]
                self._next[p.device] += rounded
            p.used += rounded
            p.used_high = max(p.used_high, p.used)
            p.live[ptr] = rounded
            self._live[ptr] = (rounded, p.device)
            return ptr

    @staticmethod
    def _reuse(p: _FakePool, rounded: int, key):
        for i, (ptr, size, tag) in enumerate(p.free):
            if size == rounded and tag in (None, key):
                del p.free[i]
                p.idle -= size
                return ptr
        return None

    def _make_room(self, p: _FakePool, rounded: int) -> bool:
        for attempt in range(2):
            slack = p.reserved - p.used - p.idle
            if slack >= rounded:
                return True
            grow = _round_up(rounded - slack, _POOL_GRANULE)
            fits_pool = not p.max_size or p.reserved + grow <= p.max_size
            if fits_pool and self._used[p.device] + grow <= self._capacity[p.device]:
                p.reserved += grow
                p.reserved_high = max(p.reserved_high, p.reserved)
                self._used[p.device] += grow
                return True
            # Measured on the H200: a pool serves a request it cannot grow for
            # from its idle blocks of any size (2 GiB idle + 0.5 GiB new made a
            # 2.5 GiB block), also blocks freed on other streams.
            p.free.clear()
            p.idle = 0
        return False

    def _shrink(self, p: _FakePool, floor: int) -> None:
        # Release idle memory (blocks whose free a sync has ordered) until
        # reserved <= max(floor, what is in use or still pending), in 32 MiB steps.
        pending = sum(b[1] for b in p.free if b[2] is not None)
        target = max(_round_up(p.used + pending, _POOL_GRANULE), _round_up(min(floor, p.reserved), _POOL_GRANULE))
        if target >= p.reserved:
            return
        if target < p.used + p.idle:
            p.free[:] = [b for b in p.free if b[2] is not None]
            p.idle = pending
        self._used[p.device] -= p.reserved - target
        p.reserved = target

    def _apply_threshold(self, p: _FakePool) -> None:
        if p.reserved > p.release_threshold:
            self._shrink(p, p.release_threshold)

    def free_async(self, ptr: int, stream: int) -> None:
        if ptr == 0:
            return
        with self._lock:
            key = self._stream_key(stream)
            self.n_free_calls += 1
            for p in self._pools.values():
                size = p.live.pop(ptr, None)
                if size is not None:
                    break
            else:
                self._fail(_cuda.ERROR_INVALID_VALUE)
            del self._live[ptr]
            p.used -= size
            p.free.append([ptr, size, key])
            p.idle += size
            if p.destroyed and not p.live:
                self._release_pool(p)

    def pool_trim_to(self, pool: int, keep_bytes: int) -> None:
        with self._lock:
            self._shrink(self._pool(pool), keep_bytes)

    def pool_get_attribute(self, pool: int, attr: int) -> int:
        p = self._pool(pool)
        try:
            name = _POOL_ATTRS[attr]
        except KeyError:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        return getattr(p, name)

    def pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        p = self._pool(pool)
        if not 0 <= value <= _UINT64_MAX:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        if attr == _cuda.POOL_ATTR_RELEASE_THRESHOLD:
            p.release_threshold = value
        elif attr in (_cuda.POOL_ATTR_RESERVED_MEM_HIGH, _cuda.POOL_ATTR_USED_MEM_HIGH) and value == 0:
            if attr == _cuda.POOL_ATTR_RESERVED_MEM_HIGH:
                p.reserved_high = p.reserved
            else:
                p.used_high = p.used
        else:
            self._fail(_cuda.ERROR_INVALID_VALUE)

    # -- managed memory ----------------------------------------------------------
    def malloc_managed(self, size: int) -> int:
        """``cudaMallocManaged``: 2 MiB-aligned; no device memory until populated."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if size < 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)
        if size == 0:
            self._fail(_cuda.ERROR_INVALID_VALUE)  # CUDA refuses a 0-byte managed allocation
        self._contexts.add(self.get_device())
        with self._lock:
            self.n_malloc_calls += 1
            if size > sum(self._capacity) * 4:  # beyond any host + device memory
                self._fail(_cuda.ERROR_MEMORY_ALLOCATION)
            ptr = self._next_managed
            self._next_managed += _round_up(size, _MANAGED_ALIGN)
            self._managed[ptr] = _Managed(ptr, size)
            return ptr

    def _managed_range(self, ptr: int, size: int) -> tuple[_Managed, int, int]:
        # (allocation, first page, end page) of [ptr, ptr + size) inside one managed allocation
        for m in self._managed.values():
            if m.ptr <= ptr < m.ptr + m.size:
                if size < 0 or ptr + size > m.ptr + m.size:
                    break
                off = ptr - m.ptr
                return m, off // _PAGE, -(-(off + size) // _PAGE)
        self._fail(_cuda.ERROR_INVALID_VALUE)

    def _check_location(self, location: int) -> None:
        if type(location) is not int or not (location == _cuda.HOST or 0 <= location < len(self._capacity)):
            self._fail(_cuda.ERROR_INVALID_DEVICE)

    def memory_type(self, ptr: int) -> str:
        """``cudaPointerGetAttributes(ptr).type`` as a name."""
        with self._lock:
            for m in self._managed.values():
                if m.ptr <= ptr < m.ptr + m.size:
                    return "managed"
            for p, (size, _d) in self._live.items():
                if p <= ptr < p + size:
                    return "device"
        return "unregistered"

    def _move(self, m: _Managed, page: int, to: int, fault: bool) -> None:
        # one 64 KiB page of m to location `to` (a device or _HOST_RES)
        src = m.pages[page]
        if src == to:
            return
        if to >= 0:
            self._make_device_room(to, m, page)
            self._used[to] += _PAGE
        if src >= 0:
            self._used[src] -= _PAGE
        c = self._counters
        if to >= 0:
            if fault:
                c["gpu_faults"] += 1
            if src == _HOST_RES:
                c["bytes_htod"] += _PAGE
        else:
            if fault:
                c["cpu_faults"] += 1
            if src >= 0:
                c["bytes_dtoh"] += _PAGE
        m.pages[page] = to

    def _make_device_room(self, device: int, keep: _Managed, keep_page: int) -> None:
        # The driver evicts other managed pages to the host when a device is full.
        if self._used[device] + _PAGE <= self._capacity[device]:
            return
        for m in self._managed.values():
            for i, loc in enumerate(m.pages):
                if loc == device and not (m is keep and i == keep_page):
                    m.pages[i] = _HOST_RES
                    self._used[device] -= _PAGE
                    self._counters["bytes_dtoh"] += _PAGE
                    if self._used[device] + _PAGE <= self._capacity[device]:
                        return
        self._fail(_cuda.ERROR_MEMORY_ALLOCATION)

    def touch(self, ptr: int, size: int, processor="device") -> None:
        """Simulate ``processor`` (a device ordinal, ``"device"`` for the
        current one, or ``"host"``) reading and writing ``[ptr, ptr + size)``
        of managed memory: pages that are elsewhere fault and migrate."""
        to = _HOST_RES if processor == "host" else (self.get_device() if processor == "device" else processor)
        if to != _HOST_RES:
            self._check_location(to)
        with self._lock:
            m, first, end = self._managed_range(ptr, size)
            for page in range(first, end):
                if m.pages[page] != to:
                    self._move(m, page, to, fault=True)

    def mem_prefetch(self, ptr: int, size: int, location: int, stream: int) -> None:
        """``cudaMemPrefetchAsync``: pages move to ``location`` with no faults."""
        self._check_location(location)
        with self._lock:
            self._stream_key(stream)
            self.n_prefetch_calls += 1
            m, first, end = self._managed_range(ptr, size)
            to = _HOST_RES if location == _cuda.HOST else location
            if to >= 0 and not self._props["concurrent_managed_access"]:
                self._fail(_cuda.ERROR_INVALID_DEVICE)
            for page in range(first, end):
                self._move(m, page, to, fault=False)

    def mem_advise(self, ptr: int, size: int, advice: int, location: int) -> None:
        """``cudaMemAdvise``: checked and recorded (see :meth:`advice`)."""
        if advice not in range(1, 7):
            self._fail(_cuda.ERROR_INVALID_VALUE)
        self._check_location(location)
        with self._lock:
            self.n_advise_calls += 1
            m, _first, _end = self._managed_range(ptr, size)
            m.advice.append((ptr - m.ptr, size, advice, location))

    def advice(self, ptr: int) -> list[tuple[int, int, int]]:
        """Advice given for the managed allocation that holds ``ptr``:
        ``(size, advice, location)`` for each call on a range starting at ``ptr``."""
        m, _f, _e = self._managed_range(ptr, 1)
        return [(sz, adv, loc) for off, sz, adv, loc in m.advice if m.ptr + off == ptr]

    def residency(self, ptr: int, size: int) -> dict:
        """Bytes of ``[ptr, ptr + size)`` by location: ``"host"``, a device
        ordinal, or ``None`` (not populated), in 64 KiB pages (for tests)."""
        with self._lock:
            m, first, end = self._managed_range(ptr, size)
            out: dict = {}
            for loc in m.pages[first:end]:
                key = None if loc == _UNPOPULATED else ("host" if loc == _HOST_RES else loc)
                out[key] = out.get(key, 0) + _PAGE
            return out

    def uvm_counters(self) -> dict:
        """Cumulative migration counters, as the driver's counters report them:
        ``bytes_htod``, ``bytes_dtoh``, ``cpu_faults``, ``gpu_faults``."""
        with self._lock:
            return dict(self._counters)

    # -- inspection, for tests ------------------------------------------------
    def is_allocated(self, ptr: int) -> bool:
        """Whether ``ptr`` is a live allocation of this fake."""
        return ptr in self._live or ptr in self._managed

    def used_bytes(self, device: int = 0) -> int:
        """Bytes the fake device has handed out (256-byte rounded)."""
        return self._used[device]

    def owner_device(self, ptr: int) -> int:
        """Device that holds ``ptr``; KeyError if it is not live."""
        return self._live[ptr][1]


class _Contents:
    """Simulated memory contents: sorted, disjoint byte runs ``[start, end)``
    with one value each; bytes never written are unknown (None)."""

    def __init__(self):
        self._starts: list[int] = []
        self._runs: list[list] = []  # [start, end, value], sorted by start
        self._lock = threading.RLock()

    def set(self, start: int, end: int, value: int) -> None:
        with self._lock:
            self._set(start, end, value)

    def _set(self, start: int, end: int, value: int) -> None:
        import bisect

        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._runs[i][1] <= start:
            i += 1
        new = []
        j = i
        while j < len(self._runs) and self._runs[j][0] < end:
            r = self._runs[j]
            if r[0] < start:
                new.append([r[0], start, r[2]])
            if r[1] > end:
                new.append([end, r[1], r[2]])
            j += 1
        new.append([start, end, value])
        new.sort()
        self._runs[i:j] = new
        self._starts[i:j] = [r[0] for r in new]

    def get(self, addr: int):
        with self._lock:
            return self._get(addr)

    def _get(self, addr: int):
        import bisect

        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._runs[i][1]:
            return self._runs[i][2]
        return None

    def mismatches(self, start: int, end: int, value: int) -> tuple[int, int]:
        """(bytes in [start, end) that are not ``value``, first such address or -1)."""
        with self._lock:
            return self._mismatches(start, end, value)

    def _mismatches(self, start: int, end: int, value: int) -> tuple[int, int]:
        import bisect

        bad, first, pos = 0, -1, start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while pos < end:
            r = self._runs[i] if i < len(self._runs) else None
            if r is None or r[0] >= end:
                bad += end - pos
                first = pos if first < 0 else first
                break
            if r[1] <= pos:
                i += 1
                continue
            if r[0] > pos:  # a gap: unknown bytes
                bad += r[0] - pos
                first = pos if first < 0 else first
                pos = r[0]
                continue
            stop = min(r[1], end)
            if r[2] != value:
                bad += stop - pos
                first = pos if first < 0 else first
            pos = stop
            i += 1
        return bad, first


class _FakeCheckKernels:
    """The fake's :class:`cupy_memstrat.cuda.CheckKernels`: the same
    interface, checking the contents model at once."""

    SLOTS = 1 << 14

    def __init__(self, backend: "FakeBackend"):
        self._backend = backend
        self._flag = False
        self._bad: dict[int, dict[int, tuple[int, int]]] = {}
        self.n_launches = 0

    def verify(self, device: int, ptr: int, start: int, end: int, pattern: int, slot: int, stream: int) -> None:
        self._backend._stream_key(stream)
        self.n_launches += 1
        bad, first = self._backend._contents.mismatches(ptr + start, ptr + end, pattern & 0xFF)
        if bad:
            prev = self._bad.setdefault(device, {}).get(slot, (0, _UINT64_MAX))
            self._bad[device][slot] = (prev[0] + bad, min(prev[1], first - ptr))
            self._flag = True

    def flagged(self) -> bool:
        return self._flag

    def clear_flag(self) -> None:
        self._flag = False

    def read(self, device: int) -> dict:
        return self._bad.pop(device, {})


_POOL_ATTRS = {
    _cuda.POOL_ATTR_RELEASE_THRESHOLD: "release_threshold",
    _cuda.POOL_ATTR_RESERVED_MEM_CURRENT: "reserved",
    _cuda.POOL_ATTR_RESERVED_MEM_HIGH: "reserved_high",
    _cuda.POOL_ATTR_USED_MEM_CURRENT: "used",
    _cuda.POOL_ATTR_USED_MEM_HIGH: "used_high",
}
