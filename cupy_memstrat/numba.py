"""Numba's device arrays through cupy_memstrat: an External Memory Management
(EMM) Plugin for numba-cuda.

Enable it before Numba's first CUDA allocation, and install a strategy::

    NUMBA_CUDA_MEMORY_MANAGER=cupy_memstrat.numba python app.py

    # in app.py, before the first Numba allocation:
    import cupy_memstrat
    cupy_memstrat.use("pool")            # or "device", "async", "managed", ...

or, in code, before Numba creates its CUDA context::

    from numba import cuda
    from cupy_memstrat.numba import MemstratNumbaManager
    cuda.set_memory_manager(MemstratNumbaManager)

Numba imports the module named by ``NUMBA_CUDA_MEMORY_MANAGER`` when it
creates its first context and uses its ``_numba_memory_manager`` attribute
(numba-cuda's ``_ensure_memory_manager``, ``numba/cuda/cudadrv/driver.py``).
From then on every device allocation Numba makes through its context
(``cuda.device_array``, ``device_array_like``, ``to_device``, the device
copies of host arrays passed to a kernel) is a ``Strategy.raw_malloc`` of the
strategy CuPy allocates with in the calling thread
(:func:`cupy_memstrat.current`), and
shows up in that strategy's ``stats()``, ``live_allocations()``, budgets and
leak checks of the pytest plugin. docs/interop.md has the user's view: what is
shared, what is not, and which stream the memory is ordered on.

Not routed through the strategy: pinned and mapped host memory
(``cuda.pinned_array``, ``mapped_array``) and managed arrays made by Numba
itself (``cuda.managed_array``); numba-cuda's ``HostOnlyCUDAMemoryManager``
keeps handling those with the CUDA driver, as it does for RMM's plugin.

Importing this module imports ``numba.cuda`` (which works without a GPU); it
raises :class:`NumbaNotInstalledError` (an ``ImportError``) naming
``pip install numba-cuda`` where Numba's CUDA target is not installed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import weakref

import cupy_memstrat

from .api import ENV_VAR, current
from .backends import get_backend
from .errors import MemstratError, NoStrategyError
from .sizes import format_size
from .strategies.base import check_size

__all__ = [
    "MemstratNumbaManager",
    "IpcExportError",
    "NumbaNotInstalledError",
    "numba_out_of_memory_error",
]


class NumbaNotInstalledError(MemstratError, ImportError):
    """Numba's CUDA target (the ``numba-cuda`` package) is not importable."""


try:
    from numba import cuda as _numba_cuda
    from numba.cuda.cudadrv import driver as _numba_driver
except ImportError as _exc:
    raise NumbaNotInstalledError(
        "cupy_memstrat.numba is an External Memory Management plugin for Numba's CUDA target, which is "
        f"not installed ({_exc}): pip install numba-cuda (with the CUDA 12 or 13 toolkit wheels for "
        "compiling kernels: pip install 'numba-cuda[cu12]' or 'numba-cuda[cu13]')"
    ) from _exc

HostOnlyCUDAMemoryManager = _numba_cuda.HostOnlyCUDAMemoryManager
GetIpcHandleMixin = _numba_cuda.GetIpcHandleMixin
MemoryInfo = _numba_cuda.MemoryInfo
CudaAPIError = _numba_driver.CudaAPIError
MemoryPointer = _numba_cuda.MemoryPointer
AutoFreePointer = _numba_driver.AutoFreePointer

#: True where Numba's driver uses NVIDIA's cuda-python bindings, whose device
#: pointers are ``cuda.bindings.driver.CUdeviceptr``: always from numba-cuda
#: 0.21 on (which removed ``USE_NV_BINDING``), and where
#: ``NUMBA_CUDA_USE_NVIDIA_BINDING`` was on before; else ctypes pointers.
NV_BINDING = bool(getattr(_numba_driver, "USE_NV_BINDING", True))


def _device_pointer(ptr: int):
    """``ptr`` as the pointer type Numba's driver takes (as RMM's plugin does)."""
    if NV_BINDING:
        return _numba_driver.binding.CUdeviceptr(ptr)
    return ctypes.c_uint64(ptr)


