"""CuPy's side of a strategy: the ``malloc(size) -> MemoryPointer`` callable over a
hot path (through CuPy's ``PythonFunctionAllocator`` with CUDA, a small Python
function with the fake backend), and CuPy's own default pool
(emptied before an out-of-memory retry, named in the error message).
:func:`cupy_malloc_over` is also what the history recorder builds its callable with.
"""

from __future__ import annotations

import sys

from .. import backends as _backends
from ..sizes import format_size
from . import _support
from ._support import hot_path_status


__all__ = ["cupy_malloc_over", "cupy_memory", "cupy_pool_hint", "free_cupy_pool_blocks"]


class FakeOwner:
    """Frees a block when CuPy drops its memory object (fake backend only;
    with CUDA, CuPy's ``PythonFunctionAllocator`` does this in Cython)."""

    __slots__ = ("free", "ptr", "device")

    def __init__(self, free, ptr, device):
        self.free, self.ptr, self.device = free, ptr, device

    def __del__(self):
        self.free(self.ptr, self.device)


def cupy_malloc_over(backend, malloc, free, granule: int = 1):
    """CuPy's ``malloc(size) -> MemoryPointer`` over a hot path's
    ``malloc(size, device)`` / ``free(ptr, device, stacklevel)``.

    ``granule`` (a power of two): sizes are rounded up to a multiple of it
    before the hot path sees them, so ``memptr.mem.size`` is what the block
    holds, as with CuPy's own pool (512).

    Returns ``(cupy_malloc, pfa, gc_safe)``: ``pfa`` is the
    ``PythonFunctionAllocator`` behind it (None with the fake backend, where
    a small Python function does its work), ``gc_safe`` whether the C
    ``GcSafeMalloc`` wraps it (wherever the extension is built, whichever hot
    path was chosen, unless ``CUPY_MEMSTRAT_HOT_PATH=python``).
    """
    memory = cupy_memory()
    gc_safe = _support.c_hotpath is not None and hot_path_status()["setting"] != "python"
    mask = -granule
    if isinstance(backend, _backends.RealBackend):
        # CuPy reads the current device, calls malloc(size, device) for
        # size > 0 and, when the array's memory dies, free(ptr, device), all
        # in Cython.
        pfa = memory.PythonFunctionAllocator(malloc, free)
        cupy_malloc = pfa.malloc
        if gc_safe:
            # Keeps each array's memory object off the garbage collector,
            # which in CuPy 14.2 can clear it before its destructor has
            # freed the block (csrc/hotpath.c, GcSafeMalloc); rounds too.
            cupy_malloc = _support.c_hotpath.GcSafeMalloc(cupy_malloc, granule)
        elif granule > 1:
            pfa_malloc = cupy_malloc

            def cupy_malloc(size):
                return pfa_malloc((size + granule - 1) & mask)

        return cupy_malloc, pfa, gc_safe

    def fake_malloc(size):
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        device = backend.get_device()
        size = (size + granule - 1) & mask
        ptr = malloc(size, device) if size else 0
        owner = FakeOwner(free, ptr, device) if ptr else None
        return memory.MemoryPointer(memory.UnownedMemory(ptr, size, owner, device), 0)

    return fake_malloc, None, gc_safe



def cupy_memory():
    try:
        from cupy.cuda import memory
    except ImportError as exc:
        from ..errors import CuPyNotInstalledError

        raise CuPyNotInstalledError(
            "CuPy is not installed: install a CuPy wheel, e.g. pip install 'cupy-memstrat[cuda13]'"
        ) from exc
    return memory


def free_cupy_pool_blocks(device: int) -> None:
    """``free_all_blocks()`` of CuPy's default pool on ``device``, if CuPy is
    loaded: memory cached there from before a strategy was installed is
    memory CuPy's pool would have reused."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return
    try:
        from cupy.cuda import Device

        with Device(device):
            cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 - best effort
        pass


def cupy_pool_hint(device: int) -> str:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return ""
    try:
        from cupy.cuda import Device

        with Device(device):
            pool = cupy.get_default_memory_pool()
            cached = pool.total_bytes() - pool.used_bytes()
    except Exception:  # noqa: BLE001
        return ""
    if cached <= 0:
        return ""
    return (
        f". CuPy's default memory pool still caches {format_size(cached)} on this device: "
        "cupy.get_default_memory_pool().free_all_blocks() gives it back"
    )
