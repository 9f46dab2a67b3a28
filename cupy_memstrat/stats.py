"""The statistics record every strategy keeps, and the live-allocation table's rows."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import asdict, dataclass, field

from .sizes import format_count, format_size

__all__ = ["Stats", "Record", "Allocation", "Origin", "capture_origin", "capture_stack", "origin_capture", "MAX_FRAMES"]

#: the most frames ``track_origins=N`` keeps per allocation
MAX_FRAMES = 128


class Record:
    """What the package's dataclass records share (:class:`Stats`, :class:`Allocation`,
    :class:`Origin`, ``PoolStats``, ``ManagedStats``, :class:`~cupy_memstrat.faults.FaultCounts`):
    :meth:`as_dict`."""

    def as_dict(self) -> dict:
        """The record's fields as a dict (nested records too): JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class Stats(Record):
    """One strategy's memory statistics for one device. Sizes in bytes.

    Attributes:
        device: CUDA device ordinal.
        strategy: the strategy's name.
        bytes_in_use: bytes of live allocations, as CuPy sees them
            (``memptr.mem.size``): rounded up to a multiple of 512 by the
            pooling strategies, as CuPy's pool rounds; as requested by
            ``device``.
        peak_bytes_in_use: highest ``bytes_in_use`` since creation or the last
            :meth:`~cupy_memstrat.Strategy.reset_peak`.
        bytes_reserved: bytes the strategy holds from CUDA (in use + cached).
            For ``device`` it equals ``bytes_in_use``: nothing is cached.
        peak_bytes_reserved: highest ``bytes_reserved``, reset likewise.
        n_allocs, n_frees: successful allocations and frees of non-empty blocks.
        n_live: allocations not yet freed (``n_allocs - n_frees``).
        n_failed: allocation requests that raised (``OutOfMemoryError``, or
            the CUDA error of a failure other than out of memory).
        n_invalid_frees: frees of pointers the strategy did not own (unknown
            or already freed); each was warned about and ignored.
        n_oom_recoveries: allocations that CUDA (or the managed guard) first
            refused and that succeeded after the strategy gave cached memory
            back and ran the garbage collector (CuPy's pool's order; see
            docs/streams.md).
        largest_free_block: bytes of the largest free block the strategy
            holds: the largest request it can serve without asking CUDA for
            more memory (on the stream the block belongs to). 0 where nothing
            is cached (``device``); ``None`` where the memory behind the
            strategy does not tell (CUDA's stream-ordered pool, CuPy's pool,
            RMM and PyTorch keep their free lists to themselves), never a guess.
        bytes_cached: ``bytes_reserved - bytes_in_use``: reserved but not in
            use (free blocks, and blocks waiting for a stream or a check);
            computed, not passed.
    """

    device: int
    strategy: str
    bytes_in_use: int = 0
    peak_bytes_in_use: int = 0
    bytes_reserved: int = 0
    peak_bytes_reserved: int = 0
    n_allocs: int = 0
    n_frees: int = 0
    n_live: int = 0
    n_failed: int = 0
    n_invalid_frees: int = 0
    n_oom_recoveries: int = 0
    largest_free_block: int | None = None
    bytes_cached: int = field(init=False, default=0)

    def __post_init__(self):
        object.__setattr__(self, "bytes_cached", max(0, self.bytes_reserved - self.bytes_in_use))

    def fragmentation(self) -> str:
        """"reserved 30.0 GiB, in use 18.0 GiB, largest free block 1.5 GiB": the
        three figures that tell whether the memory held is usable (the largest
        free block left out where unknown)."""
        out = f"reserved {format_size(self.bytes_reserved)}, in use {format_size(self.bytes_in_use)}"
        if self.largest_free_block is not None:
            out += f", largest free block {format_size(self.largest_free_block)}"
        return out

    def __str__(self) -> str:
        """One line for a log: in use and reserved with their peaks, the largest free block where
        known, then the counts; invalid frees and recoveries from out of memory only where there
        were any."""
        return (
            f"{self.strategy} on device {self.device}: "
            f"in use {format_size(self.bytes_in_use)} (peak {format_size(self.peak_bytes_in_use)}), "
            f"reserved {format_size(self.bytes_reserved)} (peak {format_size(self.peak_bytes_reserved)}), "
            + (f"largest free block {format_size(self.largest_free_block)}, "
               if self.largest_free_block is not None else "")
            + f"{self.n_live} live, {format_count(self.n_allocs, 'alloc')}, "
            f"{format_count(self.n_frees, 'free')}, "
            f"{self.n_failed} failed"
            + (f", {self.n_invalid_frees} invalid frees" if self.n_invalid_frees else "")
            + (f", {self.n_oom_recoveries} recovered from out of memory" if self.n_oom_recoveries else "")
        )


