"""The public functions: ``use``, ``using``, ``current`` and the module-level views.

How this relates to CuPy's own switches:

* :func:`use` calls ``cupy.cuda.set_allocator``: one process-wide allocator,
  seen by every thread that has no override.
* :func:`using` wraps ``cupy.cuda.using_allocator``: an override for the
  calling thread only, restored on exit (also when the body raises); other
  threads keep theirs. Blocks nest. CuPy refuses ``set_allocator`` inside a
  ``using_allocator`` block of the same thread, so :func:`use` raises there.
* Either way the strategy object stays alive as long as arrays it allocated
  do: an array is always freed by the strategy that allocated it, even after
  the allocator was switched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .errors import CuPyNotInstalledError, NoStrategyError
from .options import parse_spec
from .registry import get_registry
from .stats import Allocation, Stats
from .strategies.base import Strategy

__all__ = [
    "create",
    "validate",
    "use",
    "using",
    "current",
    "available",
    "stats",
    "reset_peak",
    "live_allocations",
    "trim",
]


def _cupy_cuda():
    try:
        import cupy.cuda
    except ImportError as exc:
        raise CuPyNotInstalledError(
            "CuPy is not installed: install a CuPy wheel, e.g. pip install 'cupy-memstrat[cuda13]' "
            "(or [cuda12])"
        ) from exc
    return cupy.cuda


def create(strategy: str | Strategy, **options) -> Strategy:
    """Build a strategy from a spec without installing it.

    Args:
        strategy: a registered name, optionally with options
            (``"device"``, ``"async:release_threshold=4GiB"``), or an existing
            :class:`Strategy` (returned as is; ``options`` must then be empty).
        **options: strategy options; they may not repeat one given in the
            spec string. ``backend=`` selects the CUDA seam (tests).

    Raises:
        ValueError: unknown strategy (the message lists the available ones),
            unknown option, bad option value, option given twice.
        TypeError: ``strategy`` is neither a str nor a Strategy.
        NoDeviceError: no CUDA device is available.
    """
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(
                f"options {sorted(options)} given with an existing strategy object {strategy!r}; "
                "options apply only when a strategy is created by name"
            )
        return strategy
    cls, merged = _resolve(strategy, options)
    return cls(**merged)


def _resolve(strategy: str, options: dict):
    name, spec_options = parse_spec(strategy)
    cls = get_registry().get(name)
    twice = sorted(set(spec_options) & set(options))
    if twice:
        raise ValueError(
            f"strategy spec {strategy!r}: option {twice[0]!r} is given both in the spec and as a keyword"
        )
    return cls, {**spec_options, **options}


def validate(strategy: str, **options) -> tuple[str, dict]:
    """Check a strategy spec and options without creating anything (no GPU needed).

    Returns:
        ``(canonical name, every option's parsed value)``.

    Raises:
        ValueError, TypeError: as :func:`create`.
    """
    options = dict(options)
    options.pop("backend", None)  # an object, not an option: checked when created
    cls, merged = _resolve(strategy, options)
    return cls.name, cls.parse_options(merged)


def use(strategy: str | Strategy, **options) -> Strategy:
    """Install a strategy as CuPy's process-wide allocator and return it.

    ``use("async:release_threshold=4GiB")`` and
    ``use("async", release_threshold="4GiB")`` are the same. Arrays allocated
    before stay valid and are freed by whatever allocated them.

    Raises:
        ValueError, TypeError: as :func:`create`.
        RuntimeError: called inside :func:`using` or
            ``cupy.cuda.using_allocator`` in this thread (CuPy forbids changing
            the global allocator there); nothing is installed.
        NoDeviceError, CuPyNotInstalledError: no GPU, or no CuPy.
    """
    cuda = _cupy_cuda()
    thread_local = getattr(cuda.memory, "_get_thread_local_allocator", lambda: None)
    if thread_local() is not None:
        raise RuntimeError(_USE_INSIDE_USING)
    s = create(strategy, **options)
    try:
        cuda.set_allocator(s.cupy_allocator())
    except ValueError as exc:  # CuPy's own check, should the one above miss
        s.close()
        raise RuntimeError(_USE_INSIDE_USING) from exc
    return s


_USE_INSIDE_USING = (
    "cupy_memstrat.use() sets CuPy's process-wide allocator, which CuPy forbids inside "
    "cupy_memstrat.using() / cupy.cuda.using_allocator() in the same thread; use "
    "cupy_memstrat.using() for a scoped, per-thread switch"
)


@contextlib.contextmanager
def using(strategy: str | Strategy, **options) -> Iterator[Strategy]:
    """Use a strategy in the calling thread for the duration of a ``with`` block.

    Built on ``cupy.cuda.using_allocator``: per-thread, nestable, restores the
    previous allocator on exit also when the body raises. Yields the strategy.

    A strategy made here from a spec gives back on exit what no array uses:
    it is closed if nothing it allocated is still alive, else trimmed
    (:meth:`Strategy.trim`); arrays that outlive the block stay valid and are
    freed by it later. A strategy object passed in is left as it is.

    Raises:
        as :func:`create`.
    """
    cuda = _cupy_cuda()
    s = create(strategy, **options)
    try:
        with cuda.using_allocator(s.cupy_allocator()):
            yield s
    finally:
        if s is not strategy:  # made here from a spec: give back what nobody uses
            if any(s.live_allocations()):
                s.trim()
            else:
                s.close()


def current() -> Strategy | None:
    """The strategy CuPy allocates with in the calling thread, or ``None`` when
    CuPy's allocator is not a cupy_memstrat strategy (e.g. CuPy's default pool)."""
    try:
        import cupy.cuda
    except ImportError:
        return None
    return Strategy._owner_of(cupy.cuda.get_allocator())


def _require_current() -> Strategy:
    s = current()
    if s is None:
        try:
            import cupy.cuda

            what = repr(cupy.cuda.get_allocator())
        except ImportError:
            what = "unavailable (CuPy is not installed)"
        raise NoStrategyError(
            "no cupy_memstrat strategy is installed in this thread (CuPy's allocator is "
            f"{what}); call cupy_memstrat.use('device') first, or ask a strategy object directly"
        )
    return s


def available() -> dict[str, str]:
    """Registered strategy names, each with a one-line description."""
    return get_registry().describe()


def stats(device: int | None = None) -> Stats:
    """:meth:`Strategy.stats` of :func:`current`.

    Raises:
        NoStrategyError: no strategy is installed in this thread.
    """
    return _require_current().stats(device)


def reset_peak(device: int | None = None) -> None:
    """:meth:`Strategy.reset_peak` of :func:`current`.

    Raises:
        NoStrategyError: no strategy is installed in this thread.
    """
    _require_current().reset_peak(device)


def live_allocations(device: int | None = None) -> list[Allocation]:
    """:meth:`Strategy.live_allocations` of :func:`current`.

    Raises:
        NoStrategyError: no strategy is installed in this thread.
    """
    return _require_current().live_allocations(device)


def trim(keep_bytes=0, device: int | None = None) -> int:
    """:meth:`Strategy.trim` of :func:`current`: give cached, unused memory
    back to CUDA and return the bytes released (always 0 for a strategy that
    caches nothing, such as ``device``).

    Raises:
        NoStrategyError: no strategy is installed in this thread.
        TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
    """
    return _require_current().trim(keep_bytes, device)
