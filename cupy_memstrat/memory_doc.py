"""The memory document: what :func:`cupy_memstrat.snapshot` returns and the
``oom_snapshot`` option writes, as JSON-ready dicts (version 2).

A recording's events come from :class:`cupy_memstrat.history.History`; this
module knows only the document's layout, a strategy's memory now (its
statistics, live allocations and segments, read through its public methods) and
how the out-of-memory snapshot is written. It imports nothing above the
statistics, so a strategy's error path can write one.
"""

from __future__ import annotations

import json
import time

from .paths import write_file_atomically

__all__ = ["SNAPSHOT_KIND", "event_dict", "jsonable", "memory_now", "oom_document", "write_oom_snapshot"]

#: the ``kind`` of every memory document
SNAPSHOT_KIND = "memory-history"


def event_dict(dt_ns, action, ptr, size, device, stream, origin) -> dict:
    e = {"t": dt_ns / 1e9, "action": action, "ptr": ptr, "size": size, "device": device, "stream": stream,
         "origin": str(origin) if origin is not None else None}
    if origin is not None and origin.stack:
        e["frames"] = [list(f) for f in origin.stack]
    return e


def jsonable(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def memory_now(strategy) -> dict:
    """A version-2 snapshot of ``strategy``'s memory now, with no events (no recording)."""
    n = strategy.backend.device_count()
    return {
        "kind": SNAPSHOT_KIND, "version": 2, "devices": n,
        "strategy": {"name": strategy.name, "options": {k: jsonable(v) for k, v in strategy.config.items()}},
        "started": time.time(), "recording": False, "max_entries": 0, "dropped": 0,
        "baseline_bytes_in_use": [strategy.stats(d).bytes_in_use for d in range(n)], "events": [],
        "segment_kind": strategy.segment_kind, "segments": strategy.memory_segments(), "segment_events": [],
        "oom_events": [],
    }


def oom_document(strategy, history=None, *, size: int, device: int, reason: str, message: str,
                 device_free=None) -> dict:
    """The snapshot written at an out-of-memory error (the ``oom_snapshot``
    option): a version-2 snapshot (:meth:`History.as_dict` of ``history``,
    the strategy's recording if it is being recorded; else no events) with ``oom``: the
    request, the device, the reason, the error's message, ``stats`` per
    device and ``live`` (the live allocations, largest first, with origins
    and, with ``track_origins=N``, frames)."""
    if history is not None and history.enabled:
        doc = history.as_dict()
    else:
        doc = memory_now(strategy)
        doc["oom_events"] = [{"t": 0.0, "size": size, "device": device, "device_free": device_free or 0}]
    live = []
    for a in strategy.live_allocations():
        row = {"ptr": a.ptr, "size": a.size, "device": a.device, "origin": str(a.origin) if a.origin else None}
        if a.origin is not None and a.origin.stack:
            row["frames"] = [list(f) for f in a.origin.stack]
        live.append(row)
    doc["oom"] = {
        "requested_bytes": size, "device": device, "reason": reason, "message": message,
        "device_free_bytes": device_free, "time": time.time(),
        "stats": [strategy.stats(d).as_dict() for d in range(strategy.backend.device_count())],
        "live": live,
    }
    return doc


def write_oom_snapshot(strategy, path, history=None, **oom) -> None:
    """:func:`oom_document`, written as JSON to ``path``, whole or not at all
    (:func:`cupy_memstrat.paths.write_file_atomically`: two errors at once
    in two threads leave one of the two files, never a mix).

    Raises:
        OSError: ``path`` cannot be written.
    """
    write_file_atomically(path, json.dumps(oom_document(strategy, history, **oom)).encode())
