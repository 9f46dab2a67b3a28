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

The package re-exports these; its ``__all__`` (cupy_memstrat/__init__.py) is the one list of
public names.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator

import warnings

from . import backends as _backends
from .checks.options import CHECKS as _CHECKS, OPTION_NAMES as _CHECK_OPTIONS
from .errors import CuPyNotInstalledError, ManagedMemoryWarning, NoStrategyError
from .options import parse_spec
from .registry import get_registry
from .stats import Allocation, Stats
from .strategies.base import Strategy, check_stream


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
            :class:`Strategy` (returned as is, or wrapped in checks; other
            options are refused).
        **options: strategy options; they may not repeat one given in the
            spec string. ``backend=`` selects the CUDA seam (tests). Every
            strategy also takes the checking layer's options: ``check=``
            (``"streams,poison,redzone"``, any subset, or ``"all"``),
            ``on_finding``, ``quarantine_bytes``, ``quarantine_count``,
            ``redzone_bytes`` (:mod:`cupy_memstrat.checks`); with checks the
            result is a :class:`~cupy_memstrat.checks.CheckedStrategy`.

    Raises:
        ValueError: unknown strategy (the message lists the available ones),
            unknown option, bad option value, option given twice.
        TypeError: ``strategy`` is neither a str nor a Strategy.
        NoDeviceError: no CUDA device is available.
    """
    if isinstance(strategy, Strategy):
        from .checks.layer import CheckedStrategy

        given = sorted(set(options) & set(_CHECK_OPTIONS))
        if given and isinstance(strategy, CheckedStrategy):
            raise ValueError(
                f"check options {given} given with {strategy!r}, which is already checked; "
                "wrap the strategy it checks (.inner) instead"
            )
        check_options, checks = _check_options(options)
        if options:
            raise ValueError(
                f"options {sorted(options)} given with an existing strategy object {strategy!r}; "
                "options apply only when a strategy is created by name (check options excepted)"
            )
        return CheckedStrategy(strategy, **check_options) if checks else strategy
    cls, merged = _resolve(strategy, options)
    check_options, checks = _check_options(merged)  # bad check options fail before anything is made
    s = cls(**merged)
    if not checks:
        return s
    from .checks.layer import CheckedStrategy

    return CheckedStrategy(s, owns_inner=True, **check_options)


# _CHECK_OPTIONS: options of the checking layer (declared in cupy_memstrat.checks.options), accepted
# with every strategy


def _check_options(options: dict) -> tuple[dict, dict | None]:
    """Take the checking layer's options out of ``options`` and validate them.

    Returns:
        ``(the options taken, their parsed values)``; the parsed values are
        ``None`` when no check is on (``check`` absent, empty or ``"off"``).

    Raises:
        ValueError, TypeError: a bad value, an option for a check that is
            off, or check options without any check.
    """
    taken = {k: options.pop(k) for k in list(options) if k in _CHECK_OPTIONS}
    if not taken:
        return taken, None
    from .checks.layer import CheckedStrategy

    parsed = CheckedStrategy.parse_options(taken)
    if "check" not in taken or not parsed["check"]:
        extra = sorted(k for k in taken if k != "check")
        if extra:
            raise ValueError(f"option {extra[0]!r} needs checks to apply to: add check='{','.join(_CHECKS)}'")
        return taken, None
    CheckedStrategy.check_options_apply(parsed["check"], taken)
    return taken, parsed


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
    _, checks = _check_options(merged)
    parsed = cls.parse_options(merged)
    if checks:
        parsed.update({k: checks[k] for k in _CHECK_OPTIONS})
    return cls.name, parsed


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
    if isinstance(strategy, Strategy):
        strategy.installed()  # installed again (maybe inside checks): not let go when its arrays are gone
    before = current()
    try:
        cuda.set_allocator(s.cupy_allocator())
    except ValueError as exc:  # CuPy's own check, should the one above miss
        s.close()
        raise RuntimeError(_USE_INSIDE_USING) from exc
    if before is not None and before is not s:
        before.uninstalled()  # pool's direct route: no allocation through it may come to reap
    log_install(s, "use")
    return s


@dataclass(frozen=True)
class Install:
    """One installation of a strategy as CuPy's allocator, by :func:`use`,
    :func:`using` or ``record_history`` (see :func:`installs`)."""

    seq: int  #: its position, for ``installs(since=...)`` (from :func:`install_mark`)
    name: str  #: the strategy's registered name
    checked: bool  #: whether it runs under the checking layer (a CheckedStrategy)
    how: str  #: "use" or "record_history" (process-wide), "using" (the calling thread, a with block)
    thread: int  #: ``threading.get_ident()`` of the thread that installed it
    checks: frozenset = frozenset()  #: the checks it runs ("streams", "poison", "redzone"), if checked


_INSTALLS: collections.deque = collections.deque(maxlen=4096)  # the latest installations, oldest first
_install_lock = threading.Lock()
_install_last = [0]  # the seq of the latest installation (0: none yet)


def log_install(s: Strategy, how: str) -> None:
    """Record that ``s`` became CuPy's allocator (``how``: use, using, record_history), for
    :func:`installs`. Internal to the package: not in ``__all__``."""
    from .checks.layer import CheckedStrategy

    with _install_lock:
        _install_last[0] += 1
        seq = _install_last[0]
        checked = isinstance(s, CheckedStrategy)
        _INSTALLS.append(Install(seq, s.name, checked, how, threading.get_ident(),
                                 frozenset(s.checks) if checked else frozenset()))


def install_mark() -> int:
    """A position in the sequence of strategy installations, for
    :func:`installs` ``since=``."""
    with _install_lock:
        return _install_last[0]


def installs(since: int = 0) -> list[Install]:
    """The installations of strategies by :func:`use`, :func:`using` and
    :func:`~cupy_memstrat.record_history` in
    this process after the :func:`install_mark` ``since``, oldest first (the
    latest 4096 are kept). A tool that runs code it did not write (the pytest
    plugin) learns from it which strategies the code switched to, also ones
    it switched back from before returning.

    Raises:
        TypeError: ``since`` is not an int from :func:`install_mark`.
    """
    if isinstance(since, bool) or not isinstance(since, int):
        raise TypeError(f"since: expected an int from install_mark(), got {type(since).__name__} {since!r}")
    with _install_lock:
        return [i for i in _INSTALLS if i.seq > since]


ENV_VAR = "CUPY_MEMSTRAT"


def use_from_env(var: str = ENV_VAR) -> Strategy | None:
    """Install the strategy named by an environment variable, if it is set.

    ``CUPY_MEMSTRAT="managed:prefetch=on_new"`` in the environment, then
    ``cupy_memstrat.use_from_env()`` at the top of a program, is
    ``use("managed:prefetch=on_new")``. The same variable sets the strategy
    of ``python -m cupy_memstrat run`` and of the pytest plugin (below its own
    ``--gpumem-strategy`` / ``GPUMEM_STRATEGY``).

    Args:
        var: the variable's name.

    Returns:
        The installed strategy, or ``None`` (nothing installed) if the
        variable is unset or empty.

    Raises:
        ValueError: the variable holds a spec :func:`use` refuses; the message
            names the variable and its value.
        NoDeviceError, CuPyNotInstalledError, RuntimeError: as :func:`use`.
    """
    raw = os.environ.get(var, "")
    if not raw.strip():
        return None
    try:
        return use(raw.strip())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"environment variable {var}={raw!r}: {exc}") from None


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
    freed by it later, and it is closed (its cache and pools given back) when
    the last of them is freed, so a loop of ``using()`` blocks does not
    accumulate strategies. A strategy object passed in is left as it is.

    Raises:
        as :func:`create`.
    """
    cuda = _cupy_cuda()
    s = create(strategy, **options)
    if isinstance(strategy, Strategy):
        strategy.installed()  # in use again (maybe inside checks): not let go when its arrays are gone
    try:
        with cuda.using_allocator(s.cupy_allocator()):
            log_install(s, "using")
            yield s
    finally:
        if s is not strategy:  # made here: give back what nobody uses
            from .checks.layer import CheckedStrategy

            if isinstance(s, CheckedStrategy) and not s.owns_inner:
                # checks around a strategy passed in: that strategy is left as it is
                if any(s.live_allocations()):
                    s.drain()
            elif any(s.live_allocations()):
                s.trim()
            # closed now if nothing is alive, else once its last array is freed
            s.close_when_empty()


