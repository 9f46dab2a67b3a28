"""GPU memory outside the strategy: the driver's reading of each device's used memory, and
the counters of the libraries that allocate on their own (PyTorch, Numba).

The strategy counts what CuPy allocates through it. A test can also hold memory that
never passes through it: a torch tensor, a Numba device array, a raw
``cupy.cuda.runtime.malloc``, arrays of another ``cupy.cuda.MemoryPool``. The driver sees
all of it: ``cudaMemGetInfo`` (through the strategy's backend) gives the device's used
memory, total minus free, for every process on the device. Where NVML lists this process
with its memory (the strategy's backend: ``process_used``), that count is used instead:
other processes on the device (pytest-xdist's other workers, other jobs) do not move it.

What the driver's used memory grew by during a test, less what the strategy's reserved
memory grew by, is memory *outside the strategy*. Part of it is explained by libraries the
plugin can read (PyTorch's caching allocator: ``torch.cuda.memory_reserved``; Numba's
memory manager: its table of live allocations), and part is not (a raw ``cudaMalloc``,
another CuPy pool, a library's own cache, CUDA's own growth: module loads, library
workspaces). Before judging, the caches that hold memory on purpose are emptied:
CuPy's FFT plan cache, CuPy's default pool (when it is not the strategy), PyTorch's
cache and cuBLAS workspaces, Numba's pending frees.

Without NVML's count, other processes on the same device move the reading too; the
tolerance (``--gpumem-outside-tolerance``) is for that and for CUDA's own growth.
"""

from __future__ import annotations

import gc
import sys
import threading
from dataclasses import dataclass, field

__all__ = ["Reading", "Sampler", "read", "used_growth", "empty_caches", "warm_up", "plain", "LIBRARY_NAMES"]

#: the libraries whose counters the plugin reads, as reports name them
LIBRARY_NAMES = {"torch": "PyTorch's caching allocator", "numba": "Numba's memory manager"}


@dataclass
class Reading:
    """One reading per device (bytes; None where it could not be read)."""

    driver_used: list  # total - free from cudaMemGetInfo: every process on the device
    reserved: list  # the strategy's bytes reserved
    libraries: dict = field(default_factory=dict)  # name -> per device: (held, in use) or None
    process_used: list = field(default_factory=list)  # NVML's count of this process's memory


def _process_used(backend, device: int):
    fn = getattr(backend, "process_used", None)  # a backend of one's own may lack it
    if fn is None:
        return None
    try:
        return fn(device)
    except Exception:  # noqa: BLE001 - no reading
        return None


def used_growth(r0: Reading, r1: Reading) -> tuple[list, list]:
    """Per device, what the used memory grew by from ``r0`` to ``r1`` (bytes, negative when it
    shrank) and whose count it is: ``"process"`` where both readings have NVML's count of
    this process, which other processes do not move, else ``"device"`` (``cudaMemGetInfo``:
    every process on the device), and ``(0, None)`` where neither was read twice."""
    growth, sources = [], []
    for i, (u0, u1) in enumerate(zip(r0.driver_used, r1.driver_used)):
        p0 = r0.process_used[i] if i < len(r0.process_used) else None
        p1 = r1.process_used[i] if i < len(r1.process_used) else None
        if p0 is not None and p1 is not None:
            growth.append(p1 - p0)
            sources.append("process")
        elif u0 is not None and u1 is not None:
            growth.append(u1 - u0)
            sources.append("device")
        else:
            growth.append(0)
            sources.append(None)
    return growth, sources


