"""The statistics of :class:`~cupy_memstrat.strategies.base.Strategy`:
:meth:`stats`, the live tables read off the hot path, ``trim``, and the
per-device counters the hot path's events are folded into (``Strategy._fold``).

An internal module of :mod:`cupy_memstrat.strategies`: :class:`_StatisticsMixin`
is one of the classes ``Strategy`` is composed of (the live tables and
counters are set in ``Strategy.__init__``).
"""

from __future__ import annotations

import operator
from typing import ClassVar

from ..sizes import parse_size
from ..stats import Allocation, Stats
from ._layout import block, segment

__all__: list[str] = []


class _StatisticsMixin:
    """``Strategy``'s statistics, live tables and ``trim`` (no state of its own)."""

    # -- statistics ------------------------------------------------------------
    def _settle(self) -> None:
        """Before the statistics or the live table are read: account frees
        that a strategy sees only by looking (``pool``'s route ``"direct"``
        holds a block :func:`cupy_memstrat.record_stream` recorded until its
        arrays are gone). Nothing here."""

    def _hold_recorded(self, mem) -> None:
        """:func:`cupy_memstrat.record_stream` recorded a stream on the block
        of CuPy's memory object ``mem`` (this strategy's): a strategy whose
        memory objects are not its own may keep ``mem`` (``pool``'s route
        ``"direct"``). Nothing here."""

    def _stop_holding(self) -> None:
        """No longer CuPy's allocator (:func:`cupy_memstrat.use` installed
        another): let go of anything kept for :meth:`_hold_recorded`. Nothing
        here."""

    def _device_or_current(self, device):
        if device is None:
            return self.backend.get_device()
        if isinstance(device, bool) or not hasattr(device, "__index__"):
            raise TypeError(f"device: expected an int device ordinal, got {type(device).__name__} {device!r}")
        device = operator.index(device)
        n = self.backend.device_count()
        if not 0 <= device < n:
            raise ValueError(f"device: expected 0 <= device < {n}, got {device}")
        return device

    def _read_counters(self, device, read):
        """``(device, read(counters))``: ``device`` checked (default: current),
        the recorded events folded in, and ``read`` called on the device's
        counters under the fold lock, so that what it reads is one moment's."""
        device = self._device_or_current(device)
        self._settle()
        return device, self.accounts.read(device, read)

    def stats(self, device: int | None = None) -> Stats:
        """This strategy's :class:`~cupy_memstrat.Stats` for ``device``
        (default: CuPy's current device).

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        device, fields = self._read_counters(device, lambda c: dict(
            bytes_in_use=c.in_use,
            peak_bytes_in_use=c.peak_in_use,
            bytes_reserved=c.reserved,
            peak_bytes_reserved=c.peak_reserved,
            n_allocs=c.n_allocs,
            n_frees=c.n_frees,
            n_live=c.n_allocs - c.n_frees,
            n_failed=c.n_failed,
            n_invalid_frees=self.accounts.n_invalid_frees,
            n_oom_recoveries=c.n_oom_recoveries,
        ))
        if self.reserved_is_in_use:
            # nothing cached, but a block freed while a recorded stream still used it is CUDA's
            # memory until that stream's work is done (record_stream): reserved, not in use
            held = self.deferred.waiting_bytes(device)
            reserved = fields["bytes_in_use"] + held
            peak = self.accounts.note_reserved_seen(device, reserved)  # the highest seen at reads (reset_peak)
            fields["bytes_reserved"] = reserved
            fields["peak_bytes_reserved"] = max(fields["peak_bytes_in_use"], peak)
        return Stats(device=device, strategy=self.name, **fields)

    def in_use(self, device: int | None = None) -> tuple[int, int]:
        """``(bytes in use, peak bytes in use)`` on ``device`` (default:
        current), the two numbers of :meth:`stats` a per-task hook needs,
        without reading anything from CUDA (the Dask plugin reads them at
        every task's start and end).

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        return self._read_counters(device, lambda c: (c.in_use, c.peak_in_use))[1]

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """Set the peaks of ``device`` (default: current) to the present
        values: the peak in use, and with ``reserved`` (default) the peak
        reserved too (``reserved=False`` touches nothing in CUDA).

        Raises:
            TypeError: ``reserved`` is not True or False (nothing is reset).
            ValueError, TypeError: ``device`` is not a device ordinal.
        """
        if reserved is not True and reserved is not False:
            raise TypeError(f"reset_peak: reserved must be True or False, got {reserved!r}")
        device = self._device_or_current(device)
        self._settle()
        self.accounts.reset_peak(device, reserved)

    def live_allocations(self, device: int | None = None) -> list[Allocation]:
        """Live allocations, largest first, on ``device`` or on every device
        (default). ``origin`` is set when ``track_origins=True``."""
        if device is not None:
            device = self._device_or_current(device)
        self._settle()
        origins = self.accounts.origins
        rows = [
            Allocation(ptr=p, size=s, device=d, origin=origins.get(p))
            for d, live in enumerate(self.accounts.live)
            if device is None or d == device
            for p, s in list(live.items())
        ]
        rows.sort(key=lambda a: (-a.size, a.ptr))
        return rows

    #: how :meth:`memory_segments` maps this strategy's memory: ``"blocks"``,
    #: each live block is its own segment (what CUDA keeps behind a pool is
    #: not visible); ``"chunks"``, segments are the strategy's own chunks.
    segment_kind: ClassVar[str] = "blocks"

    def memory_segments(self, device: int | None = None) -> list[dict]:
        """The memory held on ``device`` (default: every device) as segments
        in the layout of PyTorch's memory snapshot (``torch.cuda.memory._snapshot()``;
        :func:`cupy_memstrat.snapshot` with ``format="torch"`` writes them).

        Each segment is a dict with ``device``, ``address``, ``total_size``
        (bytes), ``stream``, ``segment_type`` (``"small"`` up to 1 MiB, else
        ``"large"``), ``allocated_size``, ``active_size`` and ``blocks``,
        which tile the segment in address order: ``address``, ``size``,
        ``requested_size`` (bytes), ``state`` (``"active_allocated"`` or
        ``"inactive"``: free) and ``frames`` (``{"filename", "line",
        "name"}`` dicts, innermost first, when ``track_origins`` is on).
        Here each live block is its own segment (:attr:`segment_kind`
        ``"blocks"``): cached memory does not show. ``managed`` overrides it
        with its chunks.

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        devices = range(len(self.accounts.live)) if device is None else [self._device_or_current(device)]
        self._settle()
        origins = self.accounts.origins
        out = []
        for d in devices:
            for ptr, size in sorted(list(self.accounts.live[d].items())):
                blk = block(ptr, size, size, True, origins.get(ptr))
                out.append(segment(d, ptr, size, [blk]))
        return out

    def live_sizes(self, device: int | None = None) -> dict[int, int]:
        """A snapshot of the live allocations as ``{ptr: size in bytes}``, in
        allocation order, on ``device`` or on every device (default).

        Cheap (a dict copy per device: no sorting, no :class:`Allocation`
        rows, no origins): for code that compares the live set at two points,
        such as the pytest plugin's leak check. ``live_sizes().items() -
        before.items()`` are the allocations made in between that are still
        live (a block that reuses the address *and* size of one freed in
        between is indistinguishable from it)."""
        self._settle()
        return self.accounts.sizes(None if device is None else self._device_or_current(device))

    def _trim_devices(self, keep_bytes, device) -> list[tuple[int, int]]:
        """``[(device, bytes to keep)]`` for :meth:`trim`: every value checked
        before anything is released (``"N%"`` of each device's memory).

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = range(self.backend.device_count()) if device is None else [self._device_or_current(device)]
        out = []
        for d in devices:
            total = None
            if isinstance(keep_bytes, str) and keep_bytes.strip().endswith("%"):
                total = self.backend.device_properties(d)["total_memory"]
            out.append((d, parse_size(keep_bytes, total=total, what="keep_bytes")))
        return out

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give memory the strategy caches but does not use back to CUDA.

        A strategy that caches nothing (``reserved_is_in_use``, e.g.
        ``device``) has nothing to give back: this is a no-op that returns 0
        (the arguments are still checked). Caching strategies override it.

        Args:
            keep_bytes: bytes to keep cached (int, size string or ``"N%"``).
            device: a device ordinal, or ``None`` for every device.

        Returns:
            int: bytes given back to CUDA.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        if device is not None:
            self._device_or_current(device)
        parse_size(keep_bytes, total=100, what="keep_bytes")  # validated; nothing to keep
        self.deferred.flush()
        return 0