def current() -> Strategy | None:
    """The strategy CuPy allocates with in the calling thread, or ``None`` when
    CuPy's allocator is not a cupy_memstrat strategy (e.g. CuPy's default pool)."""
    try:
        import cupy.cuda
    except ImportError:
        return None
    return Strategy.owner_of_allocator(cupy.cuda.get_allocator())


def require_current() -> Strategy:
    """:func:`current`, or :class:`~cupy_memstrat.NoStrategyError` saying what
    CuPy's allocator is instead. Internal to the package: not in ``__all__``."""
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
    return require_current().stats(device)


def reset_peak(device: int | None = None, *, reserved: bool = True) -> None:
    """:meth:`Strategy.reset_peak` of :func:`current`: the peaks of
    ``device`` (default: current) set to the present values, the reserved
    one too unless ``reserved=False``.

    Raises:
        NoStrategyError: no strategy is installed in this thread.
        TypeError: ``reserved`` is not True or False.
        ValueError, TypeError: ``device`` is not a device ordinal.
    """
    require_current().reset_peak(device, reserved=reserved)


def live_allocations(device: int | None = None) -> list[Allocation]:
    """:meth:`Strategy.live_allocations` of :func:`current`.

    Raises:
        NoStrategyError: no strategy is installed in this thread.
    """
    return require_current().live_allocations(device)


