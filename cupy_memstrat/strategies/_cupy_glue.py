"""CuPy's side of :class:`~cupy_memstrat.strategies.base.Strategy`: the
``malloc(size) -> MemoryPointer`` callable over a hot path (through CuPy's
``PythonFunctionAllocator`` with CUDA, a small Python function with the fake
backend), the strategy behind an installed allocator, and CuPy's own default
pool (emptied before an out-of-memory retry, named in the error message).

An internal module of :mod:`cupy_memstrat.strategies`: :class:`_CupyMixin`
is one of the classes ``Strategy`` is composed of (its state, ``_cupy_malloc``
and ``_pfa``, is set in ``Strategy.__init__``). :func:`cupy_malloc_over` is
public as ``cupy_memstrat.strategies.base.cupy_malloc_over`` (the history
recorder builds its own callable with it).
"""

from __future__ import annotations

import sys
import weakref

from .. import backends as _backends
from ..sizes import format_size
from . import _support
from ._support import SIZE_T_LIMIT, check_size, hot_path_status


__all__ = ["cupy_malloc_over"]

_pfa_owners: dict = {}  # id(PythonFunctionAllocator) -> weakref to its strategy


class _FakeOwner:
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
    memory = _cupy_memory()
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
        owner = _FakeOwner(free, ptr, device) if ptr else None
        return memory.MemoryPointer(memory.UnownedMemory(ptr, size, owner, device), 0)

    return fake_malloc, None, gc_safe



class _CupyMixin:
    """``Strategy``'s CuPy allocator callables (no state of its own)."""

    # -- CuPy -------------------------------------------------------------------
    def malloc(self, size) -> "cupy.cuda.MemoryPointer":  # noqa: F821
        """CuPy's allocator interface, with size checks: ``size`` bytes ->
        ``cupy.cuda.MemoryPointer`` on CuPy's current device. Usable with
        ``cupy.cuda.set_allocator``; :func:`cupy_memstrat.use` installs the
        faster :meth:`cupy_allocator`, which skips these checks.

        Raises:
            TypeError, ValueError: ``size`` is not an int >= 0 (CuPy's own
                pool raises ``OverflowError`` for a negative size).
            cupy.cuda.memory.OutOfMemoryError: as :meth:`raw_malloc`.
        """
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if size.__class__ is not int or size < 0 or size >= SIZE_T_LIMIT:
            size = check_size(size)
        cupy_malloc = self._cupy_malloc
        if cupy_malloc is None:
            cupy_malloc = self._make_cupy_malloc()
        return cupy_malloc(size)

    def cupy_allocator(self):
        """The callable :func:`cupy_memstrat.use` passes to ``cupy.cuda.set_allocator``.

        With CUDA it is the ``malloc`` of a ``cupy.cuda.PythonFunctionAllocator``
        over this strategy's hot path, with no Python wrapper in between (one
        Python frame less per allocation). Bad sizes then fail as they do with
        CuPy's own pool: ``cupy.cuda.alloc(-1)`` raises ``OverflowError``; call
        :meth:`malloc` for the ``ValueError`` / ``TypeError`` checks. With the
        fake backend it is :meth:`malloc`.
        """
        if not isinstance(self.backend, _backends.RealBackend):
            return self.malloc
        if self._cupy_malloc is None:
            self._make_cupy_malloc()
        return self._cupy_malloc

    @staticmethod
    def _owner_of(allocator):
        """The strategy behind a callable from :meth:`cupy_allocator` or :meth:`malloc`."""
        owner = getattr(allocator, "__self__", None)
        if isinstance(owner, _CupyMixin):
            return owner
        recorded = getattr(allocator, "_memstrat_strategy", None)  # cupy_memstrat.history's recorder
        if isinstance(recorded, _CupyMixin):
            return recorded
        ref = _pfa_owners.get(id(owner))
        s = ref() if ref is not None else None
        return s if s is not None and s._pfa is owner else None

    def _cupy_route(self, malloc, free):
        """CuPy's ``malloc(size) -> MemoryPointer`` over the hot path's
        ``malloc`` / ``free``, and the object that callable names as its
        ``__self__`` (None if it names none; :meth:`_owner_of` finds the
        strategy through it). A strategy with a route of its own into CuPy
        overrides this (``pool``'s ``route="direct"``)."""
        cupy_malloc, pfa, self._gc_safe = cupy_malloc_over(self.backend, malloc, free, self.block_granule)
        return cupy_malloc, pfa

    def _make_cupy_malloc(self):
        malloc, free = self._hot_path()
        cupy_malloc, pfa = self._cupy_route(malloc, free)
        if pfa is not None:
            self._pfa = pfa
            _pfa_owners[id(pfa)] = weakref.ref(self)
        self._pin()
        self._cupy_malloc = cupy_malloc
        return cupy_malloc


def _cupy_memory():
    try:
        from cupy.cuda import memory
    except ImportError as exc:
        from ..errors import CuPyNotInstalledError

        raise CuPyNotInstalledError(
            "CuPy is not installed: install a CuPy wheel, e.g. pip install 'cupy-memstrat[cuda13]'"
        ) from exc
    return memory


def _free_cupy_pool_blocks(device: int) -> None:
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


def _cupy_pool_hint(device: int) -> str:
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
