"""Memory timelines: record allocation and free events, write them as JSON, draw them.

``record_history()`` puts a recorder in front of the installed strategy: from then
on every allocation CuPy makes, and the free of each such block, is recorded with
its time, size, device, stream and origin into a bounded buffer; ``snapshot()``
returns (and writes) them as JSON; ``python -m cupy_memstrat plot SNAPSHOT.json -o
timeline.png`` draws the live memory over time, stacked by origin, as PyTorch's
memory visualiser does for its caching allocator.

What is and is not recorded:

* allocations through CuPy's allocator (arrays, ``cupy.cuda.alloc``) while
  recording is on, and later frees of those blocks; not ``raw_malloc`` calls;
* blocks allocated before recording began are in ``baseline_bytes_in_use``, not
  in the events, and their frees are not recorded (as in PyTorch's recorder);
* the recorder costs a Python frame, a clock read and, with ``origins=True``
  (the default), a stack walk per event: switch it off when done.
"""

from __future__ import annotations

import collections
import json
import operator
import os
import sys
import threading
import time

from .memory_doc import SNAPSHOT_KIND, event_dict, jsonable, memory_now
from .paths import check_writable_file, write_file_atomically
from .stats import capture_origin, origin_capture

__all__ = ["record_history", "recording", "snapshot", "History"]

_lock = threading.Lock()
_active: "History | None" = None  # the recording in progress
_last: "History | None" = None  # the last one that ended


class History:
    """The events of one recording: ``(t_ns, action, ptr, size, device,
    stream, origin)`` tuples in a deque of at most ``max_entries`` (the oldest
    are dropped, and counted in ``dropped``)."""

    def __init__(self, strategy, max_entries: int, origins: bool):
        self.strategy = strategy
        self.max_entries = max_entries
        self.origins = origins
        self.events: collections.deque = collections.deque(maxlen=max_entries)
        # (t_ns, action, ptr, size, device): the strategy's own segments made and given back
        # (managed's chunks), and (t_ns, size, device, device_free) for each out-of-memory error
        self.segment_events: collections.deque = collections.deque(maxlen=max_entries)
        self.oom_events: collections.deque = collections.deque(maxlen=max_entries)
        self.n_events = 0
        self.segments_at_end: list | None = None  # the strategy's segments when the recording ended
        self.enabled = True
        self.t0 = time.perf_counter_ns()
        self.started = time.time()
        n = strategy.backend.device_count()
        self.baseline = [strategy.stats(d).bytes_in_use for d in range(n)]
        self.previous_allocator = None
        self.allocator = None

    @property
    def recording(self) -> bool:
        """Whether events still arrive: the recording was not ended, and its
        recorder is still CuPy's allocator (``use()`` of another strategy
        replaces it, and then nothing more is recorded)."""
        if not self.enabled:
            return False
        import cupy

        return cupy.cuda.get_allocator() is self.allocator

    def segment(self, action: str, ptr: int, size: int, device: int) -> None:
        """From the strategy (off its hot path): ``"segment_alloc"`` /
        ``"segment_free"`` of ``size`` bytes at ``ptr``."""
        if self.enabled:
            self.segment_events.append((time.perf_counter_ns(), action, ptr, size, device))

    def oom(self, size: int, device: int, device_free: int) -> None:
        """From the strategy: an allocation of ``size`` bytes raises out of memory."""
        if self.enabled:
            self.oom_events.append((time.perf_counter_ns(), size, device, device_free))

    @property
    def dropped(self) -> int:
        """Events that no longer fit in the buffer (the oldest)."""
        return self.n_events - len(self.events)

    def as_dict(self) -> dict:
        """The snapshot: JSON-ready. ``events`` hold ``t`` in seconds since
        recording began, ``action`` ("alloc" / "free"), ``ptr``, ``size`` in
        bytes, ``device``, ``stream`` (the CUDA stream handle current at the
        event, or None), ``origin`` ("file:line in function", or None) and,
        for an allocation whose stack was recorded (``track_origins=N``),
        ``frames`` (``[file, line, function]``, innermost first).
        ``segments`` is the strategy's memory at the snapshot
        (:meth:`Strategy.memory_segments`, ``segment_kind`` says what a segment is),
        ``segment_events`` its segments made and given back while recording
        (``t``, ``action``, ``ptr``, ``size``, ``device``) and ``oom_events``
        its out-of-memory errors (``t``, ``size``, ``device``, ``device_free``)."""
        s = self.strategy
        t0 = self.t0
        return {
            "kind": SNAPSHOT_KIND,
            "version": 2,
            "devices": len(self.baseline),
            "strategy": {"name": s.name, "options": {k: jsonable(v) for k, v in s.config.items()}},
            "started": self.started,
            "recording": self.recording,
            "max_entries": self.max_entries,
            "dropped": self.dropped,
            "baseline_bytes_in_use": list(self.baseline),
            "events": [event_dict(t - t0, a, p, n, d, st, o) for t, a, p, n, d, st, o in list(self.events)],
            "segment_kind": s.segment_kind,
            # as the events left them: at the end of the recording, or now while it goes on
            "segments": self.segments_at_end if self.segments_at_end is not None else s.memory_segments(),
            "segment_events": [{"t": (t - t0) / 1e9, "action": a, "ptr": p, "size": n, "device": d}
                               for t, a, p, n, d in list(self.segment_events)],
            "oom_events": [{"t": (t - t0) / 1e9, "size": n, "device": d, "device_free": f}
                           for t, n, d, f in list(self.oom_events)],
        }