def trim(keep_bytes=0, device: int | None = None) -> int:
    """:meth:`Strategy.trim` of :func:`current`: give cached, unused memory
    back to CUDA and return the bytes released (always 0 for a strategy that
    caches nothing, such as ``device``).

    Raises:
        NoStrategyError: no strategy is installed in this thread.
        TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
    """
    return require_current().trim(keep_bytes, device)


# -- managed memory: explicit prefetch and advice ----------------------------------

_UNSET = object()


def _memory_range(x, nbytes) -> tuple[int, int]:
    """``(ptr, nbytes)`` covered by a CuPy array, a ``MemoryPointer`` or a raw pointer."""
    if isinstance(x, bool) or isinstance(x, float):
        raise TypeError(f"x: expected a CuPy array, a cupy.cuda.MemoryPointer or an int pointer, got {x!r}")
    if isinstance(x, int):
        if nbytes is None:
            raise TypeError(f"nbytes: required with a raw pointer (0x{x:x}); give the range's size in bytes")
        if x <= 0:
            raise ValueError(f"x: expected a pointer > 0, got {x}")
        return x, _nbytes(nbytes)
    data = getattr(x, "data", None)
    if data is not None and hasattr(x, "strides") and hasattr(data, "ptr"):  # a CuPy array
        if nbytes is not None:
            raise TypeError("nbytes: only for a raw pointer or MemoryPointer; an array's range is its own")
        if x.size == 0:
            return data.ptr, 0
        lo = sum(min(0, (n - 1) * st) for n, st in zip(x.shape, x.strides))
        hi = sum(max(0, (n - 1) * st) for n, st in zip(x.shape, x.strides)) + x.itemsize
        return data.ptr + lo, hi - lo
    if hasattr(x, "ptr") and hasattr(x, "mem"):  # a MemoryPointer
        if nbytes is None:
            nbytes = x.mem.size - (x.ptr - x.mem.ptr)
            if nbytes < 0:
                raise ValueError(
                    f"x: the MemoryPointer 0x{x.ptr:x} lies {-nbytes} bytes past the end of its "
                    f"{x.mem.size}-byte allocation"
                )
        return x.ptr, _nbytes(nbytes)
    raise TypeError(
        f"x: expected a CuPy array, a cupy.cuda.MemoryPointer or an int pointer, got {type(x).__name__}"
    )


def _nbytes(nbytes) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes: expected an int number of bytes, got {type(nbytes).__name__} {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes: expected bytes >= 0, got {nbytes}")
    return nbytes


def _location(value, what: str, backend) -> int:
    """"device" (CuPy's current device), "host", or a device ordinal -> a CUDA location."""
    if isinstance(value, str) and value.strip().lower() in ("device", "host"):
        return _backends.HOST if value.strip().lower() == "host" else backend.get_device()
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, (bool, float, str)) and hasattr(value, "__index__"):  # int, numpy ints
        value = value.__index__()
        n = backend.device_count()
        if 0 <= value < n:
            return value
        raise ValueError(f"{what}: device {value} does not exist (0 <= device < {n})")
    raise ValueError(f"{what}: expected 'device', 'host' or a device ordinal, got {value!r}")