def plain(value):
    """``value`` as built-in types only (exact ``int``, ``float``, ``str``, lists and dicts), for
    the record that pytest-xdist sends from a worker: its serializer takes no NumPy number and no
    subclass of ``int`` (an enum)."""
    if value is None or type(value) in (bool, str, float):
        return value
    if isinstance(value, dict):
        return {k if type(k) in (int, str) else str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    try:
        return int(value) if int(value) == value else float(value)
    except (TypeError, ValueError):
        return str(value)


def _torch(devices):
    """PyTorch's reserved and allocated bytes per device, or None where it holds no CUDA state."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return [(int(torch.cuda.memory_reserved(d)), int(torch.cuda.memory_allocated(d))) for d in devices]
    except Exception:  # noqa: BLE001 - a report must not crash: no reading
        return None


def _numba_manager():
    """``(manager, device)``: Numba's memory manager of its current context and that
    context's device, if Numba has made one and the manager keeps a table of live
    allocations (its own does; an external memory manager's need not), else None."""
    if "numba.cuda" not in sys.modules:
        return None
    try:
        from numba.cuda.cudadrv import devices as _devices

        if not _devices.gpus.lst:  # no context made: reading one would make it
            return None
        ctx = _devices.get_context()
        mgr = getattr(ctx, "memory_manager", None)
        if not hasattr(mgr, "allocations"):
            return None
        return mgr, int(ctx.device.id)
    except Exception:  # noqa: BLE001 - no CUDA, or a Numba without this layout
        return None


def _numba(devices):
    found = _numba_manager()
    if found is None:
        return None
    mgr, dev = found
    try:
        n = sum(int(getattr(m, "size", 0) or 0) for m in list(mgr.allocations.values()))
    except Exception:  # noqa: BLE001
        return None
    return [(n, n) if d == dev else (0, 0) for d in devices]


_LIBRARIES = {"torch": _torch, "numba": _numba}


def read(strategy, devices) -> Reading:
    """The driver's used memory, the strategy's reserved memory and the libraries' counters
    on ``devices``, now."""
    b = strategy.backend
    used = []
    for d in devices:
        try:
            free, total = b.mem_get_info(d)
            used.append(total - free)
        except Exception:  # noqa: BLE001 - no reading on this device
            b.clear_last_error()
            used.append(None)
    reserved = [strategy.stats(d).bytes_reserved for d in devices]
    libs = {}
    for name, fn in _LIBRARIES.items():
        r = fn(devices)
        if r is not None:
            libs[name] = r
    return Reading(used, reserved, libs, [_process_used(b, d) for d in devices])


class Sampler:
    """The used memory read every ``interval`` seconds on a thread of its own, while a test's
    call runs: per device, the most it grew above ``start`` (bytes), for the driver-level peak
    of memory a test allocates outside the strategy and frees again before its call ends.
    Each device is read the way ``start`` read it: NVML's count of this process where it had
    one, else ``cudaMemGetInfo``; a reading costs one such call per device. What happens
    between two readings is not seen."""

    def __init__(self, backend, devices, interval: float, start: Reading):
        self._backend, self._devices, self._interval = backend, list(devices), interval
        n = len(self._devices)
        procs = list(start.process_used) + [None] * (n - len(start.process_used))
        self._by_process = [procs[i] is not None for i in range(n)]
        self._base = [procs[i] if procs[i] is not None else start.driver_used[i] for i in range(n)]
        self.peak: list = [None] * n
        self.n_readings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpumem-driver-sampler", daemon=True)

    def _read(self) -> None:
        for i, d in enumerate(self._devices):
            if self._base[i] is None:
                continue
            if self._by_process[i]:
                used = _process_used(self._backend, d)
            else:
                try:
                    free, total = self._backend.mem_get_info(d)
                    used = total - free
                except Exception:  # noqa: BLE001 - a device that cannot be read: no reading
                    used = None
            if used is None:
                continue
            grown = used - self._base[i]
            if self.peak[i] is None or grown > self.peak[i]:
                self.peak[i] = grown
        self.n_readings += 1

    def _run(self) -> None:
        self._read()
        while not self._stop.wait(self._interval):
            self._read()

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> list:
        """Stop (after one last reading); per device the most the used memory grew above the
        start (bytes), None where no reading was taken."""
        self._stop.set()
        self._thread.join()
        self._read()
        return list(self.peak)


def empty_caches(devices, strategy_name: str) -> None:
    """Empty the caches that hold device memory on purpose, before a judgement: a garbage
    collection, CuPy's FFT plan cache and default pool (not when it is the strategy),
    PyTorch's cache and cuBLAS workspaces, Numba's pending frees. Errors are ignored."""
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        for d in devices:
            try:
                with cupy.cuda.Device(d):
                    if "cupy.fft" in sys.modules:
                        cupy.fft.config.get_plan_cache().clear()
                    if strategy_name != "pool":
                        cupy.get_default_memory_pool().free_all_blocks()
            except Exception:  # noqa: BLE001 - no CUDA (the simulated GPU): nothing cached
                pass
    torch = sys.modules.get("torch")
    if torch is not None and strategy_name != "torch":
        try:
            if torch.cuda.is_initialized():
                clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear is not None:
                    clear()
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
    found = _numba_manager()
    if found is not None:
        try:
            found[0].deallocations.clear()
        except Exception:  # noqa: BLE001
            pass


def warm_up(device: int) -> None:
    """Make on ``device``, for this thread, what CUDA sets aside once and then keeps, so that
    it is not counted against the first test that needs it: what CuPy's first reductions
    make CUDA set aside (measured on an H100: the device's used memory grows by about 0.5 GiB
    at a process's first sum of a uint8 array, and stays; most likely local memory for every
    thread the device can run), and the library handles
    CuPy creates on first use (cuBLAS, whose workspace cuSOLVER's handle has too, cuSOLVER,
    cuSPARSE). The small arrays it makes go through CuPy's current allocator and are freed.
    Errors are ignored (no GPU, a library missing)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return
    try:
        from cupy.cuda import device as _device

        with cupy.cuda.Device(device):
            x = cupy.empty(1024, dtype=cupy.uint8)
            x.fill(1)  # a kernel launch
            int(x.sum())  # CuPy's reductions: what CUDA sets aside for them stays
            float(x.astype(cupy.float32).sum())
            cupy.cuda.get_current_stream().synchronize()
            del x
    except Exception:  # noqa: BLE001 - the simulated GPU runs no kernel
        return
    for getter in ("get_cublas_handle", "get_cusolver_handle", "get_cusparse_handle"):
        fn = getattr(_device, getter, None)
        if fn is None:
            continue
        try:
            with cupy.cuda.Device(device):
                fn()
        except Exception:  # noqa: BLE001 - the library is not installed
            pass