class _RecordingAllocator:
    """The allocator installed while recording: CuPy's malloc over the
    recorder's hot path. ``_memstrat_strategy`` lets ``current()`` see the
    strategy behind it."""

    __slots__ = ("_malloc", "_memstrat_strategy", "_keep")

    def __init__(self, malloc, strategy, keep):
        self._malloc, self._memstrat_strategy, self._keep = malloc, strategy, keep

    def __call__(self, size):
        return self._malloc(size)


def _recording_allocator(strategy, h: History) -> _RecordingAllocator:
    from .strategies.cupy_route import cupy_malloc_over

    malloc, free = strategy.hot_path_functions()
    events, clock, origins, live = h.events, time.perf_counter_ns, h.origins, strategy.accounts.live
    # the strategy's track_origins=N frames (as configured: the checking layer tracks one frame
    # on its own whatever it was given), else one
    capture = origin_capture(strategy.config.get("track_origins")) or capture_origin
    stream_of = getattr(strategy.backend, "current_stream", None)

    def stream(device):
        try:
            return stream_of(device).ptr if stream_of is not None else None
        except Exception:  # noqa: BLE001 - a recorder must not fail an allocation
            return None

    def rec_malloc(size, device):
        ptr = malloc(size, device)
        if h.enabled:
            h.n_events += 1
            events.append((clock(), "alloc", ptr, size, device, stream(device),
                           capture(1) if origins else None))
        return ptr

    def rec_free(ptr, device, stacklevel=1):
        size = None
        if h.enabled:
            d = device if type(device) is int and 0 <= device < len(live) else None
            size = live[d].get(ptr) if d is not None else None
        free(ptr, device, stacklevel + 1)
        if size is not None and h.enabled:
            h.n_events += 1
            events.append((clock(), "free", ptr, size, device, stream(device), None))

    cupy_malloc, pfa, _ = cupy_malloc_over(strategy.backend, rec_malloc, rec_free, strategy.block_granule)
    return _RecordingAllocator(cupy_malloc, strategy, pfa)


def record_history(enabled: bool = True, *, max_entries: int = 100_000, origins: bool = True,
                   strategy=None) -> History | None:
    """Start (or stop) recording the allocation and free events of the
    installed strategy (see the module docstring for what is recorded).

    Args:
        enabled: True starts a new recording (ending one in progress); False
            ends it and puts the strategy's own allocator back.
        max_entries: events kept, the newest (int >= 1).
        origins: record where each allocation came from (a stack walk per
            allocation).
        strategy: the strategy to record (default: :func:`cupy_memstrat.current`).
            It becomes CuPy's process-wide allocator while recording; the
            allocator before it is put back when the recording ends.
            Installing another allocator meanwhile (``use()``) ends the
            events: ``snapshot()["recording"]`` then says False.

    Returns:
        The :class:`History` being recorded, or (``enabled=False``) the one
        that ended, or None if none was running.

    Raises:
        TypeError, ValueError: a bad ``enabled`` or ``origins`` (not True / False),
            ``max_entries`` (not an int >= 1) or ``strategy`` (not a
            Strategy object).
        NoStrategyError: no strategy is installed and none was given.
        RuntimeError: called inside :func:`cupy_memstrat.using` (CuPy
            forbids changing the process-wide allocator there).
        Nothing changes when it raises: a recording in progress goes on.
    """
    global _active, _last
    import cupy

    from . import api
    from .strategies.base import Strategy

    # Everything is checked first: a bad call leaves a recording in progress as it was.
    if not isinstance(enabled, bool):
        if isinstance(enabled, int) and enabled in (0, 1):
            enabled = bool(enabled)
        elif type(enabled).__name__ in ("bool_", "bool") and type(enabled).__module__ == "numpy":  # numpy.bool
            enabled = bool(enabled)
        else:
            raise TypeError(f"enabled: expected True or False, got {type(enabled).__name__} {enabled!r}")
    if not isinstance(origins, bool) and not (type(origins).__name__ in ("bool_", "bool")
                                              and type(origins).__module__ == "numpy"):
        raise TypeError(f"origins: expected True or False, got {type(origins).__name__} {origins!r}")
    origins = bool(origins)
    if enabled:
        if isinstance(max_entries, bool) or not hasattr(max_entries, "__index__"):
            raise TypeError(f"max_entries: expected an int >= 1, got {type(max_entries).__name__} {max_entries!r}")
        max_entries = operator.index(max_entries)
        if max_entries < 1:
            raise ValueError(f"max_entries: expected an int >= 1, got {max_entries}")
        if max_entries > sys.maxsize:
            raise ValueError(f"max_entries: expected an int >= 1 and at most {sys.maxsize}, got {max_entries}")
        if strategy is None:
            api.require_current()
        elif not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy: expected a cupy_memstrat.Strategy object (or None: the installed one), got "
                f"{type(strategy).__name__} {strategy!r}; to record a strategy by name, use() it first"
            )
    thread_local = getattr(cupy.cuda.memory, "_get_thread_local_allocator", lambda: None)
    if thread_local() is not None and (enabled or _active is not None):
        # CuPy forbids set_allocator inside using_allocator in the same thread: the recorder
        # could be neither installed nor taken out again
        raise RuntimeError(
            "cupy_memstrat.record_history() swaps CuPy's process-wide allocator, which CuPy forbids inside "
            "cupy_memstrat.using() / cupy.cuda.using_allocator() in the same thread; start and stop the "
            "recording outside the block (nothing was changed)"
        )
    with _lock:
        h = _active
        if h is not None:
            h.segments_at_end = h.strategy.memory_segments()  # what the last events left
            h.enabled = False
            if h.strategy.history is h:
                h.strategy.history = None
            if cupy.cuda.get_allocator() is h.allocator:
                cupy.cuda.set_allocator(h.previous_allocator)
            _active, _last = None, h
        if not enabled:
            return h
        s = strategy if strategy is not None else api.require_current()
        h = History(s, max_entries, bool(origins))
        h.previous_allocator = cupy.cuda.get_allocator()  # put back when the recording ends
        h.allocator = _recording_allocator(s, h)
        cupy.cuda.set_allocator(h.allocator)
        api.log_install(s, "record_history")
        s.history = h  # segment and out-of-memory events
        _active = h
        return h


