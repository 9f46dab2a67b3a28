"""When a :class:`~cupy_memstrat.strategies.base.Strategy` may be let go: the
strategies kept reachable while they have handed out memory, ``close()``, and
what :func:`cupy_memstrat.using` does once a strategy's last array is freed.

An internal module of :mod:`cupy_memstrat.strategies`: :class:`_LifetimeMixin`
is one of the classes ``Strategy`` is composed of (its state is set in
``Strategy.__init__``); ``_pinned`` is read by the out-of-memory recovery,
which trims every reachable strategy.
"""

from __future__ import annotations

import threading

from .._userwarn import warn_at_user


__all__: list[str] = []

_pinned: set = set()
_pinned_lock = threading.RLock()  # re-entered when a finaliser lets a strategy go


class _LifetimeMixin:
    """``Strategy``'s pinning, ``close()`` and ``using()``'s let-go (no state of its own)."""

    def _pin(self) -> None:
        # A strategy that has handed out memory stays reachable from this
        # module until close(): CuPy frees through it from finalisers, and the
        # garbage collector must never clear it while arrays that are garbage
        # in the same cycle still have to be freed (a test's traceback cycle
        # can hold both).
        with _pinned_lock:
            _pinned.add(self)
            self._pinned = True

    # -- using(): let go once empty ----------------------------------------------------
    def _let_go_when_empty(self) -> None:
        """Close this strategy (giving its cache back) once its last live
        allocation is freed, or now if there is none: what :func:`using`
        does for a strategy it made when arrays outlive the block."""
        self._watch[0] = self._check_empty
        self._check_empty()

    def _keep(self) -> None:
        """Installed again (use() / using() of this object): stay open, and
        reachable again if it was closed (record_stream, other strategies'
        out-of-memory recovery)."""
        self._watch[0] = None
        if not self._pinned:
            self._pin()

    @staticmethod
    def _owner_of_pointer(ptr: int, device: int):
        """The strategy whose live table holds ``ptr`` on ``device``; a
        checking layer is preferred to the strategy it wraps (both hold it)."""
        found = None
        with _pinned_lock:
            candidates = list(_pinned)
        for s in candidates:
            if s.accounts.is_live(ptr, device):
                if getattr(s, "inner", None) is not None:
                    return s  # the layer: the program's view
                found = s
        return found

    def _check_empty(self) -> None:
        if self.accounts.any_live():
            return
        self._watch[0] = None
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - called from a finaliser
            self.backend.clear_last_error()
            warn_at_user(f"{self.name}: closing after its last array was freed failed: {exc}", RuntimeWarning)

    # -- close -----------------------------------------------------------------
    def close(self) -> None:
        """Let the strategy be garbage-collected once unreachable, and release
        what it holds beyond live allocations (nothing for ``device``).

        A strategy that has allocated stays referenced by cupy_memstrat until
        closed, because CuPy's finalisers free through it. Close it only once
        its arrays are gone and it is no longer CuPy's allocator (allocations
        through an allocator that is still installed do not pin it again;
        :meth:`raw_malloc` does). Closing twice is harmless. Blocks freed
        with :func:`cupy_memstrat.record_stream`'d streams still pending are
        given back first (after a synchronisation).
        """
        self._watch[0] = None
        self.deferred.flush()
        with _pinned_lock:
            _pinned.discard(self)
            self._pinned = False