def _managed_range(x, nbytes, backend, what: str) -> tuple[int, int]:
    ptr, size = _memory_range(x, nbytes)
    if size and backend.memory_type(ptr) != "managed":
        kind = backend.memory_type(ptr)
        raise ValueError(
            f"{what}: the memory at 0x{ptr:x} is {kind} memory, not managed memory; prefetch and advice "
            "apply only to managed memory (cudaMallocManaged): allocate it under "
            "cupy_memstrat.use('managed')"
        )
    return ptr, size


def _cuda_call(what: str, ptr: int, size: int, backend, fn, *args, stream=None, location=None) -> None:
    try:
        fn(*args)
    except backend.Error as exc:
        backend.clear_last_error()
        status = getattr(exc, "status", None)
        name = _backends.error_name(status)
        if status == _backends.ERROR_INVALID_RESOURCE_HANDLE and stream is not None:
            why = f"the stream 0x{stream:x} is not a live stream (destroyed?)"
        elif status == _backends.ERROR_INVALID_DEVICE:
            where = "the host" if location == _backends.HOST else f"device {location}"
            why = (f"CUDA cannot target {where} here (a device without concurrentManagedAccess "
                   "cannot be a prefetch target)")
        else:
            why = (f"CUDA refused the range 0x{ptr:x} + {size} bytes: the whole range must be managed "
                   "memory from one allocation")
        raise ValueError(f"{what}: {why} ({name})") from exc


def _default_backend():
    """The CUDA seam of the strategy CuPy allocates with in this thread (a strategy made with
    ``backend=`` keeps it), else the process's."""
    s = current()
    return s.backend if s is not None else _backends.get_backend()


def prefetch(x, to="device", *, nbytes: int | None = None, stream=None, backend=None) -> None:
    """Move managed memory to a device or to the host ahead of use
    (``cudaMemPrefetchAsync``): the pages migrate in one transfer per 2 MiB
    block instead of one page fault per 64 KiB, several times faster than
    a fault-driven first GPU pass (docs/managed.md).

    Asynchronous: the move is queued on ``stream`` and later work on that
    stream sees the memory in place. The host is a valid target also on
    CUDA 13, where CuPy's own ``memPrefetchAsync`` cannot name it: this goes
    through ``cuda.bindings`` with a ``cudaMemLocation``.

    Args:
        x: a CuPy array (its whole extent, views included), a
            ``cupy.cuda.MemoryPointer`` (to the end of its allocation unless
            ``nbytes``), or an int pointer (with ``nbytes``).
        to: ``"device"`` (CuPy's current device, default), ``"host"``, or a
            device ordinal.
        nbytes: bytes from the pointer (raw pointers and MemoryPointers only).
        stream: a ``cupy.cuda.Stream`` (or ``ExternalStream``) or a raw
            handle; default: CuPy's current stream.
        backend: the CUDA seam (default: that of the strategy CuPy
            allocates with in this thread, else the real one).

    Raises:
        ValueError: the memory is not managed memory (e.g. from ``cudaMalloc``
            or CuPy's pool), CUDA refused the range, or a bad ``to``.
        TypeError: ``x`` or ``nbytes`` of the wrong type.
    """
    backend = backend or _default_backend()
    if stream is None:
        handle = None
    elif isinstance(stream, int) and not isinstance(stream, bool):
        if not 0 <= stream < 1 << 64:
            raise ValueError(f"stream: a raw handle is a cudaStream_t from 0 (the default stream) to 2**64 - 1, "
                             f"got {stream}")
        handle = stream
    else:
        try:
            check_stream(stream)  # a CuPy stream, its .ptr an int handle in range
        except TypeError as exc:  # prefetch also takes a raw handle or None: say so
            raise TypeError(f"{exc}; or a raw handle (int) or None") from None
        handle = stream.ptr
    ptr, size = _managed_range(x, nbytes, backend, "prefetch")
    loc = _location(to, "prefetch: to", backend)
    if not size:
        return
    if handle is None:
        handle = backend.current_stream(backend.get_device()).ptr
    _cuda_call("prefetch", ptr, size, backend, backend.mem_prefetch, ptr, size, loc, handle,
               stream=handle, location=loc)