def recording() -> History | None:
    """The :class:`History` being recorded (:func:`record_history`), or None."""
    return _active


def snapshot(path: str | None = None, format: str | None = None, *, strategy=None) -> dict:
    """The current (or last) recording as a dict (:meth:`History.as_dict`);
    with ``path``, also written there as JSON, which ``python -m cupy_memstrat
    plot PATH -o timeline.png`` draws. With no recording in this process, the
    memory now of ``strategy`` (default: the installed one): its segments, no events.

    With ``format="torch"``: the same in the layout of PyTorch's memory
    snapshot (``torch.cuda.memory._snapshot()``, see
    :mod:`cupy_memstrat.memory_viz`), written to ``path`` as a pickle that
    PyTorch's viewer (pytorch.org/memory_viz, ``python -m
    torch.cuda._memory_viz trace_plot``) reads. ``format=None`` (the
    default) takes ``"torch"`` for a path ending in ``.pickle`` or ``.pkl``,
    else ``"json"``.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike (an int is refused:
            ``open`` would take it as a file descriptor).
        ValueError: ``format`` is not ``"json"``, ``"torch"`` or None;
            ``path`` is empty, or names a directory, a FIFO, a socket or a
            device (checked before anything is written).
        TypeError: ``strategy`` is not a :class:`~cupy_memstrat.Strategy`.
        RuntimeError: nothing was ever recorded in this process and no
            strategy is installed (or given).
        OSError: ``path`` cannot be written (``FileNotFoundError``: its folder does not exist).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        # (an int would be taken as a file descriptor, and closed)
        raise TypeError(f"path: expected a file path (str or os.PathLike) or None, got {type(path).__name__} {path!r}")
    if format is None:
        name = os.path.basename(os.fsdecode(os.fspath(path))).lower() if path is not None else ""
        format = "torch" if name.endswith((".pickle", ".pkl")) else "json"
    if format not in ("json", "torch"):
        raise ValueError(f"format: expected 'json' or 'torch' (PyTorch's memory viewer), got {format!r}")
    from .strategies.base import Strategy

    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy: expected a cupy_memstrat.Strategy, got {type(strategy).__name__} {strategy!r}")
    h = _active or _last
    if h is None and strategy is None:
        from . import api

        strategy = api.current()
        if strategy is None:
            raise RuntimeError("no memory history and no strategy installed: call cupy_memstrat.use() (and "
                               "cupy_memstrat.record_history() for the events) first")
    if path is not None:
        check_writable_file(path)
    doc = h.as_dict() if h is not None else memory_now(strategy)
    if format == "torch":
        from .memory_viz import to_torch, write_torch

        if path is not None:
            write_torch(doc, path)
        return to_torch(doc)
    if path is not None:
        write_file_atomically(path, json.dumps(doc).encode())
    return doc