def _oom_code():
    """The code of numba-cuda's ``CudaAPIError`` for out of memory (``CUDA_ERROR_OUT_OF_MEMORY``)."""
    if NV_BINDING:
        return _numba_driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    from numba.cuda.cudadrv import enums

    return enums.CUDA_ERROR_OUT_OF_MEMORY


class IpcExportError(MemstratError):
    """CUDA cannot export a Numba array's memory for another process
    (``cudaIpcGetMemHandle`` / ``cuIpcGetMemHandle`` refused, or the memory is
    managed memory, which CUDA's legacy IPC does not export). The message
    names the strategy that allocated it; ``strategy`` is its name."""

    def __init__(self, message: str, strategy: str | None = None):
        super().__init__(message)
        self.strategy = strategy

    def __reduce__(self):
        return (type(self), (str(self), self.strategy))


_oom_class = None


def _numba_oom_class():
    global _oom_class
    if _oom_class is None:

        class NumbaOutOfMemoryError(cupy_memstrat.OutOfMemoryError, CudaAPIError):
            """A strategy could not obtain memory for a Numba allocation.

            Both :class:`cupy_memstrat.OutOfMemoryError` (so also
            ``cupy.cuda.memory.OutOfMemoryError`` and ``MemoryError``), with
            its attributes (``requested`` bytes, ``device``, ``stats``,
            ``strategy``, ``reason``, ``snapshot``), and numba-cuda's
            ``CudaAPIError`` with ``code`` ``CUDA_ERROR_OUT_OF_MEMORY``, which
            is what Numba's own memory manager raises when ``cuMemAlloc``
            fails: code that catches either keeps working.
            """

            def __str__(self):
                return str(self.args[0]) if self.args else ""

        NumbaOutOfMemoryError.__module__ = __name__
        NumbaOutOfMemoryError.__qualname__ = "NumbaOutOfMemoryError"
        _oom_class = NumbaOutOfMemoryError
    return _oom_class


def __getattr__(name):
    if name == "NumbaOutOfMemoryError":  # made on first use (pickle finds the class here)
        return _numba_oom_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_numba_oom(message, requested, device, stats, strategy, reason, snapshot):
    err = _numba_oom_class()(message, requested=requested, device=device, stats=stats, strategy=strategy,
                             reason=reason, snapshot=snapshot)
    err.code = _oom_code()  # CudaAPIError's attributes (its __init__ is not called)
    err.msg = message
    return err


def numba_out_of_memory_error(exc) -> Exception:
    """The error :meth:`MemstratNumbaManager.memalloc` raises for ``exc``, a
    :class:`cupy_memstrat.OutOfMemoryError`: the same message and attributes,
    also a ``numba.cuda.cudadrv.driver.CudaAPIError`` whose ``code`` is
    ``CUDA_ERROR_OUT_OF_MEMORY``. Its class is ``NumbaOutOfMemoryError``."""
    return _make_numba_oom(str(exc), exc.requested, exc.device, exc.stats, exc.strategy, exc.reason, exc.snapshot)


class _Block:
    """One Numba allocation: freed exactly once, by the strategy object that
    allocated it, for the device it was allocated on."""

    __slots__ = ("strategy", "ptr", "size", "device", "memory", "_token")

    def __init__(self, strategy, ptr: int, size: int, device: int):
        self.strategy, self.ptr, self.size, self.device = strategy, ptr, size, device
        self.memory = None  # Numba's AutoFreePointer, held here as Numba's own manager holds it
        self._token = [True]  # popped by the one free that happens (list.pop is atomic)

    def take(self) -> bool:
        """True for the first caller only: that caller frees the block."""
        try:
            self._token.pop()
        except IndexError:
            return False
        return True


class MemstratNumbaManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """numba-cuda's EMM Plugin over cupy_memstrat: Numba's device memory
    comes from :func:`cupy_memstrat.current`, the strategy CuPy allocates with
    in the calling thread.

    Numba makes one instance per CUDA context (one per device: the primary
    context, which CuPy shares) and calls its methods itself; code that uses
    Numba never calls them. The interface is numba-cuda's
    ``BaseCUDAMemoryManager`` (``numba/cuda/cudadrv/driver.py``; "External
    Memory Management (EMM) Plugin interface" in numba-cuda's documentation);
    pinned, mapped and Numba-managed host-visible memory stay with numba-cuda's
    ``HostOnlyCUDAMemoryManager``.

    Frees: a Numba array's block goes back when Numba lets go of it (the array
    and every view of it are gone: Numba's reference count on the pointer
    reaches 0), through ``Strategy.raw_free`` of the strategy object that
    allocated it, for the device it was allocated on, even if another
    strategy is installed by then. Unlike Numba's own manager, which queues
    frees and flushes them in batches (``NUMBA_CUDA_MAX_PENDING_DEALLOCS_COUNT``,
    ``_RATIO``), this frees at once, so
    ``stats()`` and the pytest plugin's leak check see it at once; inside
    :meth:`defer_cleanup` frees wait until the outermost block ends.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # ptr -> _Block of the allocations that are live (or waiting in _deferred)
        self._blocks: dict[int, _Block] = {}
        self._deferred: collections.deque = collections.deque()
        self._defer_depth = 0
        self._defer_lock = threading.Lock()  # only around the depth counter: a finaliser never takes it

    # -- the EMM Plugin interface ---------------------------------------------------
    @property
    def interface_version(self) -> int:
        """1: the version of numba-cuda's EMM Plugin interface implemented
        (``set_memory_manager`` refuses any other)."""
        return 1

    def initialize(self) -> None:
        """Nothing to prepare: the strategy is looked up at each allocation.

        Numba calls this each time it makes the context current (numba-cuda's
        ``Context.prepare_for_use``); it touches no CUDA and raises nothing,
        so that programs that use Numba without allocating (kernels on CuPy
        arrays) work without a strategy.
        """

    def memalloc(self, size):
        """Allocate ``size`` bytes of device memory on this context's device
        through :func:`cupy_memstrat.current`'s ``raw_malloc``.

        Args:
            size: bytes, an int (or an ``__index__`` object such as a NumPy
                integer). 0 allocates nothing and returns a null pointer of
                size 0, as Numba represents empty arrays (it does not call
                ``memalloc`` for them itself).

        Returns:
            A ``numba.cuda`` memory pointer (an ``OwnedPointer`` over an
            ``AutoFreePointer``, as Numba's own manager returns) that frees
            the block when Numba's last reference to it, views included, is
            dropped; for 0 bytes a ``MemoryPointer`` to address 0.

        Raises:
            TypeError: ``size`` is not an integer (``bool`` and ``float``
                included); nothing is allocated. The message names the value.
            ValueError: ``size`` is negative or does not fit in ``size_t``;
                nothing is allocated. The message names the value.
            NoStrategyError: no cupy_memstrat strategy is installed in the
                calling thread; nothing is allocated. The message says how to
                install one. (No strategy is installed behind the program's
                back, not even from ``CUPY_MEMSTRAT``: that would change
                CuPy's process-wide allocator from inside a Numba call.)
            NumbaOutOfMemoryError: the strategy could not get the memory
                after its own recovery (give back cached memory,
                ``gc.collect()``, retry). It is both a
                :class:`cupy_memstrat.OutOfMemoryError` (message, statistics,
                ``requested``...) and numba-cuda's ``CudaAPIError`` with
                ``code == CUDA_ERROR_OUT_OF_MEMORY``, which Numba's own
                manager raises when ``cuMemAlloc`` fails. Other CUDA errors
                propagate as the strategy raises them.
        """
        try:
            size = check_size(size)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"cupy_memstrat.numba: memalloc: {exc}") from None
        device = self._context_device()
        if size == 0:
            return MemoryPointer(self._context_ref(), _device_pointer(0), 0)
        strategy = current()
        if strategy is None:
            raise NoStrategyError(_no_strategy_message(size, device))
        if device is None:  # no Numba context (tests on the fake backend): the current device
            device = strategy.backend.get_device()
        try:
            ptr = strategy.raw_malloc(size, device)
        except cupy_memstrat.OutOfMemoryError as exc:
            raise numba_out_of_memory_error(exc) from exc.__cause__
        block = _Block(strategy, ptr, size, device)
        release = self._release

        def finalizer():
            release(block)

        try:
            mem = AutoFreePointer(self._context_ref(), _device_pointer(ptr), size, finalizer=finalizer)
            owned = mem.own()
        except BaseException:
            if block.take():
                strategy.raw_free(ptr, device)
            raise
        block.memory = mem  # kept alive here: Numba's views reference it weakly
        self._blocks[ptr] = block
        return owned

    def get_memory_info(self):
        """``MemoryInfo(free, total)`` of this context's device, in bytes, as
        CUDA reports them (``cudaMemGetInfo`` through the strategy's backend;
        Numba's own manager returns ``cuMemGetInfo``).

        Memory that a caching strategy (``pool``, ``async``, ``managed``)
        holds for reuse counts as used there, as with any pool; its own
        ``stats()`` tells in use from reserved.

        Raises:
            NoDeviceError, CuPyNotInstalledError: no strategy is installed
                and the CUDA backend cannot start.
        """
        strategy = current()
        backend = strategy.backend if strategy is not None else get_backend()
        device = self._context_device()
        if device is None:
            device = backend.get_device()
        free, total = backend.mem_get_info(device)
        return MemoryInfo(free=int(free), total=int(total))

    def get_ipc_handle(self, memory):
        """A ``numba.cuda.IpcHandle`` for ``memory`` (a Numba array's
        ``gpu_data``), for ``cuda.open_ipc_array`` / ``IpcHandle.open`` in
        another process.

        Made by numba-cuda's ``GetIpcHandleMixin``, as RMM's plugin does it:
        the base of the CUDA allocation holding the memory
        (``cuMemGetAddressRange``), its ``cuIpcGetMemHandle``, and the offset
        of the memory from that base, so a block inside a pool's larger
        allocation opens at the right address.

        Raises:
            IpcExportError: the memory is managed memory (the ``managed``
                strategy), which CUDA's legacy IPC cannot export, or CUDA
                refused the export (e.g. memory of a stream-ordered pool,
                ``async``: CUDA documents ``cudaIpcGetMemHandle`` for
                ``cudaMalloc`` memory); the message names the strategy that
                allocated the memory. The CUDA error is the ``__cause__``.
        """
        block = self._block_of(memory)
        strategy = block.strategy if block is not None else None
        name = strategy.name if strategy is not None else None
        who = f"strategy {name!r}" if name else "no cupy_memstrat strategy (memory this manager did not allocate)"
        if block is not None:
            try:
                kind = strategy.backend.memory_type(block.ptr)
            except Exception:  # noqa: BLE001 - CUDA decides below
                kind = None
            if kind == "managed":
                raise IpcExportError(
                    f"cupy_memstrat.numba: get_ipc_handle: this Numba array's memory was allocated by {who} as "
                    "managed memory (cudaMallocManaged), which CUDA's IPC (cudaIpcGetMemHandle) cannot export "
                    "to another process; allocate arrays to be shared under a device-memory strategy "
                    "(cupy_memstrat.using('device') or 'pool' around the allocation)",
                    name,
                )
        try:
            return super().get_ipc_handle(memory)
        except CudaAPIError as exc:
            raise IpcExportError(
                f"cupy_memstrat.numba: get_ipc_handle: CUDA refused to export the memory allocated by {who} "
                f"({exc}); CUDA's IPC (cudaIpcGetMemHandle) exports memory from cudaMalloc: the 'device' and "
                "'pool' strategies",
                name,
            ) from exc

    def reset(self) -> None:
        """Free every block this context's Numba arrays still hold, through
        the strategies that allocated them, then reset the host-side state
        (``HostOnlyCUDAMemoryManager.reset``).

        Numba calls it when the context is reset (``numba.cuda.close()``,
        device reset); arrays still alive are invalid afterwards, as with
        Numba's own manager. That also resets the device's primary context,
        which CuPy shares: do not call ``numba.cuda.close()`` in a process
        that goes on using CuPy. Safe before :meth:`initialize` and twice.
        """
        first_error = None
        for block in list(self._blocks.values()):
            try:
                self._free(block)
            except Exception as exc:  # noqa: BLE001 - free the others, then report
                if first_error is None:
                    first_error = exc
        self._deferred.clear()
        super().reset()
        if first_error is not None:
            raise first_error

    @contextlib.contextmanager
    def defer_cleanup(self):
        """A context manager (``numba.cuda.defer_cleanup()``) in which the
        blocks of Numba arrays that die are not freed: they stay allocated,
        and counted in use by their strategy, until the outermost
        ``defer_cleanup`` of this context ends, and are then freed in the
        order they died. Host-side cleanup is deferred as
        ``HostOnlyCUDAMemoryManager.defer_cleanup`` does.

        What it avoids is the cost of the free: under ``device``, ``cudaFree``
        synchronises the device; under the pooling strategies a free is cheap
        and deferring it only delays reuse. Allocations inside the block are
        made as usual. Nesting and other threads: the deferral is per context
        (as Numba's own is), so frees from every thread wait while any thread
        is inside.
        """
        with super().defer_cleanup():
            with self._defer_lock:
                self._defer_depth += 1
            try:
                yield
            finally:
                with self._defer_lock:
                    self._defer_depth -= 1
                    last = self._defer_depth == 0
                if last:
                    self._drain()

    # -- inside ----------------------------------------------------------------------
    def _context_ref(self):
        """What Numba's own manager gives its pointers: a weak proxy of the context."""
        ctx = self.context
        if ctx is None:
            return None
        try:
            return weakref.proxy(ctx)
        except TypeError:  # already a proxy
            return ctx

    def _context_device(self) -> int | None:
        """The ordinal of this context's device, or None without a Numba context."""
        ctx = self.context
        device = getattr(ctx, "device", None) if ctx is not None else None
        ident = getattr(device, "id", None)
        return int(ident) if ident is not None else None

    def _release(self, block: _Block) -> None:
        """Numba let go of ``block`` (its finaliser): free it now, or queue it
        while :meth:`defer_cleanup` is active. Never takes a lock (finalisers
        run wherever the garbage collector does)."""
        if self._defer_depth:
            self._deferred.append(block)
            if self._defer_depth:
                return
            self._drain()  # the last defer_cleanup ended meanwhile and may have drained before the append
            return
        self._free(block)

    def _drain(self) -> None:
        while True:
            try:
                block = self._deferred.popleft()
            except IndexError:
                return
            self._free(block)

    def _free(self, block: _Block) -> None:
        if not block.take():
            return  # freed already (reset, then the array's finaliser)
        # The pointer stays live in the strategy until raw_free: no other block can hold it yet.
        self._blocks.pop(block.ptr, None)
        block.memory = None
        block.strategy.raw_free(block.ptr, block.device)

    def _block_of(self, memory) -> _Block | None:
        """The live block holding ``memory``'s address (a view's too)."""
        try:
            addr = int(memory.device_pointer_value or 0)
        except (AttributeError, TypeError, ValueError):
            return None
        block = self._blocks.get(addr)
        if block is not None:
            return block
        for block in list(self._blocks.values()):
            if block.ptr <= addr < block.ptr + block.size:
                return block
        return None


def _no_strategy_message(size: int, device: int | None) -> str:
    try:
        import cupy.cuda

        allocator = f"CuPy's allocator is {cupy.cuda.get_allocator()!r}"
    except ImportError:
        allocator = "CuPy is not installed"
    on = f" on device {device}" if device is not None else ""
    env = os.environ.get(ENV_VAR, "")
    env_note = (
        f" ({ENV_VAR}={env!r} is set, but is read only by cupy_memstrat.use_from_env(), "
        "python -m cupy_memstrat run and the pytest plugin)"
        if env.strip()
        else ""
    )
    return (
        f"cupy_memstrat.numba: Numba asked for {format_size(size)} ({size:,} bytes){on}, but no cupy_memstrat "
        f"strategy is installed in this thread ({allocator}); NUMBA_CUDA_MEMORY_MANAGER=cupy_memstrat.numba "
        "allocates through the strategy CuPy uses. Install one before Numba's first allocation: "
        f"cupy_memstrat.use('pool') (or 'device', 'async', 'managed'), or set {ENV_VAR}=pool and call "
        "cupy_memstrat.use_from_env(), or run the program with python -m cupy_memstrat run --strategy pool"
        f"{env_note}; to let Numba allocate by itself instead, unset NUMBA_CUDA_MEMORY_MANAGER"
    )


#: the class numba-cuda's NUMBA_CUDA_MEMORY_MANAGER=cupy_memstrat.numba looks up
_numba_memory_manager = MemstratNumbaManager
