"""For a strategy whose ``bytes_reserved`` is what another allocator holds from
CUDA (``pool``: CuPy's pool's ``total_bytes()``; ``torch``: PyTorch's
``memory_reserved``): a part (``strategy.foreign``) that reads it at each
:meth:`~cupy_memstrat.Strategy.stats` and keeps the peak of those reads, per device."""

from __future__ import annotations

import threading
from dataclasses import replace

from ..stats import Stats

__all__ = ["ForeignReserve"]


class ForeignReserve:
    """The reserved bytes of another allocator, over ``n_devices`` devices.

    Args:
        n_devices: devices.
        read: ``read(device) -> int | None``: the bytes the other allocator holds on the
            device now, or None where there is no such allocator (the simulated GPU): the
            strategy's own counts then stand.
    """

    def __init__(self, n_devices: int, read):
        self._read = read
        self._peak = [0] * n_devices
        self._lock = threading.Lock()

    def adjust(self, st: Stats) -> Stats:
        """``st`` (the strategy's own statistics) with ``bytes_reserved`` what the other
        allocator holds, and ``peak_bytes_reserved`` the highest of those reads and of the
        peak in use."""
        reserved = self._read(st.device)
        if reserved is None:
            return st
        with self._lock:
            peak = max(self._peak[st.device], reserved, st.peak_bytes_in_use)
            self._peak[st.device] = peak
        return replace(st, bytes_reserved=reserved, peak_bytes_reserved=peak)

    def restart_peak(self, device: int) -> None:
        """The reserved peak of ``device`` starts again from what the other allocator holds now."""
        now = self._read(device)
        if now is not None:
            with self._lock:
                self._peak[device] = now
