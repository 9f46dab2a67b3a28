"""Export a memory snapshot to PyTorch's memory viewer.

PyTorch's viewer (https://pytorch.org/memory_viz, and ``python -m
torch.cuda._memory_viz trace_plot / segment_plot``) reads a pickle of plain
dicts: the snapshot ``torch.cuda.memory._snapshot()`` returns. Its fields are
the ``Snapshot``, ``Segment``, ``Block``, ``Frame`` and ``TraceEntry``
TypedDicts of ``torch/cuda/memory.py``:

* ``segments``: the memory held at the snapshot, one dict per segment
  (``device``, ``address``, ``total_size``, ``stream``, ``segment_type``,
  ``allocated_size``, ``active_size``, ``blocks``); the blocks tile the
  segment in address order (``address``, ``size``, ``requested_size``,
  ``state``, ``frames``). See :meth:`Strategy.memory_segments`.
* ``device_traces``: one list per device of what happened while recording,
  oldest first: ``alloc``, ``free_requested`` and ``free_completed`` (a free
  here completes at once: the block goes back to its stream's cache),
  ``segment_alloc`` / ``segment_free`` (memory taken from and given back to
  CUDA) and ``oom``, each with ``addr``, ``size``, ``stream``, ``frames`` and
  ``time_us`` (microseconds since the epoch; ``oom`` has ``device_free``
  instead of ``addr``).

For strategies whose segments are their blocks (``segment_kind ==
"blocks"``: ``device``, ``async``, ``pool``), each allocation is written as
its own ``segment_alloc`` and each free as its ``segment_free``, so the
viewer's segment view is consistent; what a pool caches behind them is not
visible. ``managed`` writes its 2 MiB chunks as segments, and their creation
and release as segment events.

:func:`to_torch` turns a :func:`cupy_memstrat.snapshot` (the JSON, version 2)
into that dict; ``snapshot(path, format="torch")`` and ``python -m
cupy_memstrat export SNAPSHOT.json -o SNAPSHOT.pickle`` write it (pickle
protocol 4).
"""

from __future__ import annotations

import pickle

__all__ = ["to_torch", "write_torch", "PICKLE_PROTOCOL"]

#: the pickle protocol written (PyTorch writes its snapshots with the default; 4 reads on Python >= 3.4)
PICKLE_PROTOCOL = 4

_ORDER = {"segment_alloc": 0, "oom": 1, "alloc": 2, "free": 3, "segment_free": 4}


def _frames_of_event(e: dict) -> list[dict]:
    frames = e.get("frames")
    if isinstance(frames, list) and frames:
        return [{"filename": str(f[0]), "line": int(f[1]), "name": str(f[2])} for f in frames]
    origin = e.get("origin")
    if isinstance(origin, str) and " in " in origin:  # "file:line in function"
        where, name = origin.rsplit(" in ", 1)
        file, _, line = where.rpartition(":")
        if file and line.isdigit():
            return [{"filename": file, "line": int(line), "name": name}]
    return []


_MAX_DEVICES = 1024
_MAX_TIME = 1e11  # seconds (about the year 5000): a larger time is a mangled one


class _Bad(ValueError):
    pass


def _need(e: dict, key: str, where: str):
    if key not in e:
        raise _Bad(f"not a valid snapshot: {where} lacks {key!r}")
    return e[key]


def _whole(x, where: str, most: int | None = (1 << 64) - 1) -> None:
    if type(x) is not int or x < 0 or (most is not None and x > most):
        limit = f" and at most {most}" if most is not None and most < (1 << 64) - 1 else " (at most 64 bits)"
        raise _Bad(f"not a valid snapshot: {where} is {x!r}: expected a whole number >= 0{limit}")


def _time(x, where: str) -> None:
    if type(x) not in (int, float) or not 0 <= x < _MAX_TIME:  # (NaN fails too)
        raise _Bad(f"not a valid snapshot: {where} is {x!r}: expected seconds, a number >= 0")


def _listed(doc: dict, key: str) -> list:
    v = _need(doc, key, "the snapshot")
    if not isinstance(v, list) or not all(isinstance(e, dict) for e in v):
        raise _Bad(f"not a valid snapshot: {key!r} is not a list of objects")
    return v


