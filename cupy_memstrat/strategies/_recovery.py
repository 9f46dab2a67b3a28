"""Out of memory and other failures of :class:`~cupy_memstrat.strategies.base.Strategy`:
recovery in CuPy's order, the out-of-memory error and its message, and the
frees that fail or name no live block (all off the hot path, which calls
``_recover_hook``, ``_unknown_free`` and ``_deallocation_failed`` only when
something went wrong).

An internal module of :mod:`cupy_memstrat.strategies`: :class:`_RecoveryMixin`
is one of the classes ``Strategy`` is composed of (no state of its own).
"""

from __future__ import annotations

import gc

from .. import backends as _backends
from .._userwarn import warn_at_user
from ..errors import InvalidFreeWarning, out_of_memory_class
from ..memory_doc import write_oom_snapshot
from ..sizes import format_count, format_size
from ._cupy_glue import _cupy_pool_hint, _free_cupy_pool_blocks
from ._lifetime import _pinned

__all__: list[str] = []


class _RecoveryMixin:
    """``Strategy``'s out-of-memory recovery and failure paths (no state of its own)."""

    # -- out of memory: CuPy's order -------------------------------------------------
    def _recover_hook(self, size: int, device: int, exc: BaseException) -> int:
        """The hot path's ``allocate(size)`` raised ``exc``: recover and
        retry (:meth:`_recover`), returning the pointer, or raise."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        allocate = self._hooks()[0]
        return self._recover(size, device, exc, lambda: allocate(size))

    def _recover(self, size: int, device: int, exc: BaseException, retry, detail=None) -> int:
        """Out-of-memory recovery in CuPy's order (``_try_malloc`` of
        ``cupy/cuda/memory.pyx``, v14.2.0): give back cached memory
        (:meth:`_give_back`), retry; then ``gc.collect()`` twice, so that
        arrays held only by reference cycles are freed, give back again,
        retry; then raise ``OutOfMemoryError``. ``retry()`` allocates again
        and raises ``backend.Error`` on failure. A CUDA error other than out
        of memory is raised at once. Counts ``n_oom_recoveries`` on success.

        Args:
            detail: a callable returning text for the final error message.
        """
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        b = self.backend
        for step in (1, 2):
            b.clear_last_error()
            if getattr(exc, "status", None) != _backends.ERROR_MEMORY_ALLOCATION:
                break
            if step == 2:
                gc.collect()
                gc.collect()
            self._give_back(device)
            try:
                ptr = retry()
            except self._Error as exc2:
                exc = exc2
                continue
            self.accounts.count_recovery(device)
            return ptr
        self._allocation_failed(size, device, exc, detail=detail() if detail else "")

    def _give_back(self, device: int) -> None:
        """Before retrying a failed allocation: this strategy's cached memory
        (:meth:`trim`, which also gives back blocks waiting on recorded
        streams), every other strategy's that holds memory on ``device``, and
        the free blocks of CuPy's own default pool there, go back to CUDA."""
        try:
            self.trim(0, device)
        except Exception:  # noqa: BLE001 - best effort: the retry decides
            self.backend.clear_last_error()
        for other in list(_pinned):
            if other is not self:
                try:
                    other.trim(0, device)
                except Exception:  # noqa: BLE001 - best effort for someone else's cache
                    self.backend.clear_last_error()
        if isinstance(self.backend, _backends.RealBackend):
            _free_cupy_pool_blocks(device)

    # -- frees that fail or name no live block (off the hot path) ------------
    def _deallocation_failed(self, ptr: int, size: int, device: int, exc: BaseException, stacklevel: int) -> None:
        """The C hot path's free: ``_deallocate`` raised. A finaliser must not
        raise, so this warns (as the Python free does, same stack level)."""
        warn_at_user(
            f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
            RuntimeWarning)

    def _unknown_free(self, ptr, stacklevel: int = 1) -> tuple[int, int | None]:
        """A free whose device hint was wrong: (device, size) of the live
        block, popped; else counts and warns an invalid free, (-1, None)."""
        __tracebackhide__ = True  # pytest shows the user's frames under -W error
        device, size = self.accounts.pop_live(ptr)
        if size is None and not (ptr == 0 and type(ptr) is int):
            self._invalid_free(ptr, 4 + stacklevel)
        return device, size

    # -- failure paths (off the hot path) ------------------------------------
    def _allocation_failed(self, size: int, device: int, exc: BaseException, detail: str = ""):
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        self.backend.clear_last_error()
        self.accounts.count_failed(device)
        if getattr(exc, "status", None) != _backends.ERROR_MEMORY_ALLOCATION:
            raise exc
        self._raise_out_of_memory(size, device, reason="cuda", cause=exc, detail=detail)

    def _raise_out_of_memory(self, size: int, device: int, *, reason: str, cause=None, detail: str = ""):
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        st = self.stats(device)
        free = None
        try:
            free, total = self.backend.mem_get_info(device)
            cuda_has = f"CUDA reports {format_size(free)} free of {format_size(total)}"
        except Exception as exc:  # noqa: BLE001 - the report must not hide the OOM
            cuda_has = f"free memory unknown ({exc})"
        msg = (
            f"{self.name} strategy: out of memory allocating {format_size(size)} ({size:,} bytes) "
            f"on device {device}{detail}; {cuda_has}; this strategy holds "
            f"{format_size(st.bytes_in_use)} in use in {format_count(st.n_live, 'allocation')} "
            f"(reserved {format_size(st.bytes_reserved)}, peak in use {format_size(st.peak_bytes_in_use)})"
        )
        if isinstance(self.backend, _backends.RealBackend):
            msg += _cupy_pool_hint(device)
        if self.oom_context is not None:
            try:
                msg += str(self.oom_context())
            except Exception:  # noqa: BLE001 - the context must not hide the error
                pass
        h = self._history
        if h is not None:  # a recording takes the event (PyTorch's "oom" trace entry)
            h.oom(size, device, free or 0)
        path = self.config.get("oom_snapshot")
        if path:  # the memory at the error, written before raising; a failure to write never hides the error
            try:
                write_oom_snapshot(self, path, self._history, size=size, device=device, reason=reason, message=msg,
                                   device_free=free)
            except Exception as exc:  # noqa: BLE001 - the out-of-memory error must still be raised
                msg += f"; the out-of-memory snapshot could not be written to {path!r}: {exc}"
                path = None
            else:
                msg += (f"; snapshot of the memory at this error: {path} (python -m cupy_memstrat export "
                        f"{path} -o oom.pickle opens it in PyTorch's memory viewer)")
        oom = out_of_memory_class()(
            msg, requested=size, device=device, stats=st, strategy=self.name, reason=reason, snapshot=path
        )
        raise oom from cause

    def _invalid_free(self, ptr, stacklevel: int) -> None:
        __tracebackhide__ = True  # pytest shows the user's frames under -W error
        self.accounts.count_invalid_free()
        shown = f"0x{ptr:x}" if type(ptr) is int and ptr >= 0 else repr(ptr)
        warn_at_user(
            f"{self.name}: free of pointer {shown} that this strategy does not own "
            "(unknown, already freed, or not a pointer); ignored",
            InvalidFreeWarning)