def advise(
    x,
    *,
    preferred_location=_UNSET,
    accessed_by=_UNSET,
    unset_accessed_by=_UNSET,
    read_mostly=_UNSET,
    nbytes: int | None = None,
    backend=None,
) -> None:
    """Give CUDA advice about a range of managed memory (``cudaMemAdvise``).

    Only the keywords given are applied; advice stays until changed.

    Args:
        x: as :func:`prefetch`.
        preferred_location: ``"device"`` (CuPy's current device), ``"host"``,
            a device ordinal, or ``None`` to unset it. Alone it does not avoid
            page faults (docs/claims.md); together with :func:`prefetch` it
            keeps pages where they were sent.
        accessed_by: a location or list of them that get a mapping to the
            range (``cudaMemAdviseSetAccessedBy``).
        unset_accessed_by: a location or list of them to remove.
        read_mostly: ``True`` sets read-mostly (warns
            :class:`~cupy_memstrat.ManagedMemoryWarning`: harmful for data the
            GPU writes, see docs/managed.md), ``False`` unsets it.
        nbytes: as :func:`prefetch`.
        backend: as :func:`prefetch`.

    Raises:
        ValueError: not managed memory, CUDA refused the range, or a bad location.
        TypeError: ``x``, ``nbytes`` or ``read_mostly`` of the wrong type.
    """
    backend = backend or _default_backend()
    ptr, size = _managed_range(x, nbytes, backend, "advise")
    calls = []
    if isinstance(preferred_location, str) and preferred_location.strip().lower() in ("", "none", "off", "no"):
        preferred_location = None
    if preferred_location is not _UNSET:
        if preferred_location is None:
            calls.append((_backends.ADVISE_UNSET_PREFERRED_LOCATION, backend.get_device()))
        else:
            loc = _location(preferred_location, "advise: preferred_location", backend)
            calls.append((_backends.ADVISE_SET_PREFERRED_LOCATION, loc))
    for value, advice, what in (
        (accessed_by, _backends.ADVISE_SET_ACCESSED_BY, "accessed_by"),
        (unset_accessed_by, _backends.ADVISE_UNSET_ACCESSED_BY, "unset_accessed_by"),
    ):
        if value is _UNSET:
            continue
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split("+") if v]  # "host+1", as the strategy's option
        for v in value if isinstance(value, (list, tuple, set, frozenset)) else [value]:
            calls.append((advice, _location(v, f"advise: {what}", backend)))
    if read_mostly is not _UNSET:
        if not isinstance(read_mostly, bool):
            raise TypeError(f"read_mostly: expected True or False, got {read_mostly!r}")
        if read_mostly:
            warnings.warn(
                "advise(read_mostly=True): every write invalidates the read-only copies; for data the GPU "
                "writes it is harmful (a GPU pass writing a 1 GiB read-mostly buffer takes seconds, against "
                "about a millisecond without the advice; docs/managed.md)",
                ManagedMemoryWarning,
                stacklevel=2,
            )
        advice = _backends.ADVISE_SET_READ_MOSTLY if read_mostly else _backends.ADVISE_UNSET_READ_MOSTLY
        calls.append((advice, backend.get_device()))
    if not size:
        return
    for advice, loc in calls:  # all arguments checked before the first call
        _cuda_call("advise", ptr, size, backend, backend.mem_advise, ptr, size, advice, loc, location=loc)


# -- record_stream: memory another stream also uses -----------------------------------


