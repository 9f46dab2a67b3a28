"""Catching stream misuse and use-after-free: a checking layer over any strategy.

``cupy_memstrat.use("async", check="streams,poison,redzone")`` (any subset;
``"all"`` for the three) wraps the strategy in a :class:`CheckedStrategy`:

``streams``
    Each allocation remembers its stream and thread. When a block is freed,
    every other stream of its device that the allocating or the freeing
    thread used while the block was alive (CuPy's current stream at an
    allocation or a free), and the stream current at the free, is asked
    whether it still has work queued (``cudaStreamQuery``). Such a stream may still be using the block,
    which goes back to the allocating stream for reuse. If nothing orders the
    two (the allocating stream has no work left that could wait for it, or,
    when both are busy, it finishes first: seen with events), that is a
    *cross-stream reuse* finding. The legacy default stream's implicit
    synchronisation with blocking streams counts as ordering. Within
    :func:`expect_stream` (the pytest plugin's ``--gpumem-stream-policy=fresh``),
    an allocation made while the legacy default stream is current is a
    *legacy stream* finding: code that hard-codes that stream is not ordered
    with the test's stream.
``poison``
    A freed block is filled with the byte ``0xFF`` on its stream (NaN in
    every floating-point format, -1 in signed integers) and held in a
    quarantine (``quarantine_bytes``, ``quarantine_count``) before it goes
    back to the strategy. When it leaves, a kernel checks that the poison is
    intact; if not, a *write after free* finding names where the block was
    allocated and freed.
``redzone``
    Each allocation gets ``redzone_bytes`` (rounded up to 256, which keeps
    CuPy's 256-byte alignment of the block) of guard bytes after it, filled
    with the canary byte ``0xCB`` and checked by a kernel when the block is
    freed: damage is an *out-of-bounds write* finding.

The kernels (csrc/checks.cu) are compiled at run time through CuPy (NVRTC) and
never allocate through the allocator they check. Their results arrive
asynchronously: a finding from a kernel is noticed at the next allocation
(through a host-mapped flag) or at :func:`collect`.

What happens with a finding is the strategy's ``on_finding`` option:
``"raise"`` (default) raises :class:`CheckError` at the next allocation
through that strategy or from :func:`collect` (a free runs inside CuPy's
finalisers, where raising is impossible); ``"warn"`` warns
:class:`CheckWarning` where it is found; ``"record"`` only records. Every
finding is also kept for :func:`findings`.

Limits, by design: the allocator sees allocations and frees, not kernel
launches. ``streams`` therefore cannot know which of a stream's queued
kernels touch a block: a stream that keeps working on other data after a
correct hand-off can be reported (synchronise it, or make the allocating
stream wait for it, before dropping the array). A stream used only through
explicit ``stream=`` arguments, with no allocation while it is current, is
invisible to it. See docs/checks.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from .._userwarn import warn_at_user
from ..errors import MemstratError
from ..stats import Origin

__all__ = [
    "CHECKS",
    "POISON_BYTE",
    "CANARY_BYTE",
    "KINDS",
    "Finding",
    "CheckError",
    "CheckWarning",
    "CheckedStrategy",
    "parse_checks",
    "checked",
    "findings",
    "clear",
    "collect",
    "expect_stream",
    "fresh_stream",
    "mark",
]

#: the checks, in the order they are reported
CHECKS = ("streams", "poison", "redzone")
#: the byte freed blocks are filled with (NaN in float16/32/64 and bfloat16, -1 in signed ints)
POISON_BYTE = 0xFF
#: the byte red zones are filled with
CANARY_BYTE = 0xCB

#: the kinds of finding, and the check that finds each
KINDS = {
    "cross-stream reuse": "streams",
    "legacy stream": "streams",
    "write after free": "poison",
    "out-of-bounds write": "redzone",
}


class CheckError(MemstratError):
    """Raised (policy ``on_finding="raise"``) at the next allocation after a
    finding, or by :func:`collect`. ``findings``: the :class:`Finding` s."""

    def __init__(self, found):
        self.findings = list(found)
        n = len(self.findings)
        head = f"cupy_memstrat.checks: {n} finding{'' if n == 1 else 's'}"
        super().__init__(head + ":\n" + "\n".join(str(f) for f in self.findings))

    def __reduce__(self):
        return (type(self), (self.findings,))


class CheckWarning(RuntimeWarning):
    """A check found a problem (policy ``on_finding="warn"``)."""


@dataclass(frozen=True)
class Finding:
    """One problem a check found.

    Attributes:
        kind: ``"cross-stream reuse"``, ``"legacy stream"``,
            ``"write after free"`` or ``"out-of-bounds write"``.
        check: the check that found it (``streams``, ``poison``, ``redzone``).
        message: one line saying what happened.
        device: CUDA device ordinal.
        ptr: the block's address; ``size``: bytes the program asked for.
        alloc_site / free_site: where the block was allocated / freed (the
            first frame outside CuPy and cupy_memstrat), when known.
        alloc_stream / free_stream / other_stream: raw stream handles (0 is
            the legacy default stream), when they apply.
        alloc_thread / free_thread: thread names.
        bad_bytes: bytes found damaged (poison, redzone); first_bad_offset:
            offset of the first, from the block's start.
        strategy: the checked strategy's name.
    """

    kind: str
    check: str
    message: str
    device: int = 0
    ptr: int = 0
    size: int = 0
    alloc_site: Origin | None = None
    free_site: Origin | None = None
    alloc_stream: int | None = None
    free_stream: int | None = None
    other_stream: int | None = None
    alloc_thread: str | None = None
    free_thread: str | None = None
    bad_bytes: int = 0
    first_bad_offset: int | None = None
    strategy: str = ""
    time: float = field(default_factory=time.time, compare=False)

    def sites(self) -> list[str]:
        """Lines naming where the block was allocated and freed."""
        out = []
        if self.alloc_site is not None or self.alloc_stream is not None:
            out.append(
                "allocated at " + (str(self.alloc_site) if self.alloc_site else "(unknown)")
                + (f" on stream {_stream_name(self.alloc_stream)}" if self.alloc_stream is not None else "")
                + (f" in thread {self.alloc_thread}" if self.alloc_thread else "")
            )
        if self.free_site is not None or self.free_stream is not None:
            out.append(
                "freed at " + (str(self.free_site) if self.free_site else "(unknown)")
                + (f" while stream {_stream_name(self.free_stream)} was current" if self.free_stream is not None else "")
                + (f" in thread {self.free_thread}" if self.free_thread else "")
            )
        return out

    def __str__(self) -> str:
        return "\n".join([f"[{self.kind}] {self.message}", *("    " + s for s in self.sites())])

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["alloc_site"] = str(self.alloc_site) if self.alloc_site else None
        d["free_site"] = str(self.free_site) if self.free_site else None
        return d


def _stream_name(ptr: int | None) -> str:
    if ptr is None:
        return "?"
    if ptr in (0, 1):
        return "0 (the legacy default stream)"
    if ptr == 2:
        return "2 (the per-thread default stream)"
    return f"0x{ptr:x}"


def parse_checks(value) -> frozenset:
    """The set of checks named by ``value``.

    Accepts ``"streams,poison,redzone"`` (``+``, ``|`` or spaces also
    separate), ``"all"``, ``""`` / ``"off"`` / ``"none"`` / ``None`` (no
    checks), or an iterable of names.

    Raises:
        ValueError: an unknown check name (the message lists the valid ones).
        TypeError: ``value`` is neither a str nor an iterable of str.
    """
    if value is None or value is False:
        return frozenset()
    if isinstance(value, str):
        raw = value.replace("+", ",").replace("|", ",").replace(" ", ",")
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    else:
        if isinstance(value, dict) or not hasattr(value, "__iter__"):
            raise TypeError(
                f"check: expected a str such as 'streams,poison,redzone' or a list of names, "
                f"got {type(value).__name__} {value!r}"
            )
        try:
            names = list(value)
        except TypeError:
            raise TypeError(
                f"check: expected a str such as 'streams,poison,redzone' or a list of names, "
                f"got {type(value).__name__} {value!r}"
            ) from None
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"check: expected check names (str), got {value!r}")
        names = [n.strip().lower() for n in names]
    if names in (["off"], ["none"], ["no"], ["false"]):
        return frozenset()
    if "all" in names:
        names = [n for n in names if n != "all"] + list(CHECKS)
    if any(n in ("off", "none", "no", "false") for n in names):
        raise ValueError(f"check: 'off' stands alone (no checks), not with others, got {value!r}")
    bad = [n for n in names if n not in CHECKS]
    if bad:
        raise ValueError(f"check: unknown check {bad[0]!r} in {value!r}; valid: {', '.join(CHECKS)}, all or off")
    return frozenset(names)


# -- the process's findings ------------------------------------------------------------------------

# Re-entrant: findings are recorded from CuPy's finalisers, which the garbage
# collector may run while this thread already holds the lock.
_lock = threading.RLock()
_findings: list[Finding] = []
_state = {"recorded": 0, "cleared": 0}  # findings ever recorded; how many of them clear() dropped
# thread ident -> (stream handle, its device or -1 for any) the thread's code should use
_expected: dict[int, tuple[int, int]] = {}


def mark() -> int:
    """A position in the sequence of findings, for :func:`findings` ``since=``
    (it survives :func:`clear`)."""
    with _lock:
        return _state["recorded"]


def findings(since: int | None = None) -> list[Finding]:
    """Every finding recorded in this process since the last :func:`clear`
    (or, with ``since``, since that :func:`mark`), oldest first, from all
    checked strategies, whatever their ``on_finding``. Findings of kernels
    still running appear after :func:`collect`.

    Raises:
        TypeError: ``since`` is not an int from :func:`mark`.
    """
    with _lock:
        if since is None:
            return list(_findings)
        if isinstance(since, bool) or not isinstance(since, int):
            raise TypeError(f"since: expected an int from checks.mark(), got {type(since).__name__} {since!r}")
        return _findings[max(0, since - _state["cleared"]):]


def clear() -> None:
    """Forget the recorded findings (and any not yet raised); legacy-stream
    sites already reported are reported again."""
    from .layer import _live_layers

    with _lock:
        _findings.clear()
        _state["cleared"] = _state["recorded"]
    for layer in _live_layers():
        layer._to_raise.clear()
        layer._legacy_sites.clear()
        layer._refresh_alarm()


def collect(device: int | None = None) -> list[Finding]:
    """Finish every pending check now and return the findings made during
    this call (:func:`findings` has all of them, also those found earlier,
    e.g. at an allocation).

    For each checked strategy: quarantined blocks are verified and given back
    to the strategy, queued kernels are waited for (``cudaDeviceSynchronize``
    on the devices with checks pending) and read, and stream checks waiting
    on events are decided.

    Args:
        device: only this device (default: every device).

    Raises:
        CheckError: a checked strategy with ``on_finding="raise"`` has
            findings not yet raised (those found here included).
    """
    from .layer import _live_layers

    layers = _live_layers()
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: expected an int device ordinal or None, got {type(device).__name__} {device!r}")
        n = max((layer.backend.device_count() for layer in layers), default=0)
        if not 0 <= device < max(n, 1):
            raise ValueError(f"device: expected 0 <= device < {max(n, 1)}, got {device}")
    start = mark()
    raising = []
    for layer in layers:  # before any layer synchronises: a synchronisation makes them undecidable
        if layer._deferred:
            layer._poll_deferred()
    for layer in layers:
        layer._collect(device)
    for layer in _live_layers():  # a layer's collection can report another's findings (shared kernels)
        if layer._to_raise:
            raising.extend(layer._to_raise)
            layer._to_raise.clear()
            layer._refresh_alarm()
    if raising:
        raise CheckError(raising)
    return findings(since=start)


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
            :func:`cupy_memstrat.cuda.get_backend`).

    Raises:
        NoDeviceError, CuPyNotInstalledError: no GPU, or no CuPy.
    """
    from .. import cuda as _cuda

    b = backend if backend is not None else _cuda.get_backend()
    if not isinstance(b, _cuda.RealBackend) and not callable(getattr(b, "stream", None)):
        raise TypeError(
            "backend: expected a CUDA backend (cupy_memstrat.cuda.get_backend() or a "
            f"cupy_memstrat.testing.FakeBackend), got {type(b).__name__} {b!r}"
        )
    if isinstance(b, _cuda.RealBackend):
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


def _record(finding: Finding) -> None:
    with _lock:
        _findings.append(finding)
        _state["recorded"] += 1


def checked(strategy, check="all", **options):
    """Wrap an existing strategy object in the checking layer (what
    ``use(name, check=...)`` does for a strategy made by name).

    Args:
        strategy: a :class:`cupy_memstrat.Strategy` (not already checked).
        check: the checks (see :func:`parse_checks`); default all three.
        **options: ``on_finding``, ``quarantine_bytes``, ``quarantine_count``,
            ``redzone_bytes``, ``track_origins``.

    Raises:
        TypeError: ``strategy`` is not a Strategy, or is already checked.
        ValueError: a bad option value, or no check named.
    """
    from .layer import CheckedStrategy

    if "backend" in options:
        raise TypeError("backend: the checks use the wrapped strategy's backend; pass backend= when creating it")
    return CheckedStrategy(strategy, check=check, **options)


def __getattr__(name):
    if name == "CheckedStrategy":
        from .layer import CheckedStrategy

        return CheckedStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _warn(finding: Finding) -> None:
    warn_at_user(str(finding), CheckWarning)  # the user's line, past the checking layer