def _check(doc) -> None:
    """Refuse, naming the first bad field, anything but a well-formed version-2 snapshot."""
    if not isinstance(doc, dict) or doc.get("kind") != "memory-history":
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"expected a cupy_memstrat.snapshot() (kind 'memory-history'), got {kind!r}")
    version = doc.get("version")
    if type(version) is not int or version != 2:
        raise ValueError(
            f"this snapshot is version {version!r}; PyTorch's viewer needs version 2 (segments and segment "
            "events), which this cupy-memstrat writes: record it again"
        )
    n = _need(doc, "devices", "the snapshot")
    _whole(n, "'devices'", _MAX_DEVICES)
    if n < 1:
        raise _Bad("not a valid snapshot: 'devices' is 0: expected at least 1")
    _time(_need(doc, "started", "the snapshot"), "'started'")
    if doc.get("segment_kind") not in ("blocks", "chunks"):
        raise _Bad(f"not a valid snapshot: 'segment_kind' is {doc.get('segment_kind')!r}: "
                   "expected 'blocks' or 'chunks'")
    for key, actions in (("events", ("alloc", "free")), ("segment_events", ("segment_alloc", "segment_free")),
                         ("oom_events", None)):
        for i, e in enumerate(_listed(doc, key)):
            where = f"{key}[{i}]"
            _time(_need(e, "t", where), f"{where}.t")
            _whole(_need(e, "device", where), f"{where}.device", n - 1)
            _whole(_need(e, "size", where), f"{where}.size")
            if actions is None:
                free = e.get("device_free", 0)
                _whole(free if free is not None else 0, f"{where}.device_free")
                continue
            if _need(e, "action", where) not in actions:
                raise _Bad(f"not a valid snapshot: {where}.action is {e['action']!r}: expected one of "
                           f"{', '.join(actions)}")
            _whole(_need(e, "ptr", where), f"{where}.ptr")
            stream = e.get("stream")
            if stream is not None and type(stream) is not int:
                raise _Bad(f"not a valid snapshot: {where}.stream is {stream!r}: expected a stream handle or null")
            frames = e.get("frames")
            if frames is not None and not (isinstance(frames, list) and all(
                    isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and type(f[1]) is int
                    and isinstance(f[2], str) for f in frames)):
                raise _Bad(f"not a valid snapshot: {where}.frames: expected [file, line, function] lists")
    for i, seg in enumerate(_listed(doc, "segments")):
        where = f"segments[{i}]"
        _whole(_need(seg, "device", where), f"{where}.device", n - 1)
        for key in ("address", "total_size"):
            _whole(_need(seg, key, where), f"{where}.{key}")
        for key in ("allocated_size", "active_size"):
            if key in seg:
                _whole(seg[key], f"{where}.{key}")
        stream = seg.get("stream", 0)
        if type(stream) is not int:
            raise _Bad(f"not a valid snapshot: {where}.stream is {stream!r}: expected a stream handle")
        if seg.get("segment_type", "large") not in ("small", "large"):
            raise _Bad(f"not a valid snapshot: {where}.segment_type is {seg['segment_type']!r}: expected 'small' or "
                       "'large'")
        blocks = _need(seg, "blocks", where)
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise _Bad(f"not a valid snapshot: {where}.blocks is not a list of objects")
        for j, b in enumerate(blocks):
            bw = f"{where}.blocks[{j}]"
            for key in ("address", "size", "requested_size"):
                _whole(_need(b, key, bw), f"{bw}.{key}")
            if _need(b, "state", bw) not in ("active_allocated", "inactive"):
                raise _Bad(f"not a valid snapshot: {bw}.state is {b['state']!r}: expected 'active_allocated' or "
                           "'inactive'")
            frames = b.get("frames", [])
            if not (isinstance(frames, list) and all(
                    isinstance(f, dict) and isinstance(f.get("filename"), str) and type(f.get("line")) is int
                    and isinstance(f.get("name"), str) for f in frames)):
                raise _Bad(f"not a valid snapshot: {bw}.frames: expected {{filename, line, name}} objects")


def to_torch(doc: dict) -> dict:
    """The snapshot ``doc`` (:func:`cupy_memstrat.snapshot`'s dict, or its
    JSON loaded) in the layout of ``torch.cuda.memory._snapshot()``: a dict
    with ``segments`` and ``device_traces`` (see the module docstring).

    Raises:
        ValueError: ``doc`` is not a well-formed version-2 snapshot (the
            message names what it is, or the first bad field).
    """
    _check(doc)
    n = int(doc["devices"])
    t0 = float(doc["started"])
    per_block = doc["segment_kind"] == "blocks"
    rows = []  # (t, order, i, device, entry)
    for i, e in enumerate(doc["events"]):
        act = e["action"]
        rows.append((e["t"], _ORDER["alloc" if act == "alloc" else "free"], i, e["device"], e))
    for i, e in enumerate(doc["segment_events"]):
        rows.append((e["t"], _ORDER[e["action"]], i, e["device"], e))
    for i, e in enumerate(doc["oom_events"]):
        rows.append((e["t"], _ORDER["oom"], i, e["device"], dict(e, action="oom")))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    traces: list[list[dict]] = [[] for _ in range(n)]
    for t, _, _, d, e in rows:
        if not (isinstance(d, int) and 0 <= d < n):
            continue
        trace = traces[d]
        time_us = int((t0 + t) * 1e6)
        act = e["action"]
        if act == "oom":
            trace.append({"action": "oom", "size": e["size"], "device_free": e.get("device_free", 0),
                          "stream": 0, "frames": [], "time_us": time_us})
            continue
        common = {"addr": e["ptr"], "size": e["size"], "stream": e.get("stream") or 0, "time_us": time_us}
        if act in ("segment_alloc", "segment_free"):
            trace.append(dict(common, action=act, frames=[]))
        elif act == "alloc":
            frames = _frames_of_event(e)
            if per_block:
                trace.append(dict(common, action="segment_alloc", frames=frames))
            trace.append(dict(common, action="alloc", frames=frames))
        else:
            trace.append(dict(common, action="free_requested", frames=[]))
            trace.append(dict(common, action="free_completed", frames=[]))
            if per_block:
                trace.append(dict(common, action="segment_free", frames=[]))
    segments = []
    for seg in doc["segments"]:
        blocks = [dict(b) for b in seg["blocks"]]
        for b in blocks:
            b["frames"] = [dict(f) for f in b.get("frames") or []]
        segments.append(dict(seg, blocks=blocks))
    return {"segments": segments, "device_traces": traces}


def write_torch(doc: dict, path) -> None:
    """:func:`to_torch` of ``doc``, pickled (protocol 4) into ``path``.

    The file is written whole or not at all (a temporary file beside it,
    renamed over it).

    Raises:
        ValueError: as :func:`to_torch`.
        OSError: ``path`` cannot be written (the message names it).
    """
    from .paths import write_file_atomically

    write_file_atomically(path, pickle.dumps(to_torch(doc), protocol=PICKLE_PROTOCOL))
