"""Findings: what a check reports (:class:`Finding`), the error and warning
that carry them, and the process's record of them (:func:`findings`,
:func:`mark`, :func:`clear`, :func:`collect`), with the checked strategies
alive, which :func:`clear` and :func:`collect` go through (docs/checks.md).

``record``, ``warn_finding``, ``quiet_warn``, ``register_layer``,
``live_layers``, ``stream_name`` and ``thread_name`` are for the checking
layer's own modules.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

from .._userwarn import warn_at_user
from ..errors import MemstratError
from ..sizes import format_count
from ..stats import Origin

__all__ = ["KINDS", "Finding", "CheckError", "CheckWarning", "findings", "mark", "clear", "collect"]

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
        head = f"cupy_memstrat.checks: {format_count(n, 'finding')}"
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
                + (f" on stream {stream_name(self.alloc_stream)}" if self.alloc_stream is not None else "")
                + (f" in thread {self.alloc_thread}" if self.alloc_thread else "")
            )
        if self.free_site is not None or self.free_stream is not None:
            out.append(
                "freed at " + (str(self.free_site) if self.free_site else "(unknown)")
                + (f" while stream {stream_name(self.free_stream)} was current" if self.free_stream is not None else "")
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


def stream_name(ptr: int | None) -> str:
    if ptr is None:
        return "?"
    if ptr in (0, 1):
        return "0 (the legacy default stream)"
    if ptr == 2:
        return "2 (the per-thread default stream)"
    return f"0x{ptr:x}"


def thread_name(tid) -> str:
    # not threading.enumerate(): it takes a lock, and this runs in finalisers
    t = threading._active.get(tid)  # noqa: SLF001 - the lock-free lookup current_thread() uses
    return t.name if t is not None else f"thread {tid}"


# Shown (tracebacks, reprs, pickles) as the package's, where they have always been
# importable from, as cupy_memstrat.errors does for OutOfMemoryError
for _cls in (CheckError, CheckWarning, Finding):
    _cls.__module__ = "cupy_memstrat.checks"
del _cls


# -- the process's findings ------------------------------------------------------------------------

# Re-entrant: findings are recorded from CuPy's finalisers, which the garbage
# collector may run while this thread already holds the lock.
_lock = threading.RLock()
_findings: list[Finding] = []
_state = {"recorded": 0, "cleared": 0}  # findings ever recorded; how many of them clear() dropped
_layers: "weakref.WeakSet" = weakref.WeakSet()  # the checked strategies alive


def register_layer(layer) -> None:
    """Count ``layer`` (a CheckedStrategy) among the layers alive, for
    :func:`clear` and :func:`collect`."""
    _layers.add(layer)


def live_layers() -> list:
    return list(_layers)


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
    with _lock:
        _findings.clear()
        _state["cleared"] = _state["recorded"]
    for layer in live_layers():
        layer._to_raise.clear()
        layer.stream_order.forget_reported()
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
    layers = live_layers()
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: expected an int device ordinal or None, got {type(device).__name__} {device!r}")
        n = max((layer.backend.device_count() for layer in layers), default=0)
        if not 0 <= device < max(n, 1):
            raise ValueError(f"device: expected 0 <= device < {max(n, 1)}, got {device}")
    start = mark()
    raising = []
    for layer in layers:  # before any layer synchronises: a synchronisation makes them undecidable
        if layer.stream_order.deferred:
            layer.stream_order.poll()
    for layer in layers:
        layer._collect(device)
    for layer in live_layers():  # a layer's collection can report another's findings (shared kernels)
        if layer._to_raise:
            raising.extend(layer._to_raise)
            layer._to_raise.clear()
            layer._refresh_alarm()
    if raising:
        raise CheckError(raising)
    return findings(since=start)


def record(finding: Finding) -> None:
    with _lock:
        _findings.append(finding)
        _state["recorded"] += 1


def warn_finding(finding: Finding) -> None:
    warn_at_user(str(finding), CheckWarning)  # the user's line, past the checking layer


def quiet_warn(message: str) -> None:
    """A RuntimeWarning from a free, which must neither raise (CuPy calls it
    from a finaliser) nor lose the block: with warnings as errors it is dropped."""
    try:
        warn_at_user(message, RuntimeWarning)
    except Exception:  # noqa: BLE001
        pass
