"""Allocation traces: a program's allocations and frees, in order, with their sizes, devices and
streams, read whole and checked before anything is replayed (:mod:`cupy_memstrat.replay`).

Three inputs are read:

* a recording of :func:`cupy_memstrat.record_history` (``snapshot(PATH)``'s JSON);
* a report of the pytest plugin (``pytest --gpumem-history --gpumem-json PATH``): the timelines
  of its tests, one after another, or of the one ``test`` names;
* an RMM log (``rmm.mr.LoggingResourceAdaptor``'s CSV: ``Thread,Time,Action,Pointer,Size,Stream``,
  actions ``allocate``, ``free`` and ``allocate failure``, which is skipped).

No CUDA and no CuPy here: a trace is numbers. :class:`TraceError` names the file and the line
or event that is wrong.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

from .errors import MemstratError
from .sizes import format_size

__all__ = ["Trace", "TraceError", "read_trace", "trace_from_events"]

ALLOC, FREE = 0, 1
_RMM_HEADER = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]


class TraceError(MemstratError, ValueError):
    """A trace that cannot be replayed: not a trace, truncated, or inconsistent (a free of a
    block never allocated, a pointer allocated twice). The message names the file and the line
    or event."""


@dataclass
class Trace:
    """A program's allocations and frees in the order it made them.

    Attributes:
        events: ``(op, block, size, device, stream)`` tuples; ``op`` is ``ALLOC`` (0) or
            ``FREE`` (1), ``block`` numbers the allocation (a free names the allocation it
            ends), ``size`` in bytes, ``device`` the CUDA ordinal, ``stream`` an index into
            :attr:`streams`.
        streams: the recorded stream handles, in order of first use (``None``: unknown; 0, 1
            and 2: the default streams).
        source: where the trace was read from, for messages.
        where: for each event, where it stands in the source (``"line 12"``, ``"event 7"``).
        recorded_with: the strategy the recording was made with (its name), if known.
    """

    events: list = field(default_factory=list)
    streams: list = field(default_factory=list)
    source: str = "<events>"
    where: list = field(default_factory=list)
    recorded_with: str | None = None

    @property
    def n_allocs(self) -> int:
        return sum(1 for e in self.events if e[0] == ALLOC)

    @property
    def devices(self) -> list[int]:
        """The device ordinals the trace uses, sorted."""
        return sorted({e[3] for e in self.events})

    def largest(self) -> tuple[int, int]:
        """``(size, event index)`` of the largest allocation (``(0, -1)``: none)."""
        best, at = 0, -1
        for i, e in enumerate(self.events):
            if e[0] == ALLOC and e[2] > best:
                best, at = e[2], i
        return best, at

    def peak_in_use(self, device: int | None = None) -> int:
        """The highest sum of live sizes (bytes) over the trace, on ``device`` or on all."""
        live = peak = 0
        for op, _, size, dev, _ in self.events:
            if device is not None and dev != device:
                continue
            live += size if op == ALLOC else -size
            peak = max(peak, live)
        return peak

    def describe(self, index: int) -> str:
        """Where event ``index`` stands: ``"trace.json, event 12"``."""
        return f"{self.source}, {self.where[index] if index < len(self.where) else f'event {index}'}"


class _Builder:
    """Events checked as they are added: a free must end a live block of the same device."""

    def __init__(self, source: str, recorded_with: str | None = None):
        self.trace = Trace(source=source, recorded_with=recorded_with)
        self.live: dict[tuple[int, int], tuple[int, int]] = {}  # (device, ptr) -> (block, size)
        self.stream_index: dict = {}
        self.n_blocks = 0

    def _stream(self, handle) -> int:
        i = self.stream_index.get(handle)
        if i is None:
            i = self.stream_index[handle] = len(self.trace.streams)
            self.trace.streams.append(handle)
        return i

    def fail(self, where: str, why: str):
        raise TraceError(f"{self.trace.source}, {where}: {why}")

    def alloc(self, ptr: int, size: int, device: int, stream, where: str) -> None:
        if (device, ptr) in self.live:
            self.fail(where, f"0x{ptr:x} is allocated again on device {device} while still live "
                             f"(allocated at {self.trace.where[self.live[device, ptr][2]]}); a trace "
                             "records each block's free before its pointer is handed out again")
        self.live[device, ptr] = (self.n_blocks, size, len(self.trace.events))
        self.trace.events.append((ALLOC, self.n_blocks, size, device, self._stream(stream)))
        self.trace.where.append(where)
        self.n_blocks += 1

    def free(self, ptr: int, size: int | None, device: int, stream, where: str) -> None:
        got = self.live.pop((device, ptr), None)
        if got is None:
            self.fail(where, f"a free of 0x{ptr:x} on device {device}, which the trace never allocated "
                             "(or freed already): the trace does not start at the program's start, or "
                             "it is not whole")
        block, alloc_size, _ = got
        if size is not None and size != alloc_size:
            self.fail(where, f"the free of 0x{ptr:x} gives {size:,} bytes, its allocation {alloc_size:,}")
        self.trace.events.append((FREE, block, alloc_size, device, self._stream(stream)))
        self.trace.where.append(where)


def _int(value, what: str, where: str, b: _Builder, *, base: int = 10, minimum: int = 0) -> int:
    if isinstance(value, bool) or value is None:
        b.fail(where, f"{what}: expected an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        if not text.isascii() or "_" in text:  # int() takes "1_024" and other scripts' digits
            b.fail(where, f"{what}: expected an integer in ASCII digits, got {value!r:.60}")
        try:
            n = int(text, base)
        except ValueError:
            b.fail(where, f"{what}: expected an integer, got {value!r:.60}")
    if n < minimum:
        b.fail(where, f"{what}: expected at least {minimum}, got {n}")
    return n


def trace_from_events(events, *, source: str = "<events>", recorded_with: str | None = None) -> Trace:
    """A trace from a recording's event dicts (``action`` ``"alloc"``/``"free"``, ``ptr``,
    ``size``, ``device``, ``stream``), checked as :func:`read_trace` checks a file.

    Raises:
        TraceError: an event that is not one, or a free of a block not allocated.
    """
    b = _Builder(source, recorded_with)
    _add_history_events(b, events, prefix="")
    return b.trace


def _add_history_events(b: _Builder, events, prefix: str) -> None:
    if not isinstance(events, list):
        b.fail(prefix + "events", f"expected a list of events, got {type(events).__name__}")
    for i, e in enumerate(events):
        where = f"{prefix}event {i}"
        if not isinstance(e, dict):
            b.fail(where, f"expected an event object, got {e!r:.60}")
        action = e.get("action")
        if action not in ("alloc", "free"):
            b.fail(where, f"action: expected 'alloc' or 'free', got {action!r}")
        ptr = _int(e.get("ptr"), "ptr", where, b)
        size = _int(e.get("size"), "size", where, b)
        device = _int(e.get("device", 0), "device", where, b)
        stream = e.get("stream")
        if stream is not None:
            stream = _int(stream, "stream", where, b)
        if action == "alloc":
            b.alloc(ptr, size, device, stream, where)
        else:
            b.free(ptr, size, device, stream, where)


def _strategy_name(doc: dict) -> str | None:
    s = doc.get("strategy")
    name = s.get("name") if isinstance(s, dict) else None
    return name if isinstance(name, str) else None


def _from_snapshot(b: _Builder, doc: dict, prefix: str = "") -> None:
    dropped = _int(doc.get("dropped", 0), "dropped", prefix + "the recording", b)
    if dropped:
        b.fail(prefix + "the recording", f"it dropped its {dropped:,} oldest events (its buffer held "
                                         f"{doc.get('max_entries', '?')}); record with a larger "
                                         "max_entries (record_history(max_entries=...)) to replay it")
    _add_history_events(b, doc.get("events"), prefix)


def _from_report(b: _Builder, doc: dict, test: str | None) -> None:
    tests = [t for t in doc.get("tests") or [] if isinstance(t, dict) and isinstance(t.get("history"), dict)]
    if test is not None:
        exact = [t for t in tests if str(t.get("nodeid", "")) == test]  # an exact node id wins
        tests = exact or [t for t in tests if test in str(t.get("nodeid", ""))]
        if len(tests) != 1:
            b.fail("its tests", f"--test {test!r} matches {len(tests)} of the tests with a timeline; "
                                "give a part of one node id")
    if not tests:
        b.fail("its tests", "no test in this pytest_gpumem report has a timeline (run pytest with "
                            "--gpumem-history --gpumem-history-keep=all --gpumem-json)")
    for t in tests:
        _from_snapshot(b, t["history"], prefix=f"test {t.get('nodeid')}, ")
    names = {_strategy_name(t["history"]) for t in tests}
    if len(names) == 1:  # every timeline recorded through one strategy
        b.trace.recorded_with = names.pop()


def _from_rmm_csv(b: _Builder, path: str) -> None:
    with open(path, newline="") as f:
        rows = csv.reader(f)
        try:
            _rmm_rows(b, rows)
        except csv.Error as exc:
            b.fail(f"line {rows.line_num}", f"not a CSV line of an RMM log: {exc}")
        except UnicodeDecodeError as exc:
            b.fail(f"after line {rows.line_num}", f"not UTF-8 text (byte {exc.start} of a read): not an RMM log")


def _rmm_rows(b: _Builder, rows) -> None:
    """The rows of an RMM log after its header, checked and added to the trace."""
    header = next(rows, None)
    if header is None or [h.strip() for h in header][:6] != _RMM_HEADER:
        b.fail("line 1", f"expected RMM's log header {','.join(_RMM_HEADER)}, got {header!r:.80}")
    for n, row in enumerate(rows, 2):
        where = f"line {n}"
        if not row:
            continue
        if len(row) < 6:
            b.fail(where, f"expected 6 fields ({','.join(_RMM_HEADER)}), got {len(row)}: the log is cut short")
        action = row[2].strip().lower()
        if action == "allocate failure":
            continue  # the program saw an error there; nothing was allocated
        if action not in ("allocate", "free"):
            b.fail(where, f"Action: expected allocate, free or allocate failure, got {row[2]!r}")
        ptr = _int(row[3], "Pointer", where, b, base=16)
        size = _int(row[4], "Size", where, b)
        stream = _int(row[5], "Stream", where, b, base=16)
        if action == "allocate":
            b.alloc(ptr, size, 0, stream, where)
        else:
            b.free(ptr, size, 0, stream, where)


def read_trace(path: str, *, test: str | None = None) -> Trace:
    """Read and check a whole trace before anything is replayed.

    Args:
        path: a recording (``snapshot(PATH)``), a pytest_gpumem report (``--gpumem-json``) or
            an RMM log (CSV).
        test: in a pytest_gpumem report, a part of the node id of the one test to take
            (default: every test with a timeline, one after another).

    Raises:
        TraceError: the file is not a trace of one of these kinds, is cut short, or is
            inconsistent; the message names the line or event.
        OSError: the file cannot be read.
    """
    if os.path.isdir(path):
        raise TraceError(f"{path}: a directory, not a trace")
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    name = os.path.basename(path)
    if head.startswith(b"{"):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise TraceError(f"{name}: not whole JSON ({exc}): the file is cut short or is not a trace") from None
        if isinstance(doc.get("tests"), list):
            b = _Builder(name)
            _from_report(b, doc, test)
            return b.trace
        if doc.get("kind") == "memory-history":
            if test is not None:
                raise TraceError(f"{name}: --test picks a test of a pytest_gpumem report; this is a recording")
            b = _Builder(name, _strategy_name(doc))
            _from_snapshot(b, doc)
            return b.trace
        raise TraceError(f"{name}: a JSON object, but neither a recording (record_history, kind "
                         f"'memory-history') nor a pytest_gpumem report (--gpumem-json)")
    if head.startswith(b"Thread"):
        if test is not None:
            raise TraceError(f"{name}: --test picks a test of a pytest_gpumem report; this is an RMM log")
        b = _Builder(name)
        _from_rmm_csv(b, path)
        return b.trace
    raise TraceError(f"{name}: not a trace: expected a recording or a pytest_gpumem report (JSON) or an "
                     f"RMM log (CSV starting {','.join(_RMM_HEADER)})")


def check_fits(trace: Trace, device_total: dict[int, int]) -> None:
    """Refuse a trace whose single allocation exceeds its device's memory, or that uses a
    device the machine lacks, before anything is allocated.

    Raises:
        TraceError: naming the event.
    """
    for i, (op, _, size, dev, _) in enumerate(trace.events):
        if dev not in device_total:
            raise TraceError(f"{trace.describe(i)}: device {dev}, but this machine has devices "
                             f"{sorted(device_total)}")
        if op == ALLOC and size > device_total[dev]:
            raise TraceError(f"{trace.describe(i)}: {format_size(size)} ({size:,} bytes), more than device "
                             f"{dev}'s {format_size(device_total[dev])}")
