"""Out of memory, a part every strategy holds (``strategy.recovery``): recovery in
CuPy's order, then the out-of-memory error with its message and snapshot.

The order is CuPy's (``_try_malloc`` of ``cupy/cuda/memory.pyx``, v14.2.0): give
back cached memory and retry; then ``gc.collect()`` twice, so that arrays held
only by reference cycles are freed, give back again and retry; then raise
:class:`~cupy_memstrat.OutOfMemoryError`. It is off the hot path, which calls
it only when an allocation failed.
"""

from __future__ import annotations

import gc

from .. import backends as _backends
from ..errors import out_of_memory_class
from ..memory_doc import write_oom_snapshot
from ..sizes import format_count, format_size
from .cupy_route import cupy_pool_hint, free_cupy_pool_blocks
from .reachable import REACHABLE

__all__ = ["Recovery"]


class Recovery:
    """The out-of-memory path of ``strategy`` (read through its public surface:
    ``backend``, ``accounts``, ``trim``, ``stats``, ``name``, ``config``,
    ``oom_context`` and ``history``)."""

    def __init__(self, strategy):
        self.strategy = strategy

    def recover(self, size: int, device: int, exc: BaseException, retry, detail=None) -> int:
        """Out-of-memory recovery in CuPy's order (``_try_malloc`` of
        ``cupy/cuda/memory.pyx``, v14.2.0): give back cached memory
        (:meth:`give_back`), retry; then ``gc.collect()`` twice, so that
        arrays held only by reference cycles are freed, give back again,
        retry; then raise ``OutOfMemoryError``. ``retry()`` allocates again
        and raises ``backend.Error`` on failure. A CUDA error other than out
        of memory is raised at once. Counts ``n_oom_recoveries`` on success.

        Args:
            detail: a callable returning text for the final error message.
        """
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        b = self.strategy.backend
        Error = b.Error
        for step in (1, 2):
            b.clear_last_error()
            if getattr(exc, "status", None) != _backends.ERROR_MEMORY_ALLOCATION:
                break
            if step == 2:
                gc.collect()
                gc.collect()
            self.give_back(device)
            try:
                ptr = retry()
            except Error as exc2:
                exc = exc2
                continue
            self.strategy.accounts.count_recovery(device)
            return ptr
        self.allocation_failed(size, device, exc, detail=detail() if detail else "")

    def give_back(self, device: int) -> None:
        """Before retrying a failed allocation: this strategy's cached memory
        (:meth:`Strategy.trim`, which also gives back blocks waiting on recorded
        streams), every other strategy's that holds memory on ``device``, and
        the free blocks of CuPy's own default pool there, go back to CUDA."""
        try:
            self.strategy.trim(0, device)
        except Exception:  # noqa: BLE001 - best effort: the retry decides
            self.strategy.backend.clear_last_error()
        for other in REACHABLE.members():
            if other is not self.strategy:
                try:
                    other.trim(0, device)
                except Exception:  # noqa: BLE001 - best effort for someone else's cache
                    self.strategy.backend.clear_last_error()
        if isinstance(self.strategy.backend, _backends.RealBackend):
            free_cupy_pool_blocks(device)

    def allocation_failed(self, size: int, device: int, exc: BaseException, detail: str = ""):
        """An allocation finally failed with ``exc``: counted, then raised as
        :class:`~cupy_memstrat.OutOfMemoryError` if CUDA ran out of memory, else as it is."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        self.strategy.backend.clear_last_error()
        self.strategy.accounts.count_failed(device)
        if getattr(exc, "status", None) != _backends.ERROR_MEMORY_ALLOCATION:
            raise exc
        self.raise_out_of_memory(size, device, reason="cuda", cause=exc, detail=detail)

    def raise_out_of_memory(self, size: int, device: int, *, reason: str, cause=None, detail: str = ""):
        """Raise :class:`~cupy_memstrat.OutOfMemoryError` for ``size`` bytes on ``device``
        (``reason``: ``"cuda"``, or the guard that refused), its message naming the request,
        CUDA's free memory and the strategy's statistics; the recording takes the event and
        the ``oom_snapshot`` file is written first."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        s = self.strategy
        st = s.stats(device)
        free = None
        try:
            free, total = s.backend.mem_get_info(device)
            cuda_has = f"CUDA reports {format_size(free)} free of {format_size(total)}"
        except Exception as exc:  # noqa: BLE001 - the report must not hide the OOM
            cuda_has = f"free memory unknown ({exc})"
        msg = (
            f"{s.name} strategy: out of memory allocating {format_size(size)} ({size:,} bytes) "
            f"on device {device}{detail}; {cuda_has}; this strategy holds "
            f"{format_size(st.bytes_in_use)} in use in {format_count(st.n_live, 'allocation')} "
            f"(reserved {format_size(st.bytes_reserved)}, peak in use {format_size(st.peak_bytes_in_use)}"
            + (f", largest free block {format_size(st.largest_free_block)}"
               if st.largest_free_block is not None else "") + ")"
        )
        if isinstance(s.backend, _backends.RealBackend):
            msg += cupy_pool_hint(device)
        if s.oom_context is not None:
            try:
                msg += str(s.oom_context())
            except Exception:  # noqa: BLE001 - the context must not hide the error
                pass
        h = s.history
        if h is not None:  # a recording takes the event (PyTorch's "oom" trace entry)
            h.oom(size, device, free or 0)
        path = s.config.get("oom_snapshot")
        if path:  # the memory at the error, written before raising; a failure to write never hides the error
            try:
                write_oom_snapshot(self.strategy, path, s.history, size=size, device=device, reason=reason, message=msg,
                                   device_free=free)
            except Exception as exc:  # noqa: BLE001 - the out-of-memory error must still be raised
                msg += f"; the out-of-memory snapshot could not be written to {path!r}: {exc}"
                path = None
            else:
                msg += (f"; snapshot of the memory at this error: {path} (python -m cupy_memstrat export "
                        f"{path} -o oom.pickle opens it in PyTorch's memory viewer)")
        oom = out_of_memory_class()(
            msg, requested=size, device=device, stats=st, strategy=s.name, reason=reason, snapshot=path
        )
        raise oom from cause
