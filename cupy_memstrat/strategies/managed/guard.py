"""The ``managed`` strategy's oversubscription guard.

Managed memory can be asked for beyond what the device holds; its pages then
move in and out of the device, and oversubscribed managed memory can hang a
shared GPU. The guard refuses new chunks that the device could not hold:
those chunks plus this strategy's chunks not yet resident must fit in the
device's free memory less a headroom. Before refusing it gives memory back in
CuPy's order (the strategies' caches, then again after ``gc.collect()``).
"""

from __future__ import annotations

import gc

from ...sizes import format_size

__all__ = ["OversubscriptionGuard"]


class OversubscriptionGuard:
    """The guard of ``strategy`` (its ``backend``, ``accounts`` and ``recovery`` are used).

    Args:
        strategy: the managed strategy.
        headroom: per device, bytes of device memory left free (the ``headroom`` option).
        enabled: False with ``oversubscribe=True``: nothing is refused.
    """

    def __init__(self, strategy, headroom: list[int], enabled: bool):
        self.strategy, self.headroom, self.enabled = strategy, headroom, enabled
        n = len(headroom)
        #: per device: managed bytes of this strategy's chunks
        self.reserved = [0] * n
        #: per device: allocations refused
        self.n_refused = [0] * n
        self._used0: list[int | None] = [None] * n  # device memory used by others, as last seen

    def check(self, nbytes: int, size: int, device: int) -> None:
        """Before ``nbytes`` of new chunks for a request of ``size`` bytes on ``device``.

        Raises:
            cupy_memstrat.OutOfMemoryError: the device could not hold them (reason
                ``"oversubscription_guard"``), after giving cached memory back and
                collecting garbage.
        """
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if not self.enabled:
            return
        s = self.strategy
        b = s.backend
        for attempt in (0, 1, 2):
            free, total = b.mem_get_info(device)
            used = total - free
            mine = self.reserved[device]
            if mine == 0 or self._used0[device] is None or used < self._used0[device]:
                # holding no chunk, every byte used is others' (exact); else someone gave
                # memory back: a lower baseline
                self._used0[device] = used
            resident = min(mine, max(0, used - self._used0[device]))
            need = nbytes + mine - resident
            room = free - self.headroom[device]
            if need <= room:
                if attempt:
                    s.accounts.count_recovery(device)
                return
            if attempt == 2 or nbytes > total - self.headroom[device]:
                break  # (more than the whole device could hold: nothing given back can help)
            if attempt == 1:
                gc.collect()
                gc.collect()
            s.recovery.give_back(device)
        self.n_refused[device] += 1
        s.accounts.count_failed(device)
        s.recovery.raise_out_of_memory(
            size,
            device,
            reason="oversubscription_guard",
            detail=(
                f": refused by the oversubscription guard: {format_size(nbytes)} of new managed chunks "
                f"plus {format_size(mine - resident)} of this strategy's chunks not yet resident need "
                f"{format_size(need)}, more than the device's {format_size(free)} free less "
                f"{format_size(self.headroom[device])} headroom (after giving cached memory back and "
                "collecting garbage); pass oversubscribe=True to allow oversubscription (pages then "
                "move in and out of the device)"
            ),
        )
