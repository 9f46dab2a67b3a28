"""The ``streams`` check: which streams each thread used, and whether a
freed block's reuse on its stream is ordered after the work of the others
(see the package docstring and docs/checks.md); :func:`expect_stream` and
:func:`fresh_stream`, which make an allocation on the legacy default stream a
finding.

:class:`StreamOrder` is the checking layer's part that owns the streams each
thread was seen on, the decisions waiting on events and the events that mark
the layer's own work; the allocation and free path in
:mod:`cupy_memstrat.checks.layer` keeps its :class:`StreamRecord` tables up
to date inline (no call per allocation).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

from ..sizes import format_size
from ..stats import capture_origin
from .findings import Finding, stream_name, thread_name

__all__ = ["expect_stream", "fresh_stream", "StreamRecord", "StreamOrder"]

# thread ident -> (stream handle, its device or -1 for any) the thread's code should use
_expected: dict[int, tuple[int, int]] = {}

_OWN_EVENTS_MAX = 256  # streams with an own-work event kept per layer


class StreamRecord:
    """A stream as one thread saw it (one per thread and stream, in
    ``StreamOrder.seen[thread id][key]``; the key is the handle, or for
    the default streams, handles 0-2, one per device, ``~(device * 4 + handle)``).

    Attributes:
        seen: sequence number of the thread's last allocation or free while
            the stream was current.
        ref: weak reference to the stream object.
        handle: the raw stream handle.
        non_blocking: whether the stream is non-blocking, ``None`` until asked.
        device: the stream's device.
        last_alloc: sequence number of the thread's last allocation on it (0: none).
    """

    __slots__ = ("seen", "ref", "handle", "non_blocking", "device", "last_alloc")

    def __init__(self, seen: int, ref, handle: int, device: int, last_alloc: int):
        self.seen, self.ref, self.handle, self.non_blocking = seen, ref, handle, None
        self.device, self.last_alloc = device, last_alloc

    def __repr__(self) -> str:
        return (f"StreamRecord(seen={self.seen}, handle={self.handle:#x}, device={self.device}, "
                f"non_blocking={self.non_blocking}, last_alloc={self.last_alloc})")


@contextlib.contextmanager
def expect_stream(stream) -> Iterator[None]:
    """Within the block, the calling thread's code is expected to run on
    ``stream`` (an object with ``.ptr``, e.g. ``cupy.cuda.Stream``, or a raw
    handle): with the ``streams`` check on, an allocation made while the
    legacy default stream is current is a *legacy stream* finding (once per
    allocation site) if it is made on ``stream``'s device (a raw handle:
    any device). The pytest plugin's ``--gpumem-stream-policy=fresh`` runs
    each test inside this with a fresh non-blocking stream.

    Raises:
        TypeError: ``stream`` has no integer ``.ptr`` and is not an int.
        ValueError: ``stream`` is one of the default streams (handles 0-2).
    """
    ptr = getattr(stream, "ptr", stream)
    if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
        raise TypeError(f"stream: expected a stream object with .ptr or an int handle, got {stream!r}")
    ptr = ptr.__index__()
    if not 2 < ptr < 1 << 64:
        raise ValueError(
            f"stream: expected a stream other than the default streams (handles 0-2), got handle {ptr}"
        )
    device = getattr(stream, "device_id", -1)
    device = device if isinstance(device, int) and device >= 0 else -1
    tid = threading.get_ident()
    previous = _expected.get(tid)
    _expected[tid] = (ptr, device)
    try:
        yield
    finally:
        if previous is None:
            _expected.pop(tid, None)
        else:
            _expected[tid] = previous


@contextlib.contextmanager
def fresh_stream(backend=None) -> Iterator[object]:
    """Run the block on a new non-blocking stream, as PyTorch's test suite
    runs tests on a non-default stream: the stream is made current, ordered
    after the work already queued on the previous current stream, and the
    previous stream is ordered after it on exit. Within the block
    :func:`expect_stream` applies, so that with the ``streams`` check on,
    code that hard-codes the legacy default stream is reported. Yields the
    stream (a ``cupy.cuda.Stream``, or a fake stream with the fake backend).

    Args:
        backend: the CUDA seam (default: the process's, as
            :func:`cupy_memstrat.backends.get_backend`).

    Raises:
        NoDeviceError, CuPyNotInstalledError: no GPU, or no CuPy.
    """
    from .. import backends as _backends

    b = backend if backend is not None else _backends.get_backend()
    if not isinstance(b, _backends.RealBackend) and not callable(getattr(b, "stream", None)):
        raise TypeError(
            "backend: expected a CUDA backend (cupy_memstrat.backends.get_backend() or a "
            f"cupy_memstrat.testing.FakeBackend), got {type(b).__name__} {b!r}"
        )
    if isinstance(b, _backends.RealBackend):
        import cupy

        prev = cupy.cuda.get_current_stream()
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(prev.record())
        try:
            with stream, expect_stream(stream):
                yield stream
        finally:
            prev.wait_event(stream.record())
    else:
        stream = b.stream(non_blocking=True)
        with stream, expect_stream(stream):
            yield stream


class StreamOrder:
    """The ``streams`` check's state, one per checking layer: the streams each
    thread allocated or freed on (:attr:`seen`, kept by the layer's hot path
    for every check: the quarantine queues its work on a block's stream), the
    stream checks waiting on events (:attr:`deferred`), and the events that
    mark the layer's own work on a stream.

    Args:
        backend: the CUDA seam (stream and event queries).
        next_seq: the layer's sequence counter (one call, one number), shared
            with its hot path so that allocations and frees are ordered.
        report: called with each :class:`Finding` this part makes.
    """

    def __init__(self, backend, next_seq, report):
        self.backend, self.next_seq, self.report = backend, next_seq, report
        # thread id -> {stream key: StreamRecord} (the key: see StreamRecord)
        self.seen: dict[int, dict[int, StreamRecord]] = {}
        self.deferred: list[tuple] = []  # (event on the block's stream, event on the other, finding kwargs)
        # (device, stream handle) -> (event recorded just before this layer last queued work of its
        # own there, the sequence number then): see mark_own_work
        self._own: dict[tuple[int, int], tuple[int, int]] = {}
        self._legacy_sites: set = set()

    @staticmethod
    def prune(table: dict) -> None:
        """Drop the records of streams that no longer exist from one thread's table."""
        for k in [k for k, e in table.items() if e.ref() is None]:
            del table[k]

    def forget_reported(self) -> None:
        """Report legacy-stream sites again (:func:`cupy_memstrat.checks.clear`)."""
        self._legacy_sites.clear()

    def check_free(self, ptr, size, device, origin, ent, tid, seq, recorded=None) -> None:
        """The ``streams`` check of one free: the block goes back to the
        stream of ``ent`` (its :class:`StreamRecord`); every other stream of
        its device that this thread or the allocating one used since ``seq``
        and that still has work queued must be ordered before it, unless
        ``recorded`` (the ``record_stream`` marks) names it. Reports a finding
        at once where the block's stream is idle; where both are busy,
        records an event on each and decides later (:attr:`deferred`)."""
        b = self.backend
        now = threading.get_ident()
        cur = b.current_stream(device)
        cptr = cur.ptr
        table = self.seen.get(now)
        if table is None:
            table = self.seen[now] = {}
        ckey = cptr if cptr > 2 else ~(device * 4 + cptr)
        cent = table.get(ckey)
        if cent is None or cent.ref() is not cur:
            cent = table[ckey] = StreamRecord(self.next_seq(), weakref.ref(cur), cptr, device, 0)
        else:
            cent.seen = self.next_seq()
        if ent.ref() is None:
            return  # the allocating stream is gone (and its handle may be reused)
        # Streams of other devices reach the block only through peer access;
        # CuPy's multi-GPU copies keep them busy with unrelated work, and
        # considering them gave false findings in CuPy's own tests. A late
        # write from one is what the poison check catches.
        # a recorded stream (record_stream) is ordered before any reuse
        ordered = {(r[2], r[1]) for r in recorded} if recorded else ()
        cands = []
        for t in (tid, now) if tid != now else (tid,):
            for e in (self.seen.get(t) or {}).values():
                if (e.seen > seq and e.device == device and e is not ent and e not in cands
                        and (e.device, e.handle) not in ordered):
                    cands.append(e)
        if not cands:
            return
        for e in cands:
            s = e.ref()
            if s is None or not self._busy(e) or self._legacy_ordered(ent, e) or self._only_own_work(e):
                continue
            info = dict(
                device=device, ptr=ptr, size=size, alloc_site=origin, alloc_stream=ent.handle,
                free_stream=cptr, other_stream=e.handle, alloc_thread=thread_name(tid),
                free_thread=threading.current_thread().name,
            )
            if not self._busy(ent):
                info["free_site"] = capture_origin(0)
                self.report(self._stream_finding(info, "had no queued work that could wait for it"))
            else:  # both busy: whichever finishes first decides, seen with events on the block's device
                cur_dev = b.get_device()
                if cur_dev != device:
                    b.set_device(device)
                try:
                    ev_a, ev_s = b.event_create(), b.event_create()
                    b.event_record(ev_a, ent.handle)
                    b.event_record(ev_s, e.handle)
                finally:
                    if cur_dev != device:
                        b.set_device(cur_dev)
                info["free_site"] = capture_origin(0)
                self.deferred.append((ev_a, ev_s, info))

    def mark_own_work(self, device: int, stream: int) -> None:
        """Before the layer queues work of its own (a poison fill, a
        verification) on ``stream``: record an event there, so that a later
        streams check can tell the user's work queued before it from ours.
        Allocations stand for the user's work (a kernel is launched on the
        stream its arrays were made on): the event is recorded again only if
        the user allocated on the stream since the last one, so it marks the
        start of our latest run of own work.
        Without it, freeing many blocks of the legacy stream and then one of
        another stream can find the legacy stream "busy" with nothing but our
        poison fills (a false finding, where the hot path frees fast enough
        to queue many fills). Errors are ignored: the check then counts the
        stream busy."""
        b = self.backend
        cur = b.get_device()
        try:
            if cur != device:
                b.set_device(device)
            rec = self._own.get((device, stream))
            if rec is not None and self._last_alloc(device, stream) < rec[1]:
                return  # no allocation there since: the event still marks where the user's work ends
            if rec is None and len(self._own) >= _OWN_EVENTS_MAX:  # streams come and go (one per test)
                self.drop_own_events()
            ev = rec[0] if rec is not None else b.event_create()
            b.event_record(ev, stream)
            self._own[(device, stream)] = (ev, self.next_seq())
        except Exception:  # noqa: BLE001 - a destroyed stream: nothing to tell apart
            pass
        finally:
            if cur != device:
                b.set_device(cur)

    def _last_alloc(self, device: int, stream: int) -> int:
        """Sequence number of this thread's last allocation on ``stream`` (0: none seen)."""
        e = (self.seen.get(threading.get_ident()) or {}).get(stream if stream > 2 else ~(device * 4 + stream))
        return e.last_alloc if e is not None else 0

    def drop_own_events(self) -> None:
        """Destroy the events that mark the layer's own work (at close, or when too many streams were seen)."""
        own, self._own = self._own, {}
        for ev, _ in own.values():
            try:
                self.backend.event_destroy(ev)
            except Exception:  # noqa: BLE001
                pass

    def _only_own_work(self, e: StreamRecord) -> bool:
        """Whether a busy stream has nothing of the user's pending that we
        know of: all the work queued before our latest run of own work there
        is done, and the user allocated nothing on it since. (A kernel the
        user queued there after our work without allocating is not seen: the
        check then misses that stream; the poison check still catches a late
        write.)"""
        rec = self._own.get((e.device, e.handle))
        if rec is None or e.last_alloc > rec[1]:
            return False
        return self._on_device(e.device, self.backend.event_done, rec[0])

    def _busy(self, e: StreamRecord) -> bool:
        """``cudaStreamQuery`` of a seen stream; the default streams (handles
        0-2) are asked on their own device."""
        if e.handle > 2:
            return self.backend.stream_busy(e.handle)
        return self._on_device(e.device, self.backend.stream_busy, e.handle)

    def _on_device(self, device: int, query, arg):
        """``query(arg)`` with ``device`` current (switched only if it is not),
        the current device put back after."""
        b = self.backend
        cur = b.get_device()
        if cur == device:
            return query(arg)
        b.set_device(device)
        try:
            return query(arg)
        finally:
            b.set_device(cur)

    def _legacy_ordered(self, a: StreamRecord, s: StreamRecord) -> bool:
        """Whether the legacy default stream's implicit synchronisation orders
        the two streams (one is the legacy stream, the other is blocking)."""
        if a.device != s.device:
            return False  # streams of two devices: the legacy stream orders only its own device's
        if a.handle in (0, 1):
            return not self._non_blocking(s)
        if s.handle in (0, 1):
            return not self._non_blocking(a)
        return False

    def _non_blocking(self, e: StreamRecord) -> bool:
        if e.non_blocking is None:
            try:
                e.non_blocking = self.backend.stream_non_blocking(e.handle)
            except Exception:  # noqa: BLE001 - a destroyed handle: assume the worst
                e.non_blocking = True
        return e.non_blocking

    @staticmethod
    def _stream_finding(info: dict, why: str) -> Finding:
        a, s = stream_name(info["alloc_stream"]), stream_name(info["other_stream"])
        msg = (
            f"{format_size(info['size'])} block 0x{info['ptr']:x} on device {info['device']} went back to stream {a} "
            f"for reuse while stream {s} still had work queued, and stream {a} {why}: a kernel on stream {s} "
            f"may still use the block after it is handed out again (make stream {a} wait for stream {s}, "
            f"e.g. {_wait_hint(info['alloc_stream'], info['other_stream'])}, or synchronise stream {s}, "
            f"before dropping the array; or mark it with cupy_memstrat.record_stream(array, stream {s}) and "
            "the block waits for that stream by itself)"
        )
        return Finding(kind="cross-stream reuse", check="streams", message=msg, **info)

    def poll(self) -> None:
        """Decide the deferred stream checks whose events have completed:
        the other stream finished first (ordered, at least in this run), or
        the block's stream did (a finding)."""
        b, keep = self.backend, []
        for ev_a, ev_s, info in self.deferred:
            if b.event_done(ev_s):
                pass  # the other stream's work finished first: ordered, at least in this run
            elif b.event_done(ev_a):
                self.report(self._stream_finding(info, "finished its queued work before it"))
            else:
                keep.append((ev_a, ev_s, info))
                continue
            b.event_destroy(ev_a)
            b.event_destroy(ev_s)
        self.deferred = keep

    def drop_undecided(self) -> None:
        """After a synchronisation both events of every deferred check are
        done, so none can be decided: drop them."""
        b = self.backend
        for ev_a, ev_s, _ in self.deferred:
            b.event_destroy(ev_a)
            b.event_destroy(ev_s)
        self.deferred = []

    def legacy_finding(self, origin, device, ptr, size, expected_ptr, tid) -> None:
        """Report an allocation on the legacy default stream where
        :func:`expect_stream` named another (once per site)."""
        key = (expected_ptr, origin)
        if key in self._legacy_sites:
            return
        self._legacy_sites.add(key)
        msg = (
            f"{format_size(size)} allocated on device {device} while the legacy default stream was current, "
            f"but this code is expected to run on stream {stream_name(expected_ptr)}: code that hard-codes the "
            "legacy stream (cupy.cuda.Stream.null, stream=0) is not ordered with that stream; use the current "
            "stream (cupy.cuda.get_current_stream()) instead"
        )
        self.report(Finding(
            kind="legacy stream", check="streams", message=msg, device=device, ptr=ptr, size=size,
            alloc_site=origin, alloc_stream=0, other_stream=expected_ptr, alloc_thread=thread_name(tid),
        ))


def _wait_hint(a: int, s: int) -> str:
    if a in (0, 1):
        return "cupy.cuda.Stream.null.wait_event(other.record())"
    return "stream_a.wait_event(stream_b.record())"

