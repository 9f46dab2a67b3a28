"""The checking layer: :class:`CheckedStrategy` wraps any strategy (see the
package docstring for what each check does).

The layer is itself a :class:`~cupy_memstrat.Strategy`: CuPy calls its hot
path, which asks the wrapped strategy's hot path for a (padded) block, and
keeps the program's view in the common accounting: ``bytes_in_use`` counts
the bytes the program asked for; red zones and quarantined blocks show in
``bytes_reserved`` (the wrapped strategy's reserve).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import weakref

from ..options import Option, as_int, as_size
from ..sizes import format_size
from ..stats import capture_origin, origin_capture
from .._userwarn import warn_at_user
from ..strategies._support import FOLD_AT
from ..strategies.base import Strategy
from . import (
    CANARY_BYTE,
    CHECKS,
    POISON_BYTE,
    CheckError,
    Finding,
    _expected,
    _record,
    _stream_name,
    _warn,
    parse_checks,
)

__all__ = ["CheckedStrategy"]

_ALIGN = 256  # CuPy expects blocks aligned to 256 bytes; the red zone keeps sizes multiples of it
_layers: "weakref.WeakSet[CheckedStrategy]" = weakref.WeakSet()
_verifiers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _live_layers() -> list:
    return list(_layers)


def _as_checks(value, what: str) -> frozenset:
    try:
        return parse_checks(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: {str(exc).removeprefix('check: ')}") from None


def _as_policy(value, what: str) -> str:
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in ("raise", "warn", "record"):
        raise ValueError(f"{what}: expected 'raise', 'warn' or 'record', got {value!r}")
    return v


def _as_count(value, what: str) -> int:
    n = as_int(value, what)
    if n < 0:
        raise ValueError(f"{what}: expected a count >= 0, got {value!r}")
    return n


def _as_redzone(value, what: str) -> int:
    n = as_size(value, what)
    if isinstance(n, str):
        raise ValueError(f"{what}: expected bytes, not a percentage, got {value!r}")
    if n <= 0:
        raise ValueError(f"{what}: expected bytes > 0, got {value!r}")
    return -(-n // _ALIGN) * _ALIGN


def _as_quarantine_bytes(value, what: str) -> int:
    n = as_size(value, what)
    if isinstance(n, str):
        raise ValueError(f"{what}: expected bytes, not a percentage, got {value!r}")
    return n


def _thread_name(tid) -> str:
    # not threading.enumerate(): it takes a lock, and this runs in finalisers
    t = threading._active.get(tid)  # noqa: SLF001 - the lock-free lookup current_thread() uses
    return t.name if t is not None else f"thread {tid}"


class _Verifier:
    """Result slots of the check kernels of one backend, shared by every
    checked strategy on it: which slot holds which block's check.

    No lock: CuPy frees memory from finalisers, which the garbage collector
    runs in the middle of whatever allocates a Python object, this class's
    own code included. A lock held there deadlocks (seen on the H200: a
    pytest-xdist worker hung in CuPy's test suite). Each step is one
    GIL-atomic list or dict operation instead.
    """

    def __init__(self, kernels, backend):
        self.kernels, self.backend = kernels, backend
        self.free: dict[int, list[int]] = {}
        self.pending: dict[int, dict[int, tuple]] = {}

    def submit(self, device: int, ptr: int, start: int, end: int, pattern: int, stream: int, info: tuple) -> None:
        free = self.free.get(device)
        if free is None:
            free = self.free.setdefault(device, list(range(self.kernels.SLOTS)))
            self.pending.setdefault(device, {})
        try:
            slot = free.pop()
        except IndexError:  # every slot is waiting: finish them (a synchronisation)
            for layer, finding in self.collect(device):
                layer._report(finding)
            slot = free.pop()
        pend = self.pending[device]
        pend[slot] = info
        try:
            self.kernels.verify(device, ptr, start, end, pattern, slot, stream)
        except BaseException:
            pend.pop(slot, None)
            free.append(slot)
            raise

    def collect(self, device: int | None = None) -> list:
        """Wait for the queued checks (of ``device``, or all) and return
        ``(layer, Finding)`` for each that found damage."""
        out = []
        # the slots to finish are those queued before the synchronisation
        todo = {d: list(self.pending[d]) for d in ([device] if device is not None else list(self.pending))
                if self.pending.get(d)}
        for d in todo:
            self.backend.device_synchronize(d)
        # A kernel that finds damage sets the host-mapped flag: without it
        # there is nothing to read (no copy of the result slots).
        flagged = self.kernels.flagged()
        if device is None:
            self.kernels.clear_flag()  # every kernel has finished; later damage sets it again
        for d, slots in todo.items():
            pend, free = self.pending[d], self.free[d]
            bad = self.kernels.read(d) if flagged else {}
            for slot in slots:
                info = pend.pop(slot, None)
                if info is None:
                    continue
                free.append(slot)
                r = bad.get(slot)
                if r is not None and r[0]:
                    layer = info[1]
                    out.append((layer, layer._gpu_finding(info, r)))
        return out


class CheckedStrategy(Strategy):
    """A strategy wrapped in the checking layer (``use(name, check=...)``).

    Args:
        inner: the strategy to check (any :class:`~cupy_memstrat.Strategy`,
            built-in or third-party, not already checked).
        check: ``"streams"``, ``"poison"``, ``"redzone"``, any combination
            (``"streams,poison"``; ``+`` also separates, for spec strings),
            or ``"all"``.
        on_finding: ``"raise"`` (default), ``"warn"`` or ``"record"``.
        quarantine_bytes: bytes of freed blocks held poisoned before they go
            back to ``inner`` (default 256 MiB; size strings accepted).
        quarantine_count: blocks held at most (default 4096); the oldest
            leaves first when either limit is passed. 0 and 0: each block is
            verified and given back at once.
        redzone_bytes: guard bytes after each allocation, rounded up to 256
            (default 256); the canary starts right after the requested size,
            so the guard covers the rounding too.
        track_origins: always on here (findings name the allocation site).
        owns_inner: close ``inner`` with this layer (what :func:`cupy_memstrat.create`
            does for a strategy it made from a name); a strategy passed in
            is left open.

    Raises:
        TypeError: ``inner`` is not a Strategy, or is already checked.
        ValueError: no check named, an unknown check, or a bad option value
            (the message names the option and the value).

    Costs (measured, docs/checks.md): ``streams`` a stack walk and a few
    dict updates per allocation and free; ``poison`` a memset per free and a
    kernel when a block leaves quarantine; ``redzone`` a memset per
    allocation and a kernel per free.
    """

    name = "checked"
    description = "the checking layer (streams, poison, redzone) over another strategy"
    has_c_hot_path = False
    reserved_is_in_use = False
    options = (
        Option("check", _as_checks, frozenset(CHECKS), "checks to run: streams, poison, redzone (or all)"),
        Option("on_finding", _as_policy, "raise", "what a finding does: raise, warn or record"),
        Option("quarantine_bytes", _as_quarantine_bytes, 256 << 20, "bytes of freed blocks held poisoned"),
        Option("quarantine_count", _as_count, 4096, "freed blocks held poisoned, at most"),
        Option("redzone_bytes", _as_redzone, 256, "guard bytes after each allocation (rounded up to 256)"),
    )

    def __init__(self, inner: Strategy, *, owns_inner: bool = False, **options):
        if "backend" in options:
            raise TypeError("backend: the checks use the wrapped strategy's backend; pass backend= when creating it")
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner: expected a cupy_memstrat.Strategy to check, got {type(inner).__name__} {inner!r}")
        if isinstance(inner, CheckedStrategy):
            raise TypeError(f"inner: {inner!r} is already checked; wrap the strategy it checks instead")
        super().__init__(backend=inner.backend, **options)
        checks = self.config["check"]
        if not checks:
            raise ValueError("check: expected at least one of streams, poison, redzone (or all), got none")
        self.check_options_apply(checks, options)
        self.inner = inner
        self._owns_inner = owns_inner  # made from a spec for this layer: closed with it
        self._closed = False
        self.name = inner.name
        self.checks = checks
        self._track_origins = True
        self._streams = "streams" in checks
        self._poison = "poison" in checks
        self._redzone = self.config["redzone_bytes"] if "redzone" in checks else 0
        self._pad = self._poison or bool(self._redzone)
        self._policy = self.config["on_finding"]
        self._q_limit_bytes = self.config["quarantine_bytes"]
        self._q_limit_count = self.config["quarantine_count"]
        # What the program sees as the strategy's options: the wrapped strategy's (its own
        # track_origins among them), then the checks', "check" spelled as in a spec (JSON-ready)
        # (and its oom_snapshot, unless one was given to this layer)
        own = {k: v for k, v in self.config.items()
               if k != "track_origins" and (k != "oom_snapshot" or "oom_snapshot" in options)}
        own["check"] = ",".join(c for c in CHECKS if c in checks)
        self.config = {**inner.config, **own}
        self._meta: dict[int, tuple] = {}  # ptr -> (padded, stream entry, thread id, seq)
        # thread id -> {stream key: [last seq seen, weakref to the stream, handle, non-blocking or None, device,
        # seq of the last allocation on it]};
        # the key is the handle, or for the default streams (handles 0-2, one per device) ~(device * 4 + handle)
        self._seen: dict[int, dict[int, list]] = {}
        self._next_seq = itertools.count(1).__next__
        self._quarantine: collections.deque = collections.deque()
        self._q_bytes = 0
        self._deferred: list[tuple] = []  # (event on the block's stream, event on the other, finding kwargs)
        # (device, stream handle) -> (event recorded just before this layer last queued work of its
        # own there, the sequence number then): see _mark_own_work
        self._own: dict[tuple[int, int], tuple[int, int]] = {}
        self._to_raise: list[Finding] = []
        self._alarm = False
        self._legacy_sites: set = set()
        self._verifier = None
        self.n_findings = 0  # findings this layer has reported
        _layers.add(self)

    @classmethod
    def parse_options(cls, options: dict) -> dict:
        """As :meth:`Strategy.parse_options`; messages name the option
        (``check: unknown check 'x' ...``)."""
        specs = {o.name: o for o in cls.option_specs()}
        unknown = sorted(set(options) - set(specs))
        if unknown:
            raise ValueError(f"unknown check option {unknown[0]!r}; valid options: {', '.join(sorted(specs))}")
        return {n: (o.parse(options[n], n) if n in options else o.default) for n, o in specs.items()}

    @staticmethod
    def check_options_apply(checks, given) -> None:
        """Refuse options given for a check that is off.

        Raises:
            ValueError: e.g. ``redzone_bytes`` without the ``redzone`` check.
        """
        needs = {"quarantine_bytes": "poison", "quarantine_count": "poison", "redzone_bytes": "redzone"}
        for opt in sorted(set(given) & set(needs)):
            if needs[opt] not in checks:
                shown = ",".join(c for c in CHECKS if c in checks)
                raise ValueError(
                    f"option {opt!r} applies to the {needs[opt]} check, which is not on (check={shown}); "
                    f"add {needs[opt]} to check= or leave {opt} out"
                )

    # -- the hot path --------------------------------------------------------------------------
    def _build_hot_path(self):
        inner = self.inner
        inner_malloc, inner_free = inner._hot_path()
        self._inner_free = inner_free
        b = self.backend
        current_stream, memset = b.current_stream, b.memset_async
        events, live, origins, meta = self._events, self._live, self._origins, self._meta
        fold, unknown_free = self._fold, self._unknown_free
        streams_on, pad, rz, redzone_on = self._streams, self._pad, self._redzone, bool(self._redzone)
        flagged = b.check_kernels().flagged if pad else None
        get_ident, seen_tables, next_seq, ref = threading.get_ident, self._seen, self._next_seq, weakref.ref
        expected = _expected
        state = self
        check_streams, after_free, legacy = self._check_free_streams, self._after_free, self._legacy_finding
        # the wrapped strategy's track_origins=N frames, else the first (findings name the site)
        capture = origin_capture(self.config.get("track_origins") or True)

        def malloc(size, device):
            if state._alarm:
                state._on_alarm()
            if pad and flagged():
                state._on_flag()
            stream = current_stream(device)
            sptr = stream.ptr
            padded = ((size + 255) & ~255) + rz if pad else size
            try:
                ptr = inner_malloc(padded, device)
            except (MemoryError, OverflowError) as exc:  # OverflowError: the padding passed size_t
                ptr = state._out_of_memory(size, padded, device, exc)
            try:
                if redzone_on:
                    memset(ptr + size, CANARY_BYTE, padded - size, sptr)
                tid = get_ident()
                seq = next_seq()
                table = seen_tables.get(tid)
                if table is None:
                    table = seen_tables[tid] = {}
                key = sptr if sptr > 2 else ~(device * 4 + sptr)  # 0-2: each device's own default streams
                ent = table.get(key)
                if ent is None or ent[1]() is not stream:
                    if len(table) > 64:
                        state._prune(table)
                    ent = table[key] = [seq, ref(stream), sptr, None, device, seq]
                else:
                    ent[0] = ent[5] = seq
                origin = capture(1)
                if streams_on and sptr < 2 and expected:
                    exp = expected.get(tid)
                    if exp is not None and exp[1] in (-1, device):
                        legacy(origin, device, ptr, size, exp[0], tid)
            except BaseException:
                inner_free(ptr, device)  # nothing is lost: the block goes back before the error
                raise
            ev = events[device]
            ev.append(size)
            origins[ptr] = origin
            meta[ptr] = (padded, ent, tid, seq)
            live[device][ptr] = size
            if len(ev) > FOLD_AT:
                fold(device)
            return ptr

        inner_recorded, own_recorded, watch = inner._recorded, self._recorded, self._watch

        def free(ptr, device, stacklevel=1):
            try:
                size = live[device].pop(ptr)
            except (KeyError, IndexError, TypeError):
                device, size = unknown_free(ptr, stacklevel)
                if size is None:
                    return
            events[device].append(-size)
            origin = origins.pop(ptr, None)
            padded, ent, tid, seq = meta.pop(ptr)
            # streams marked with record_stream(): the inner strategy holds the
            # block back until their work is done, so they are ordered
            rec = inner_recorded.get(ptr) if inner_recorded else None
            if own_recorded:  # the inner strategy's frees wait for every stream (device)
                rec = own_recorded.pop(ptr, None) or rec
            if streams_on:
                try:
                    check_streams(ptr, size, device, origin, ent, tid, seq, rec)
                except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
                    _quiet_warn(f"cupy_memstrat.checks: the stream check of 0x{ptr:x} failed: {exc!r}")
            if pad and not rec:
                after_free(ptr, size, padded, device, origin, ent, tid)
            else:
                # a recorded block is not poisoned: a recorded stream may still
                # use it, legitimately, after the free
                inner_free(ptr, device)
            if watch[0] is not None and not live[device]:
                watch[0]()

        self._malloc, self._free, self.hot_path = malloc, free, "python"
        return malloc, free

    @staticmethod
    def _prune(table: dict) -> None:
        for k in [k for k, e in table.items() if e[1]() is None]:
            del table[k]

    # -- streams -----------------------------------------------------------------------------
    def record_stream(self, ptr: int, stream) -> bool:
        """As :meth:`Strategy.record_stream`, on the strategy this layer
        checks (the same pointer): the ``streams`` check then counts
        ``stream`` as ordered before the block's reuse, and the ``poison``
        check does not fill the block (the recorded stream may still use it
        after the free).

        Raises:
            ValueError: ``ptr`` is not a live allocation of this layer.
        """
        for d, live in enumerate(self._live):
            if ptr in live:
                break
        else:
            raise ValueError(f"{self.name}: 0x{ptr:x} is not the start of a live allocation of this strategy")
        if not self.inner.record_stream(ptr, stream):
            # the inner strategy's frees wait for every stream: kept for the check only
            tid = threading.get_ident() if stream.ptr == 2 else None
            self._recorded.setdefault(ptr, []).append((stream, stream.ptr, getattr(stream, "device_id", d), tid))
        return True

    def _check_free_streams(self, ptr, size, device, origin, ent, tid, seq, recorded=None) -> None:
        b = self.backend
        now = threading.get_ident()
        cur = b.current_stream(device)
        cptr = cur.ptr
        table = self._seen.get(now)
        if table is None:
            table = self._seen[now] = {}
        ckey = cptr if cptr > 2 else ~(device * 4 + cptr)
        cent = table.get(ckey)
        if cent is None or cent[1]() is not cur:
            cent = table[ckey] = [self._next_seq(), weakref.ref(cur), cptr, None, device, 0]
        else:
            cent[0] = self._next_seq()
        if ent[1]() is None:
            return  # the allocating stream is gone (and its handle may be reused)
        # Streams of other devices reach the block only through peer access;
        # CuPy's multi-GPU copies keep them busy with unrelated work, and
        # considering them gave false findings in CuPy's own tests. A late
        # write from one is what the poison check catches.
        # a recorded stream (record_stream) is ordered before any reuse
        ordered = {(r[2], r[1]) for r in recorded} if recorded else ()
        cands = []
        for t in (tid, now) if tid != now else (tid,):
            for e in (self._seen.get(t) or {}).values():
                if e[0] > seq and e[4] == device and e is not ent and e not in cands and (e[4], e[2]) not in ordered:
                    cands.append(e)
        if not cands:
            return
        for e in cands:
            s = e[1]()
            if s is None or not self._busy(e) or self._legacy_ordered(ent, e) or self._only_own_work(e):
                continue
            info = dict(
                device=device, ptr=ptr, size=size, alloc_site=origin, alloc_stream=ent[2],
                free_stream=cptr, other_stream=e[2], alloc_thread=_thread_name(tid),
                free_thread=threading.current_thread().name,
            )
            if not self._busy(ent):
                info["free_site"] = capture_origin(0)
                self._report(self._stream_finding(info, "had no queued work that could wait for it"))
            else:  # both busy: whichever finishes first decides, seen with events on the block's device
                cur_dev = b.get_device()
                if cur_dev != device:
                    b.set_device(device)
                try:
                    ev_a, ev_s = b.event_create(), b.event_create()
                    b.event_record(ev_a, ent[2])
                    b.event_record(ev_s, e[2])
                finally:
                    if cur_dev != device:
                        b.set_device(cur_dev)
                info["free_site"] = capture_origin(0)
                self._deferred.append((ev_a, ev_s, info))
                self._alarm = True

    def _mark_own_work(self, device: int, stream: int) -> None:
        """Before this layer queues work of its own (a poison fill, a
        verification) on ``stream``: record an event there, so that a later
        streams check can tell the user's work queued before it from ours.
        Allocations stand for the user's work (a kernel is launched on the
        stream its arrays were made on): the event is recorded again only if
        the user allocated on the stream since the last one, so it marks the
        start of our latest run of own work.
        Without it, freeing many blocks of the legacy stream and then one of
        another stream found the legacy stream "busy" with nothing but our
        poison fills (a false finding, seen on the H200 once the hot path got
        faster). Errors are ignored: the check then counts the stream busy."""
        b = self.backend
        cur = b.get_device()
        try:
            if cur != device:
                b.set_device(device)
            rec = self._own.get((device, stream))
            if rec is not None and self._last_alloc(device, stream) < rec[1]:
                return  # no allocation there since: the event still marks where the user's work ends
            if rec is None and len(self._own) >= _OWN_EVENTS_MAX:  # streams come and go (one per test)
                self._drop_own_events()
            ev = rec[0] if rec is not None else b.event_create()
            b.event_record(ev, stream)
            self._own[(device, stream)] = (ev, self._next_seq())
        except Exception:  # noqa: BLE001 - a destroyed stream: nothing to tell apart
            pass
        finally:
            if cur != device:
                b.set_device(cur)

    def _last_alloc(self, device: int, stream: int) -> int:
        """Sequence number of this thread's last allocation on ``stream`` (0: none seen)."""
        e = (self._seen.get(threading.get_ident()) or {}).get(stream if stream > 2 else ~(device * 4 + stream))
        return e[5] if e is not None else 0

    def _drop_own_events(self) -> None:
        own, self._own = self._own, {}
        for ev, _ in own.values():
            try:
                self.backend.event_destroy(ev)
            except Exception:  # noqa: BLE001
                pass

    def _only_own_work(self, e: list) -> bool:
        """Whether a busy stream has nothing of the user's pending that we
        know of: all the work queued before our latest run of own work there
        is done, and the user allocated nothing on it since. (A kernel the
        user queued there after our work without allocating is not seen: the
        check then misses that stream; the poison check still catches a late
        write.)"""
        rec = self._own.get((e[4], e[2]))
        if rec is None or e[5] > rec[1]:
            return False
        return self._on_device(e[4], self.backend.event_done, rec[0])

    def _busy(self, e: list) -> bool:
        """``cudaStreamQuery`` of a seen stream; the default streams (handles
        0-2) are asked on their own device."""
        if e[2] > 2:
            return self.backend.stream_busy(e[2])
        return self._on_device(e[4], self.backend.stream_busy, e[2])

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

    def _legacy_ordered(self, a: list, s: list) -> bool:
        """Whether the legacy default stream's implicit synchronisation orders
        the two streams (one is the legacy stream, the other is blocking)."""
        if a[4] != s[4]:
            return False  # streams of two devices: the legacy stream orders only its own device's
        if a[2] in (0, 1):
            return not self._non_blocking(s)
        if s[2] in (0, 1):
            return not self._non_blocking(a)
        return False

    def _non_blocking(self, e: list) -> bool:
        if e[3] is None:
            try:
                e[3] = self.backend.stream_non_blocking(e[2])
            except Exception:  # noqa: BLE001 - a destroyed handle: assume the worst
                e[3] = True
        return e[3]

    @staticmethod
    def _stream_finding(info: dict, why: str) -> Finding:
        a, s = _stream_name(info["alloc_stream"]), _stream_name(info["other_stream"])
        msg = (
            f"{format_size(info['size'])} block 0x{info['ptr']:x} on device {info['device']} went back to stream {a} "
            f"for reuse while stream {s} still had work queued, and stream {a} {why}: a kernel on stream {s} "
            f"may still use the block after it is handed out again (make stream {a} wait for stream {s}, "
            f"e.g. {_wait_hint(info['alloc_stream'], info['other_stream'])}, or synchronise stream {s}, "
            f"before dropping the array; or mark it with cupy_memstrat.record_stream(array, stream {s}) and "
            "the block waits for that stream by itself)"
        )
        return Finding(kind="cross-stream reuse", check="streams", message=msg, **info)

    def _poll_deferred(self) -> None:
        b, keep = self.backend, []
        for ev_a, ev_s, info in self._deferred:
            if b.event_done(ev_s):
                pass  # the other stream's work finished first: ordered, at least in this run
            elif b.event_done(ev_a):
                self._report(self._stream_finding(info, "finished its queued work before it"))
            else:
                keep.append((ev_a, ev_s, info))
                continue
            b.event_destroy(ev_a)
            b.event_destroy(ev_s)
        self._deferred = keep

    def _legacy_finding(self, origin, device, ptr, size, expected_ptr, tid) -> None:
        key = (expected_ptr, origin)
        if key in self._legacy_sites:
            return
        self._legacy_sites.add(key)
        msg = (
            f"{format_size(size)} allocated on device {device} while the legacy default stream was current, "
            f"but this code is expected to run on stream {_stream_name(expected_ptr)}: code that hard-codes the "
            "legacy stream (cupy.cuda.Stream.null, stream=0) is not ordered with that stream; use the current "
            "stream (cupy.cuda.get_current_stream()) instead"
        )
        self._report(Finding(
            kind="legacy stream", check="streams", message=msg, device=device, ptr=ptr, size=size,
            alloc_site=origin, alloc_stream=0, other_stream=expected_ptr, alloc_thread=_thread_name(tid),
            strategy=self.name,
        ))

    # -- poison and red zones -----------------------------------------------------------------
    def _verifier_of(self) -> _Verifier:
        v = self._verifier
        if v is None:
            kernels = self.backend.check_kernels()
            v = _verifiers.get(kernels)
            if v is None:
                v = _verifiers[kernels] = _Verifier(kernels, self.backend)
            self._verifier = v
        return v

    def _after_free(self, ptr, size, padded, device, origin, ent, tid) -> None:
        b = self.backend
        try:
            cur_dev = b.get_device()
            if cur_dev != device:
                b.set_device(device)
            try:
                sptr = ent[2]
                if ent[1]() is None:  # the allocating stream is gone: wait for its work, use the null stream
                    self._synchronize(device)
                    sptr = 0
                fstream = b.current_stream(device).ptr
                info = (self, ptr, size, padded, device, origin, capture_origin(0), ent[2], fstream, tid,
                        threading.current_thread().name)
                if self._redzone or (self._poison and not self._closed):
                    self._mark_own_work(device, sptr)
                if self._redzone:
                    self._verifier_of().submit(device, ptr, size, padded, CANARY_BYTE, sptr, ("redzone",) + info)
                if self._poison and not self._closed:
                    b.memset_async(ptr, POISON_BYTE, padded, sptr)
                    self._quarantine.append((ptr, padded, device, ent, info))
                    self._q_bytes += padded
                    while self._quarantine and (
                        len(self._quarantine) > self._q_limit_count or self._q_bytes > self._q_limit_bytes
                    ):
                        self._release_oldest()
                    return
            finally:
                if cur_dev != device:
                    b.set_device(cur_dev)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            _quiet_warn(f"cupy_memstrat.checks: checking the free of 0x{ptr:x} failed: {exc!r}")
        self._inner_free(ptr, device)

    def _release_oldest(self) -> None:
        ptr, padded, device, ent, info = self._quarantine.popleft()
        self._q_bytes -= padded
        try:
            sptr = ent[2]
            if ent[1]() is None:
                self._synchronize(device)
                sptr = 0
            self._mark_own_work(device, sptr)
            self._verifier_of().submit(device, ptr, 0, padded, POISON_BYTE, sptr, ("poison",) + info)
        except Exception as exc:  # noqa: BLE001
            _quiet_warn(f"cupy_memstrat.checks: verifying the poison of 0x{ptr:x} failed: {exc!r}")
        self._inner_free(ptr, device)

    def _out_of_memory(self, size: int, padded: int, device: int, exc: BaseException) -> int:
        """The wrapped strategy refused ``padded`` bytes: give the quarantine
        back and try once more; else raise ``OutOfMemoryError`` for the
        requested ``size``, counted in this layer's ``n_failed``."""
        if self._quarantine:
            self._drain(device)
            try:
                return self.inner._malloc(padded, device)
            except (MemoryError, OverflowError) as again:
                exc = again
        with self._fold_lock:
            self._counters[device].n_failed += 1
        self._raise_out_of_memory(
            size, device, reason=getattr(exc, "reason", "cuda"), cause=exc,
            detail=f" ({padded:,} bytes with the checks' padding; {type(exc).__name__}: {exc})",
        )

    def _synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize``, after deciding what the stream checks
        waiting on events can decide (a synchronisation finishes their events)."""
        for layer in _live_layers():
            if layer._deferred:
                layer._poll_deferred()
        self.backend.device_synchronize(device)

    def _drain(self, device: int | None = None) -> None:
        """Verify and give back every quarantined block (of ``device``)."""
        if device is None:
            while self._quarantine:
                self._release_on_device(self._quarantine[0][2])
            return
        keep = collections.deque()
        while self._quarantine:
            item = self._quarantine.popleft()
            if item[2] == device:
                self._quarantine.appendleft(item)
                self._release_on_device(device)
            else:
                keep.append(item)
        self._quarantine.extend(keep)

    def _release_on_device(self, device: int) -> None:
        b = self.backend
        cur = b.get_device()
        if cur != device:
            b.set_device(device)
        try:
            self._release_oldest()
        finally:
            if cur != device:
                b.set_device(cur)

    def _gpu_finding(self, info: tuple, result: tuple) -> Finding:
        check, _, ptr, size, padded, device, origin, free_site, astream, fstream, tid, fthread = info
        n_bad, first = result
        if check == "redzone":
            kind = "out-of-bounds write"
            msg = (
                f"{n_bad} byte{'' if n_bad == 1 else 's'} of the red zone after a {format_size(size)} block "
                f"0x{ptr:x} on device {device} changed, the first at offset {first} (byte {first - size + 1} "
                "past the end): something wrote past the end of the array before it was freed"
            )
        else:
            kind = "write after free"
            msg = (
                f"{n_bad} byte{'' if n_bad == 1 else 's'} of a freed {format_size(size)} block 0x{ptr:x} on "
                f"device {device} changed while it was in quarantine, the first at offset {first}: something "
                "wrote to the array's memory after it was freed"
            )
        return Finding(
            kind=kind, check=check, message=msg, device=device, ptr=ptr, size=size, alloc_site=origin,
            free_site=free_site, alloc_stream=astream, free_stream=fstream, alloc_thread=_thread_name(tid),
            free_thread=fthread, bad_bytes=n_bad, first_bad_offset=first, strategy=self.name,
        )

    # -- findings --------------------------------------------------------------------------------
    def _report(self, finding: Finding) -> None:
        if not finding.strategy:
            finding = dataclasses.replace(finding, strategy=self.name)
        self.n_findings += 1
        _record(finding)
        if self._policy == "warn":
            try:
                _warn(finding)
            except Exception:  # noqa: BLE001 - warnings as errors: raised at the next allocation instead
                self._to_raise.append(finding)
                self._alarm = True
        elif self._policy == "raise":
            self._to_raise.append(finding)
            self._alarm = True

    def _refresh_alarm(self) -> None:
        self._alarm = bool(self._to_raise or self._deferred)

    def _on_alarm(self) -> None:
        if self._deferred:
            self._poll_deferred()
        if self._to_raise:
            found = list(self._to_raise)
            self._to_raise.clear()
            self._refresh_alarm()
            raise CheckError(found)
        self._refresh_alarm()

    def _on_flag(self) -> None:
        for layer, finding in self._verifier_of().collect():
            layer._report(finding)
        if self._to_raise:
            self._on_alarm()

    def _collect(self, device: int | None = None) -> None:
        """Decide deferred stream checks, drain the quarantine, read every
        queued kernel (of every layer on this backend: they share the slots).
        The stream checks come first: a synchronisation finishes both of
        their events, after which they cannot be decided."""
        if self._deferred:
            self._poll_deferred()
        self._drain(device)
        if self._pad:
            for layer, finding in self._verifier_of().collect(device):
                layer._report(finding)
        if self._deferred:  # after the synchronisation both events are done: undecidable, dropped
            b = self.backend
            for ev_a, ev_s, _ in self._deferred:
                b.event_destroy(ev_a)
                b.event_destroy(ev_s)
            self._deferred = []
        self._refresh_alarm()

    # -- the rest of the Strategy interface ------------------------------------------------------------
    def stats(self, device: int | None = None):
        """The common :class:`~cupy_memstrat.Stats`: in use as the program
        sees it (requested sizes); reserved as the wrapped strategy holds it
        (padding, red zones and quarantined blocks included)."""
        st = super().stats(device)
        inner = self.inner.stats(st.device)
        return dataclasses.replace(
            st, bytes_reserved=inner.bytes_reserved, peak_bytes_reserved=inner.peak_bytes_reserved,
        )

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        super().reset_peak(device, reserved=reserved)
        self.inner.reset_peak(device, reserved=reserved)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Verify and give back the quarantined blocks (of ``device``), then
        trim the wrapped strategy (:meth:`Strategy.trim`). Returns the bytes
        given back to CUDA, the quarantined blocks included where the wrapped
        strategy frees straight to CUDA (``device``)."""
        if device is not None:
            device = self._device_or_current(device)
        from ..sizes import parse_size

        parse_size(keep_bytes, total=100, what="keep_bytes")  # a bad value fails before anything is given back
        devices = range(self.backend.device_count()) if device is None else [device]
        before = sum(self.inner.stats(d).bytes_reserved for d in devices)
        self._drain(device)
        released = self.inner.trim(keep_bytes, device)
        after = sum(self.inner.stats(d).bytes_reserved for d in devices)
        return max(released, before - after)

    def close(self) -> None:
        """Verify and give back the quarantine; later frees are verified and
        given back at once. The wrapped strategy is closed too if this layer
        made it (``owns_inner``)."""
        self._closed = True
        self._drain()
        self._drop_own_events()
        if self._owns_inner:
            self.inner.close()
        super().close()

    def __getattr__(self, name):
        # strategy-specific methods of the wrapped strategy (pool_stats, managed_stats, ...)
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<CheckedStrategy check={','.join(c for c in CHECKS if c in self.checks)} over {self.inner!r}>"


_OWN_EVENTS_MAX = 256  # streams with an own-work event kept per layer


def _quiet_warn(message: str) -> None:
    """A RuntimeWarning from a free, which must neither raise (CuPy calls it
    from a finaliser) nor lose the block: with warnings as errors it is dropped."""
    try:
        warn_at_user(message, RuntimeWarning)
    except Exception:  # noqa: BLE001
        pass


def _wait_hint(a: int, s: int) -> str:
    if a in (0, 1):
        return "cupy.cuda.Stream.null.wait_event(other.record())"
    return "stream_a.wait_event(stream_b.record())"

