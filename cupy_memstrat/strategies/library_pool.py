"""The base of strategies that allocate from another library's pool (``rmm``,
``torch``): the library is needed only with CUDA, its absence is named before
anything else, each allocation is made on CuPy's current stream behind the
:class:`~cupy_memstrat.strategies.stream_deaths.DeadStreamGuard`, and with the
fake backend the blocks come from the simulator."""

from __future__ import annotations

from .. import backends as _backends
from ..errors import CuPyNotInstalledError, NoDeviceError
from ._contract import ProvidedHooks
from .base import Strategy
from .stream_deaths import DeadStreamGuard, shared_guard

__all__ = ["LibraryPoolStrategy"]


class LibraryPoolStrategy(ProvidedHooks, Strategy):
    """A strategy over another library's allocator.

    A subclass sets :attr:`~Strategy.requires` and implements:

    * ``_import_library()`` (a static method): the library's module, or
      ``MemstratError`` naming what to install;
    * ``_library_hooks(lib) -> (allocate_on, deallocate)``: with CUDA,
      ``allocate_on(size, device, stream)`` (``stream``: CuPy's current
      stream object of ``device``) returning a pointer, raising
      ``self._Error(ERROR_MEMORY_ALLOCATION)`` when the library runs out of
      memory, and ``deallocate(ptr)``;
    * optionally ``_check_library(lib, backend)``: raise before anything is made.

    With CUDA the library is imported at creation (a missing one is named
    even where CUDA itself cannot start); with the fake backend it is not
    needed: blocks come from the fake's ``malloc``/``free`` and nothing is
    cached (``bytes_reserved`` equals ``bytes_in_use``).
    """

    def __init__(self, *, backend=None, **options):
        if backend is None:
            try:
                backend = _backends.get_backend()
            except (NoDeviceError, CuPyNotInstalledError):
                self._import_library()  # a missing library is named first
                raise
        real = isinstance(backend, _backends.RealBackend)
        lib = self._import_library() if real else None  # before any state: nothing to undo
        if real:
            self._check_library(lib, backend)
        super().__init__(backend=backend, **options)
        #: the library's module with CUDA; None with the fake backend
        self.library = lib
        # one guard per cache of the process (use() and using() make new strategies over it); a
        # cache of the user's own (an RMM resource given) has its strategy's guard: the table
        # of shared guards must not keep it, and its memory, alive
        key = self._guard_key(lib) if real else (None if self.config.get("resource") is not None else self.name)
        n = self.backend.device_count()
        self.guard = shared_guard(key, self.backend, n) if key is not None else DeadStreamGuard(self.backend, n)
        if real:
            allocate_on, deallocate = self._library_hooks(lib)
        else:
            self.reserved_is_in_use = True
            malloc = self.backend.malloc
            allocate_on, deallocate = (lambda size, device, stream: malloc(size)), self.backend.free
        current_stream, get_device, before = (self.backend.current_stream, self.backend.get_device,
                                              self.guard.before_allocation)

        def allocate(size):
            d = get_device()
            s = current_stream(d)
            before(s, d)
            return allocate_on(size, d, s)

        self._provide_hooks(allocate, deallocate)

    @staticmethod
    def _import_library():
        raise NotImplementedError

    def _guard_key(self, lib):
        """The process-wide cache this strategy allocates from, whose dead-stream
        guard it shares (default: the library itself), or None for a guard of
        its own."""
        return lib

    def _check_library(self, lib, backend) -> None:
        """Raise if the library cannot serve this backend's devices (default: it can)."""

    def _library_hooks(self, lib):
        raise NotImplementedError