def record_stream(array, stream) -> bool:
    """Tell the strategy that owns ``array``'s memory that ``stream`` also
    uses it, as PyTorch's ``Tensor.record_stream``: when the array is freed,
    no stream (its own included) gets the block again until the work queued
    on ``stream`` at the free is done.

    Use it when an array made on one stream is used by a kernel on another
    (cupy#8068): allocate on A, launch a kernel on B that reads it, drop it
    while B may still run. Without it every pool, CuPy's own included, hands
    the block to the next allocation on A at once, and B's kernel can read
    (or write) the next array's data. docs/streams.md shows which patterns
    each strategy keeps safe.

    How each strategy honours it: ``managed``, ``async`` and ``pool`` record
    an event on each recorded stream at the free and keep the block out of
    reach until the events are done (checked at later allocations, like
    PyTorch's caching allocator; :func:`trim` and out-of-memory recovery
    synchronise and take them back at once); on ``pool``'s default route,
    whose blocks are CuPy's pool's own, the array's memory object is kept
    until then, and the free is seen at the next allocation or read of the
    statistics. ``device`` needs nothing:
    ``cudaFree`` synchronises the device, so every stream's work is done
    before the block can be reused; it returns False. Under the checking
    layer, ``check="streams"`` counts recorded streams as ordered. A stream
    that only ever appears as a kernel's ``stream=`` argument, never current
    at an allocation or free and never recorded, is invisible to every
    allocator and to the checks.

    Args:
        array: a CuPy array (or a ``cupy.cuda.MemoryPointer``); a view marks
            its whole allocation.
        stream: a ``cupy.cuda.Stream`` or ``ExternalStream`` on the array's
            device (``Stream.null`` counts as that device's default stream).
            It is kept alive until the array is freed.

    Returns:
        bool: True if a strategy recorded it; False if there is nothing to
        record: an empty array, memory no cupy_memstrat strategy owns (CuPy's
        own pool, another library's), or a strategy whose frees wait for
        every stream (``device``).

    Raises:
        TypeError: ``array`` is not a CuPy array or ``MemoryPointer``, or
            ``stream`` is not a stream object (a raw handle is refused).
        ValueError: ``stream`` is on another device than ``array``, or was
            destroyed, where that can be told: a ``cupy.cuda.Stream`` is live
            while it exists, but CUDA cannot say whether the handle of an
            ``ExternalStream`` was destroyed (asking can crash the process), so
            that stays the caller's duty, as CUDA requires.
    """
    mem, device = _memory_of(array)
    check_stream(stream)
    handle = stream.ptr
    sdev = getattr(stream, "device_id", -1)
    if not isinstance(sdev, int) or isinstance(sdev, bool):
        raise TypeError(f"stream: its device_id should be an int, got {sdev!r}")
    if sdev < 0:  # Stream.null / Stream.ptds: the default stream of whichever device is current
        sdev = device
    if sdev != device:
        raise ValueError(
            f"stream: {stream!r} is on device {sdev}, but the array's memory is on device {device}; "
            "record a stream of the array's device"
        )
    if not mem.ptr or getattr(array, "size", 1) == 0:
        return False  # nothing allocated, or an empty view: no kernel reads it
    owner = _owner_of_block(mem.ptr, device)
    if owner is None:
        return False
    if owner.backend.stream_destroyed(handle):
        raise ValueError(
            f"stream: {stream!r} (handle 0x{handle:x}) is not a live stream on device {device}: it was destroyed"
        )
    recorded = owner.record_stream(mem.ptr, stream)
    if recorded:
        owner.hold_recorded(mem)  # pool's route "direct" keeps the block out of CuPy's pool
    return recorded


def _memory_of(array):
    """``(memory object, device)`` of a CuPy array or MemoryPointer."""
    data = getattr(array, "data", None)
    if data is not None and hasattr(array, "strides") and hasattr(data, "mem"):  # a CuPy array
        mem = data.mem
    elif hasattr(array, "mem") and hasattr(array, "ptr") and hasattr(array, "device_id"):  # a MemoryPointer
        mem = array.mem
    else:
        raise TypeError(
            f"array: expected a CuPy array or a cupy.cuda.MemoryPointer, got {type(array).__name__}"
        )
    device = getattr(mem, "device_id", None)
    if not isinstance(device, int):
        raise TypeError(f"array: its memory has no device ({type(mem).__name__})")
    return mem, device


def _owner_of_block(ptr: int, device: int):
    """The outermost strategy whose live table holds ``ptr`` on ``device``
    (a checking layer before the strategy it wraps), or None: the calling
    thread's current strategy first."""
    s = current()
    if s is not None and s.accounts.is_live(ptr, device):
        return s
    return Strategy.owner_of_pointer(ptr, device)