@dataclass(frozen=True)
class Origin(Record):
    """Where an allocation was requested: the first Python frame outside CuPy
    and cupy_memstrat (``filename``, ``lineno``, ``function``), and with
    ``track_origins=N`` (N > 1) the stack: up to N such frames, innermost
    first, as ``(filename, lineno, function)`` tuples (empty for one frame).
    Allocations made from the same stack share one ``Origin`` object."""

    filename: str
    lineno: int
    function: str
    stack: tuple = ()

    @property
    def frames(self) -> tuple:
        """The frames, innermost first: ``stack``, or the one frame."""
        return self.stack or ((self.filename, self.lineno, self.function),)

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


@dataclass(frozen=True)
class Allocation(Record):
    """One live allocation. ``size`` in bytes; ``origin`` is ``None`` unless the
    strategy was created with ``track_origins=True``."""

    ptr: int
    size: int
    device: int
    origin: Origin | None = None

    def __str__(self) -> str:
        where = f" at {self.origin}" if self.origin else ""
        return f"{format_size(self.size)} on device {self.device} (0x{self.ptr:x}){where}"


_skip_prefixes: tuple[str, ...] | None = None


def _skipped_prefixes() -> tuple[str, ...]:
    global _skip_prefixes
    if _skip_prefixes is None:
        prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
        for name in ("cupy", "cupyx", "cupy_backends"):
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "__file__", None):
                prefixes.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
        if "cupy" in sys.modules:  # only cache once CuPy's location is known
            _skip_prefixes = tuple(prefixes)
        return tuple(prefixes)
    return _skip_prefixes


def capture_origin(skip: int = 1) -> Origin | None:
    """The first frame, above ``skip`` frames, whose file is outside CuPy and
    cupy_memstrat; ``None`` if every frame is inside them. Costs a few
    microseconds: used only when ``track_origins=True``."""
    prefixes = _skipped_prefixes()
    f = sys._getframe(skip + 1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(prefixes):
            return Origin(fn, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None


_interned: dict[tuple, Origin] = {}
_INTERN_MAX = 1 << 16  # distinct stacks kept for sharing; beyond it each allocation has its own


def capture_stack(skip: int = 1, depth: int = 8) -> Origin | None:
    """Up to ``depth`` frames, above ``skip`` frames, whose files are outside
    CuPy and cupy_memstrat, innermost first (``Origin.stack``); ``None`` if
    there is none. Repeated stacks give the same ``Origin`` object, so memory
    for origins grows with the distinct stacks (at most 65 536 shared), not
    with the allocations. Used when ``track_origins`` is a number of frames."""
    prefixes = _skipped_prefixes()
    f = sys._getframe(skip + 1)
    frames = []
    while f is not None:
        code = f.f_code
        if not code.co_filename.startswith(prefixes):
            frames.append((code.co_filename, f.f_lineno, code.co_name))
            if len(frames) == depth:
                break
        f = f.f_back
    if not frames:
        return None
    key = tuple(frames)
    origin = _interned.get(key)
    if origin is None:
        origin = Origin(*frames[0], stack=key)
        if len(_interned) < _INTERN_MAX:
            origin = _interned.setdefault(key, origin)
    return origin


def origin_capture(track):
    """The function a hot path calls as ``capture(skip)`` for the option
    ``track_origins=track`` (``True`` or 1: the first frame; N: N frames),
    or None when it is off."""
    if not track:
        return None
    if track is True or track == 1:
        return capture_origin
    return functools.partial(capture_stack, depth=int(track))
