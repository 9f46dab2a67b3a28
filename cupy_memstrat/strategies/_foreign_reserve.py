"""For a strategy whose ``bytes_reserved`` is what another allocator holds from
CUDA (``pool``: CuPy's pool's ``total_bytes()``; ``torch``: PyTorch's
``memory_reserved``): the reserved bytes read from it at each :meth:`stats`,
and the peak of those reads kept here, per device."""

from __future__ import annotations

import threading
from dataclasses import replace

from ..stats import Stats


class ForeignReserved:
    """A mixin before :class:`~cupy_memstrat.Strategy` in the bases; the
    strategy calls :meth:`_init_foreign_reserved` in ``__init__`` and defines
    ``_foreign_reserved(device) -> int | None`` (None: no such allocator here,
    e.g. on the simulated GPU, and the strategy's own counts stand)."""

    def _init_foreign_reserved(self, n_devices: int) -> None:
        self._peak_reserved = [0] * n_devices
        self._reserved_lock = threading.Lock()

    def _foreign_reserved(self, device: int) -> int | None:
        raise NotImplementedError

    def stats(self, device: int | None = None) -> Stats:
        """As :meth:`Strategy.stats`; ``bytes_reserved`` is what the other
        allocator holds on the device (the class docstring says which), and
        ``peak_bytes_reserved`` the highest of those reads and of the peak in use."""
        st = super().stats(device)
        reserved = self._foreign_reserved(st.device)
        if reserved is None:
            return st
        with self._reserved_lock:
            peak = max(self._peak_reserved[st.device], reserved, st.peak_bytes_in_use)
            self._peak_reserved[st.device] = peak
        return replace(st, bytes_reserved=reserved, peak_bytes_reserved=peak)

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """As :meth:`Strategy.reset_peak`; the reserved peak restarts from what
        the other allocator holds now."""
        d = self._device_or_current(device)
        super().reset_peak(d, reserved=reserved)
        now = self._foreign_reserved(d) if reserved else None
        if now is not None:
            with self._reserved_lock:
                self._peak_reserved[d] = now
