"""The :class:`Strategy` base class: the interface every strategy has, over parts it holds.

A strategy subclass provides two hooks, the strategy contract
(docs/strategies.md, "Writing a strategy"):

* ``allocate(size) -> ptr``: obtain ``size`` bytes (> 0) on the current
  device (CuPy's, which is also the ``device`` that :meth:`Strategy.raw_malloc`
  records) or raise ``backend.Error``;
* ``deallocate(ptr)``: give them back;

and, if it caches, calls ``record_reserved(device, delta)`` when it takes
memory from CUDA or gives it back.

Everything else is shared. :class:`Strategy` is the public interface (size
validation, the pointer-level calls, the hot path built once, statistics,
``record_stream``, ``close``, CuPy's allocator callable) over parts that own
their state, each a class of its own module in this package:

* ``accounts`` (:class:`~cupy_memstrat.strategies.accounts.Accounts`): the
  live tables, origins and counters, folded from the hot path's reports;
* ``deferred`` (:class:`~cupy_memstrat.strategies.deferred.DeferredFrees`):
  ``record_stream``'s recorded streams and the frees waiting for them;
* ``recovery`` (:class:`~cupy_memstrat.strategies.recovery.Recovery`): out of
  memory in CuPy's order, the error and its snapshot;
* :data:`~cupy_memstrat.strategies.reachable.REACHABLE`: the strategies kept
  reachable while they have handed out memory;
* :mod:`~cupy_memstrat.strategies.cupy_route`: CuPy's allocator callable over
  a hot path.

The hot path takes no lock. In C (below) each allocation is one dict insert
and an update of the device's counts, C integers (the running sum of sizes,
its largest value, the numbers of allocations and frees; a free: one dict pop
and the same update), all under the GIL with no Python code in between;
:meth:`Strategy.stats` drains them into the counters in one C call. In Python
each allocation is one dict insert and one ``list.append`` of its size to a
per-device event buffer (a free: one dict pop and one append of minus its
size), operations that are atomic in CPython, and :meth:`Strategy.stats`
folds that buffer, in order, into the counters. Either way
``peak_bytes_in_use`` is the exact peak of the sequence of allocations and
frees, also with many threads. Taking no lock also
matters because CuPy frees memory from finalisers, which the garbage collector
can run in the middle of an allocation on the same thread: a lock there
deadlocks (CuPy's test suite runs into it).

The hot path exists twice: in C (``cupy_memstrat._hotpath``, built from
``csrc/hotpath.c`` when the package is installed with a C compiler) and as
Python closures. The C one is the implementation; the Python one is its
reference model, which tests run beside it (the same calls, the same
statistics, tables and origins), and what a build without a C compiler runs,
slower (docs/benchmarks.md has the cost). The environment variable
``CUPY_MEMSTRAT_HOT_PATH`` = ``auto`` (default) / ``c`` / ``python`` chooses,
read when a strategy builds its hot path (its first allocation).
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import operator
import os
import threading
import weakref
from typing import ClassVar

from .. import backends as _backends
from .._userwarn import warn_at_user
from ..errors import InvalidFreeWarning
from ..options import Option, as_frames, as_output_file
from ..sizes import parse_size
from ..stats import Allocation, Stats, origin_capture
from ._contract import HOOKS, NOT_HOOKS, ProvidedHooks
from ._layout import block, segment
from ._support import FOLD_AT, SIZE_T_LIMIT, c_accounting, check_size, hot_path_status
from .accounts import Accounts
from .cupy_route import cupy_malloc_over
from .deferred import DeferredFrees, check_stream
from .reachable import REACHABLE
from .recovery import Recovery

__all__ = ["Strategy", "check_size", "check_stream", "hot_path_status"]

#: id(CuPy's PythonFunctionAllocator) -> a weak reference to the strategy that made it (owner_of_allocator)
_pfa_owners: dict = {}

#: the default of every strategy's ``oom_snapshot`` option
OOM_SNAPSHOT_ENV = "CUPY_MEMSTRAT_OOM_SNAPSHOT"


class Strategy:
    """A named allocator policy that CuPy can use as its allocator.

    Create one with :func:`cupy_memstrat.use` / :func:`~cupy_memstrat.using`
    (by name), or directly (``DeviceStrategy(track_origins=True)``).

    Args:
        backend: the CUDA seam (:mod:`cupy_memstrat.backends`); default: the real
            CUDA backend. Pass a :class:`cupy_memstrat.testing.FakeBackend` to
            run without a GPU.
        **options: the options of :attr:`option_specs`. Every strategy has
            ``track_origins``, default ``False``: record where each live
            allocation came from, for :meth:`live_allocations` (``True``: the
            first frame outside CuPy and cupy_memstrat; N from 1 to 128: up to
            N such frames); it costs a stack walk per allocation (docs/debugging.md).
            And ``oom_snapshot``, default ``None`` (or the environment
            variable ``CUPY_MEMSTRAT_OOM_SNAPSHOT``): a file path, checked
            now, where an out-of-memory error writes the live allocations,
            the statistics and a recording's recent events before it is
            raised (docs/debugging.md).

    Raises:
        ValueError: an unknown option (the message lists the valid ones), a
            bad option value, or a bad ``CUPY_MEMSTRAT_HOT_PATH`` or
            ``CUPY_MEMSTRAT_OOM_SNAPSHOT``.
        NoDeviceError: no backend given and no CUDA device is available.
        CuPyNotInstalledError: no backend given and CuPy is not installed.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    #: strategy-specific options, added to the common ones.
    options: ClassVar[tuple[Option, ...]] = ()
    #: True if ``bytes_reserved`` always equals ``bytes_in_use``: the strategy
    #: caches nothing. A strategy that caches sets it to False and reports
    #: what it takes from and gives back to CUDA with :meth:`record_reserved`.
    reserved_is_in_use: ClassVar[bool] = True
    #: True if freeing a block waits for the work of every stream, as
    #: ``cudaFree`` of ``cudaMalloc`` memory does (it synchronises the
    #: device): :meth:`record_stream` then has nothing to add.
    free_waits_for_all_streams: ClassVar[bool] = False
    #: CuPy's arrays see blocks of sizes rounded up to a multiple of this
    #: (``memptr.mem.size``), and ``bytes_in_use`` counts them so: 512 for the
    #: pooling strategies, as CuPy's own ``MemoryPool`` rounds; 1 (the size
    #: as requested) for a strategy that hands out exactly what CUDA gives.
    block_granule: ClassVar[int] = 1
    #: False for a strategy whose hot path exists in Python only (``async``
    #: for now): ``info`` and :func:`hot_path_status` say so per strategy.
    has_c_hot_path: ClassVar[bool] = True
    #: The module a strategy needs besides CuPy (``"torch"``, ``"rmm"``), or
    #: None: :meth:`unavailable` says when it is missing.
    requires: ClassVar[str | None] = None

    common_options: ClassVar[tuple[Option, ...]] = (
        Option(
            "track_origins",
            as_frames,
            False,
            "record where each live allocation was made: True, the first frame outside CuPy and "
            "cupy_memstrat; N (1-128, 1 being True), up to N such frames",
        ),
        Option(
            "oom_snapshot",
            as_output_file,
            None,
            "a JSON file written when an allocation finally fails (after the recovery): the live allocations "
            "with origins, the stats and the recent events when recording (default: $CUPY_MEMSTRAT_OOM_SNAPSHOT)",
        ),
    )

    def __init__(self, *, backend=None, **options):
        self.config = self.parse_options(options)
        env = os.environ.get(OOM_SNAPSHOT_ENV, "")
        if self.config.get("oom_snapshot") is None and env.strip() and "oom_snapshot" not in options:
            self.config["oom_snapshot"] = as_output_file(env, f"environment variable {OOM_SNAPSHOT_ENV}")
        hot_path_status()  # a bad CUPY_MEMSTRAT_HOT_PATH is refused here, before anything is made
        if backend is None:
            backend = _backends.get_backend()
        else:
            _backends.require(backend, _backends.CoreBackend)  # TypeError naming what it lacks
        self.backend = backend
        self._track_origins = self.config["track_origins"]
        self._Error = backend.Error
        n = backend.device_count()
        #: the live tables and counters (:class:`~cupy_memstrat.strategies.accounts.Accounts`)
        self.accounts = Accounts(n)
        self._cupy_malloc = self._pfa = None
        self._hot_malloc = self._hot_free = None  # the hot path, built on first use (_hot_path)
        self._build_lock = threading.RLock()  # one build, whichever threads allocate first
        #: "c" or "python": the hot path built on first use (None before).
        self.hot_path: str | None = None
        self._pinned = False
        #: record_stream's recorded streams and the frees waiting for them
        #: (:class:`~cupy_memstrat.strategies.deferred.DeferredFrees`)
        #: the out-of-memory path (:class:`~cupy_memstrat.strategies.recovery.Recovery`)
        self.recovery = Recovery(self)
        self.deferred = DeferredFrees(backend, lambda: self.name, self._give_back_pending, self._settle)
        # _watch[0]: called when the last live allocation is freed (using() lets go)
        self._watch: list = [None]
        # the recording (cupy_memstrat.record_history) that wants segment and out-of-memory
        # events, off the hot path; None when nothing records
        #: the recording (:func:`cupy_memstrat.record_history`) that takes this strategy's segment and
        #: out-of-memory events, off the hot path; None when nothing records
        self.history = None
        #: None, or a callable returning text added to this strategy's out-of-memory messages
        #: (cupy_memstrat.dask's plugin names the worker and the task)
        self.oom_context = None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this strategy cannot be made in this environment (the module
        it :attr:`requires` is not installed), or None. Imports nothing: a
        module that is installed but fails at creation (PyTorch without
        CUDA) is reported then, by the constructor."""
        if not cls.requires:
            return None
        top = cls.requires.partition(".")[0]  # a submodule's package would be imported to find it
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError) as exc:  # a broken package, or a module without a spec
            return f"strategy {cls.name!r} needs the module {cls.requires!r}, which cannot be found: {exc}"
        return None if found else f"strategy {cls.name!r} needs the module {cls.requires!r}, which is not installed"

    # -- options ---------------------------------------------------------------
    @classmethod
    def option_specs(cls) -> tuple[Option, ...]:
        """Every option this strategy accepts (common ones first)."""
        return cls.common_options + cls.options

    @classmethod
    def parse_options(cls, options: dict) -> dict:
        """Validate ``options`` and return every option's value (defaults filled in).

        Raises:
            ValueError: an unknown option (the message lists the valid ones) or
                a bad value (the message names the option and the value).
        """
        specs = {o.name: o for o in cls.option_specs()}
        unknown = sorted(set(options) - set(specs))
        if unknown:
            valid = ", ".join(sorted(specs)) or "(none)"
            close = difflib.get_close_matches(str(unknown[0]), list(specs), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"strategy {cls.name!r}: unknown option {unknown[0]!r}{hint}; valid options: {valid}"
            )
        config = {}
        for name, spec in specs.items():
            config[name] = (
                spec.parse(options[name], f"{cls.name}: option {name}") if name in options else spec.default
            )
        return config

    # -- the pointer-level interface ----------------------------------------------
    def raw_malloc(self, size: int, device: int | None = None) -> int:
        """Allocate ``size`` bytes on the current device and return the pointer.

        ``device``, if given, must be the current CUDA device (CUDA allocates
        there). A size of 0 returns the null pointer and allocates nothing
        (CuPy's convention for empty arrays).

        Raises:
            TypeError, ValueError: ``size`` is not an int >= 0, or ``device``
                is not the current device.
            cupy.cuda.memory.OutOfMemoryError: CUDA (or a strategy's guard)
                refused; the message names the request and the statistics.
                Existing allocations are untouched.
        """
        size = check_size(size)
        current = self.backend.get_device()
        if device is not None and self._device_or_current(device) != current:
            raise ValueError(
                f"device: raw_malloc allocates on the current device ({current}), got device={device}; "
                "make it current first (cupy.cuda.Device(d).use())"
            )
        if size == 0:
            return 0
        if not self._pinned:
            self._pin()
        return (self._hot_malloc or self._hot_path()[0])(size, current)

    def raw_free(self, ptr: int, device: int | None = None) -> None:
        """Free a pointer from :meth:`raw_malloc`.

        Never raises an error of its own (CuPy calls it from a finaliser):
        freeing the null pointer does nothing; an unknown, already-freed or
        non-integer pointer is not passed to CUDA, is counted in
        ``n_invalid_frees`` and warned about with
        :class:`~cupy_memstrat.InvalidFreeWarning`; a CUDA error from the free
        is warned about as a ``RuntimeWarning``. (With warnings turned into
        errors, the warning is raised.) ``device`` is only a hint (CuPy passes
        the allocating device): a block is always freed for, and accounted to,
        the device that allocated it.
        """
        __tracebackhide__ = True  # pytest shows the user's frames under -W error
        if type(ptr) is not int:
            if isinstance(ptr, (bool, float)) or not hasattr(ptr, "__index__"):
                self._invalid_free(ptr, 3)  # a float equal to a pointer would hash like it
                return
            ptr = operator.index(ptr)
        if device is not None and (type(device) is not int or not 0 <= device < self.accounts.n_devices):
            device = None  # a bad hint: the block is found by its pointer
        (self._hot_free or self._hot_path()[1])(ptr, device, 2)

    def hot_path_functions(self):
        """``(malloc, free)``: the two functions CuPy's ``PythonFunctionAllocator`` calls,
        ``malloc(size, device) -> ptr`` (``size`` > 0 bytes, ``device`` the current one) and
        ``free(ptr, device)``, built on the first call and the same for every thread after it.
        For code that makes its own CuPy allocator over a strategy (the history recorder does):
        they skip :meth:`raw_malloc`'s checks of their arguments. :attr:`hot_path` then says
        which one they are (``"c"`` or ``"python"``). Called with anything else than CuPy
        passes (an int size > 0, the current device, a pointer ``malloc`` returned), what they
        do is not defined: the C one refuses some such calls, its Python model not all."""
        return self._hot_path()

    def _hot_path(self):
        """``(malloc, free)``, built by :meth:`_build_hot_path` once: threads
        making a strategy's first allocations at the same time get the same
        two functions (two C hot paths would each keep counts of their own, and
        the peak drained from them one after the other would not be the peak)."""
        if self._hot_malloc is None:
            with self._build_lock:
                if self._hot_malloc is None:
                    self._build_hot_path()
        return self._hot_malloc, self._hot_free

    def _build_hot_path(self):
        """Build ``malloc(size, device) -> ptr`` and ``free(ptr, device)``,
        the two functions CuPy's ``PythonFunctionAllocator`` calls, and keep
        them as ``self._hot_malloc`` / ``self._hot_free``.

        They are closures over the strategy's tables (no attribute lookups)
        and take no lock (see the module docstring). ``malloc`` gets a size_t
        > 0 and the current device; ``free`` gets the allocating device as a
        hint. A strategy with a faster way may override this; it must keep
        the same accounting: ``events[device].append(+size)`` before the
        ``live`` insert, ``append(-size)`` after the ``live`` pop (or, in C,
        an ``Accounting`` from :meth:`_new_accounting`).
        """
        (allocate, deallocate), Error = self._hooks(), self._Error
        accounts = self.accounts
        events, live, origins = accounts.events, accounts.live, accounts.origins
        recover, fold, track = self._recover_hook, accounts.fold, self._track_origins
        capture = origin_capture(track)  # the first frame, or track_origins=N frames
        unknown_free, name = self._unknown_free, self.name
        deferred = self.deferred
        recorded, pending, poll, defer, watch = (deferred.recorded, deferred.pending, deferred.poll, deferred.defer,
                                                 self._watch)
        Accounting = c_accounting(track)
        if Accounting is not None:
            acc = self._new_accounting(
                Accounting, unknown_free, recover,
                allocate=allocate, deallocate=deallocate, dealloc_failed=self._deallocation_failed,
                recorded=recorded, defer=defer, pending=pending, poll=poll, watch=watch,
            )
            self._hot_malloc, self._hot_free, self.hot_path = acc.malloc, acc.free, "c"
            return acc.malloc, acc.free

        def malloc(size, device):
            if pending:  # blocks freed with record_stream() whose streams may be done
                poll()
            try:
                ptr = allocate(size)
            except Error as exc:
                ptr = recover(size, device, exc)  # CuPy's order: give back, collect, retry; or raise
            ev = events[device]
            ev.append(size)  # before the insert (the accounting rule, strategies/_support.py)
            if track:
                origins[ptr] = capture(1)
            live[device][ptr] = size
            if len(ev) > FOLD_AT:
                fold(device)
            return ptr

        def free(ptr, device, stacklevel=1):
            # stacklevel: extra frames between the user and this function for
            # warnings (1 when CuPy calls it, 2 through raw_free)
            try:
                size = live[device].pop(ptr)  # CuPy passes the allocating device
            except (KeyError, IndexError, TypeError):
                device, size = unknown_free(ptr, stacklevel)
                if size is None:
                    return
            if track:
                origins.pop(ptr, None)
            events[device].append(-size)  # after the pop (the accounting rule, strategies/_support.py)
            if recorded and ptr in recorded:
                defer(ptr, size, device)  # other streams use it: given back once they are done
            else:
                try:
                    deallocate(ptr)
                except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
                    warn_at_user(
                        f"{name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
                        RuntimeWarning)
            if watch[0] is not None and not live[device]:
                watch[0]()

        self._hot_malloc, self._hot_free, self.hot_path = malloc, free, "python"
        return malloc, free

    # -- accounting off the hot path -------------------------------------------
    def _new_accounting(self, Accounting, unknown_free, failed, **tables):
        """The C hot path's ``Accounting`` over this strategy's live tables
        (``csrc/hotpath.c``), its counts drained into the counters by
        :meth:`Accounts.fold <cupy_memstrat.strategies.accounts.Accounts.fold>`.
        With ``track_origins`` it records each allocation's origin in
        ``accounts.origins`` as the Python version does (the capture is called
        from C, with no Python frame of its own to skip)."""
        capture = origin_capture(self._track_origins)
        if capture is not None:
            tables.update(origins=self.accounts.origins, capture=functools.partial(capture, 0))
        acc = Accounting(self.accounts.live, unknown_free, failed, self._Error, **tables)
        self.accounts.add_drain(acc.drain)
        return acc

    # -- the contract: the hooks a subclass provides -----------------------------

    #: True for a strategy that builds a hot path of its own (managed, async): it has no hooks
    own_hot_path = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hooks = [n for n in (*HOOKS, *NOT_HOOKS) if n in vars(cls)]
        if hooks and super(cls, cls).own_hot_path:  # (the value cls inherits)
            raise TypeError(f"{cls.__name__}: {', '.join(hooks)} would never be called: {cls.__mro__[1].__name__} "
                            "builds a hot path of its own; subclass cupy_memstrat.Strategy (or DeviceStrategy) to "
                            "provide hooks (docs/strategies.md)")
        for wrong, hook in NOT_HOOKS.items():  # refused at the class statement, not ignored at every call
            if wrong in vars(cls) and any(getattr(cls, hook) is vars(k)[hook] for k in (Strategy, ProvidedHooks)):
                raise TypeError(f"{cls.__name__}.{wrong} is not a hook: name it {hook} (docs/strategies.md, "
                                "'Writing your own strategy')")

    def allocate(self, size: int) -> int:
        """The subclass's hook: obtain ``size`` bytes (> 0) on the current
        device and return the pointer (an int).

        Called by the hot path only, after the size was checked; the base
        class counts it. Raise the backend's ``Error`` (CUDA's
        ``cudaErrorMemoryAllocation`` for out of memory): the base class
        then recovers in CuPy's order (gives cached memory back, collects,
        retries) or raises :class:`~cupy_memstrat.OutOfMemoryError`.
        ``managed``, ``async`` and ``expandable`` build hot paths of their own and
        have no hook to override.
        """
        if self.own_hot_path:
            raise NotImplementedError(f"{type(self).__name__} builds a hot path of its own and has no allocate "
                                      "hook: allocate with raw_malloc(size)")
        raise NotImplementedError(f"{type(self).__name__} defines no allocate(size) -> ptr")

    def deallocate(self, ptr: int) -> None:
        """The subclass's hook: give back a pointer :meth:`allocate` returned.
        Called once per pointer, after the accounting; an exception is
        turned into a ``RuntimeWarning`` (CuPy frees from finalisers)."""
        if self.own_hot_path:
            raise NotImplementedError(f"{type(self).__name__} builds a hot path of its own and has no deallocate "
                                      "hook: free with raw_free(ptr)")
        raise NotImplementedError(f"{type(self).__name__} defines no deallocate(ptr)")

    def record_reserved(self, device: int, delta: int) -> None:
        """For caching strategies: ``delta`` bytes (an int) were taken from
        (> 0) or given back to (< 0) CUDA on ``device`` (``bytes_reserved``
        and its peak). Off the hot path (pool growth and trims): it takes a lock.

        Raises:
            TypeError: ``device`` or ``delta`` is not an int (bool included).
            ValueError: ``device`` is not a device of this strategy's backend.
        """
        for what, v in (("device", device), ("delta", delta)):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"record_reserved: {what}: expected an int, got {type(v).__name__} {v!r}")
        device, delta = operator.index(device), operator.index(delta)
        n = self.accounts.n_devices
        if not 0 <= device < n:
            raise ValueError(f"record_reserved: device: expected 0 <= device < {n}, got {device}")
        self.accounts.add_reserved(device, delta)

    def _hooks(self):
        """``(allocate, deallocate)`` as the hot path calls them: for each, the
        most derived definition, the instance's own first."""
        return tuple(getattr(self, n) for n in HOOKS)

    # -- statistics and the live table, read off the hot path --------------------

    # -- statistics ------------------------------------------------------------
    def _settle(self) -> None:
        """Before the statistics or the live table are read: account frees
        that a strategy sees only by looking (``pool``'s route ``"direct"``
        holds a block :func:`cupy_memstrat.record_stream` recorded until its
        arrays are gone). Nothing here."""

    def hold_recorded(self, mem) -> None:
        """Called by :func:`cupy_memstrat.record_stream` after it recorded a stream on the
        block of CuPy's memory object ``mem`` (this strategy's): a strategy whose memory
        objects are not its own may keep ``mem`` until the recorded streams are done
        (``pool``'s route ``"direct"``). Nothing here; a program does not call it."""

    def uninstalled(self) -> None:
        """Called by :func:`cupy_memstrat.use` when it installs another allocator in this
        one's place: let go of anything kept for :meth:`hold_recorded`, since no allocation
        through this strategy may come to poll. Nothing here; a program does not call it."""

    def _device_or_current(self, device):
        if device is None:
            return self.backend.get_device()
        if isinstance(device, bool) or not hasattr(device, "__index__"):
            raise TypeError(f"device: expected an int device ordinal, got {type(device).__name__} {device!r}")
        device = operator.index(device)
        n = self.backend.device_count()
        if not 0 <= device < n:
            raise ValueError(f"device: expected 0 <= device < {n}, got {device}")
        return device

    def _read_counters(self, device, read):
        """``(device, read(counters))``: ``device`` checked (default: current),
        the recorded events folded in, and ``read`` called on the device's
        counters under the fold lock, so that what it reads is one moment's."""
        device = self._device_or_current(device)
        self._settle()
        return device, self.accounts.read(device, read)

    def stats(self, device: int | None = None) -> Stats:
        """This strategy's :class:`~cupy_memstrat.Stats` for ``device``
        (default: CuPy's current device).

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        device, fields = self._read_counters(device, lambda c: dict(
            bytes_in_use=c.in_use,
            peak_bytes_in_use=c.peak_in_use,
            bytes_reserved=c.reserved,
            peak_bytes_reserved=c.peak_reserved,
            n_allocs=c.n_allocs,
            n_frees=c.n_frees,
            n_live=c.n_allocs - c.n_frees,
            n_failed=c.n_failed,
            n_invalid_frees=self.accounts.n_invalid_frees,
            n_oom_recoveries=c.n_oom_recoveries,
        ))
        if self.reserved_is_in_use:
            # nothing cached, but a block freed while a recorded stream still used it is CUDA's
            # memory until that stream's work is done (record_stream): reserved, not in use
            held = self.deferred.waiting_bytes(device)
            reserved = fields["bytes_in_use"] + held
            peak = self.accounts.note_reserved_seen(device, reserved)  # the highest seen at reads (reset_peak)
            fields["bytes_reserved"] = reserved
            fields["peak_bytes_reserved"] = max(fields["peak_bytes_in_use"], peak)
        return Stats(device=device, strategy=self.name, largest_free_block=self.largest_free_block(device),
                     **fields)

    def largest_free_block(self, device: int) -> int | None:
        """Bytes of the largest free block this strategy holds on ``device``: the largest
        request it serves without asking CUDA for more memory (:attr:`Stats.largest_free_block
        <cupy_memstrat.Stats.largest_free_block>`). A strategy that caches nothing
        (:attr:`reserved_is_in_use`) holds none: 0. A caching strategy that can tell overrides
        this; the default for one that caches is ``None``, unknown."""
        return 0 if self.reserved_is_in_use else None

    def in_use(self, device: int | None = None) -> tuple[int, int]:
        """``(bytes in use, peak bytes in use)`` on ``device`` (default:
        current), the two numbers of :meth:`stats` a per-task hook needs,
        without reading anything from CUDA (the Dask plugin reads them at
        every task's start and end).

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        return self._read_counters(device, lambda c: (c.in_use, c.peak_in_use))[1]

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        """Set the peaks of ``device`` (default: current) to the present
        values: the peak in use, and with ``reserved`` (default) the peak
        reserved too (``reserved=False`` touches nothing in CUDA).

        Raises:
            TypeError: ``reserved`` is not True or False (nothing is reset).
            ValueError, TypeError: ``device`` is not a device ordinal.
        """
        if reserved is not True and reserved is not False:
            raise TypeError(f"reset_peak: reserved must be True or False, got {reserved!r}")
        device = self._device_or_current(device)
        self._settle()
        self.accounts.reset_peak(device, reserved)

    def live_allocations(self, device: int | None = None) -> list[Allocation]:
        """Live allocations, largest first, on ``device`` or on every device
        (default). ``origin`` is set when ``track_origins=True``."""
        if device is not None:
            device = self._device_or_current(device)
        self._settle()
        origins = self.accounts.origins
        rows = [
            Allocation(ptr=p, size=s, device=d, origin=origins.get(p))
            for d, live in enumerate(self.accounts.live)
            if device is None or d == device
            for p, s in list(live.items())
        ]
        rows.sort(key=lambda a: (-a.size, a.ptr))
        return rows

    #: how :meth:`memory_segments` maps this strategy's memory: ``"blocks"``,
    #: each live block is its own segment (what CUDA keeps behind a pool is
    #: not visible); ``"chunks"``, segments are the strategy's own chunks.
    segment_kind: ClassVar[str] = "blocks"

    def memory_segments(self, device: int | None = None) -> list[dict]:
        """The memory held on ``device`` (default: every device) as segments
        in the layout of PyTorch's memory snapshot (``torch.cuda.memory._snapshot()``;
        :func:`cupy_memstrat.snapshot` with ``format="torch"`` writes them).

        Each segment is a dict with ``device``, ``address``, ``total_size``
        (bytes), ``stream``, ``segment_type`` (``"small"`` up to 1 MiB, else
        ``"large"``), ``allocated_size``, ``active_size`` and ``blocks``,
        which tile the segment in address order: ``address``, ``size``,
        ``requested_size`` (bytes), ``state`` (``"active_allocated"`` or
        ``"inactive"``: free) and ``frames`` (``{"filename", "line",
        "name"}`` dicts, innermost first, when ``track_origins`` is on).
        Here each live block is its own segment (:attr:`segment_kind`
        ``"blocks"``): cached memory does not show. ``managed`` overrides it
        with its chunks.

        Raises:
            TypeError, ValueError: ``device`` is not a valid device ordinal.
        """
        devices = range(len(self.accounts.live)) if device is None else [self._device_or_current(device)]
        self._settle()
        origins = self.accounts.origins
        out = []
        for d in devices:
            for ptr, size in sorted(list(self.accounts.live[d].items())):
                blk = block(ptr, size, size, True, origins.get(ptr))
                out.append(segment(d, ptr, size, [blk]))
        return out

    def live_sizes(self, device: int | None = None) -> dict[int, int]:
        """A snapshot of the live allocations as ``{ptr: size in bytes}``, in
        allocation order, on ``device`` or on every device (default).

        Cheap (a dict copy per device: no sorting, no :class:`Allocation`
        rows, no origins): for code that compares the live set at two points,
        such as the pytest plugin's leak check. ``live_sizes().items() -
        before.items()`` are the allocations made in between that are still
        live (a block that reuses the address *and* size of one freed in
        between is indistinguishable from it)."""
        self._settle()
        return self.accounts.sizes(None if device is None else self._device_or_current(device))

    def _trim_devices(self, keep_bytes, device) -> list[tuple[int, int]]:
        """``[(device, bytes to keep)]`` for :meth:`trim`: every value checked
        before anything is released (``"N%"`` of each device's memory).

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        devices = range(self.backend.device_count()) if device is None else [self._device_or_current(device)]
        out = []
        for d in devices:
            total = None
            if isinstance(keep_bytes, str) and keep_bytes.strip().endswith("%"):
                total = self.backend.device_properties(d)["total_memory"]
            out.append((d, parse_size(keep_bytes, total=total, what="keep_bytes")))
        return out

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Give memory the strategy caches but does not use back to CUDA.

        A strategy that caches nothing (``reserved_is_in_use``, e.g.
        ``device``) has nothing to give back: this is a no-op that returns 0
        (the arguments are still checked). Caching strategies override it.

        Args:
            keep_bytes: bytes to keep cached (int, size string or ``"N%"``).
            device: a device ordinal, or ``None`` for every device.

        Returns:
            int: bytes given back to CUDA.

        Raises:
            TypeError, ValueError: a bad ``keep_bytes`` or ``device``.
        """
        if device is not None:
            self._device_or_current(device)
        parse_size(keep_bytes, total=100, what="keep_bytes")  # validated; nothing to keep
        self.deferred.flush()
        return 0

    # -- streams: stream keys, record_stream -----------------------------------------

    def stream_key(self, device: int | None = None) -> int:
        """CuPy's identifier of the current stream of ``device`` (default:
        the current device): the stream's handle, or, for the per-thread
        default stream (handle ``cudaStreamPerThread`` in every thread),
        minus the calling thread's ident, as CuPy's pool keys its arenas
        (``_get_stream_identifier`` in cupy/cuda/memory.pyx, cupy#5069).

        A strategy that caches freed blocks keys its cache by it: remember
        the key at ``allocate``, put the block back under that key at
        ``deallocate``, and hand it out again only to an allocation under
        the same key (docs/streams.md); the built-in ``managed`` does so.
        """
        d = self.backend.get_device() if device is None else self._device_or_current(device)
        h = self.backend.current_stream_ptr(d)
        return -threading.get_ident() if h == _backends.STREAM_PER_THREAD else h

    # -- record_stream: blocks other streams still use ----------------------------------
    def record_stream(self, ptr: int, stream) -> bool:
        """Mark the live block at ``ptr`` (the start of an allocation of this
        strategy) as used by ``stream`` too, as PyTorch's
        ``Tensor.record_stream``: when the block is freed, no stream, its own
        included, gets it again until the work queued on ``stream`` at the
        free is done (an event recorded there at the free).

        :func:`cupy_memstrat.record_stream` validates its arguments and calls
        this on the strategy that owns the array.

        Args:
            ptr: the allocation's pointer (``array.data.mem.ptr``).
            stream: a ``cupy.cuda.Stream`` (or ``ExternalStream``); it is
                kept alive until the block is freed.

        Returns:
            bool: True if recorded; False if this strategy's frees already
            wait for every stream (``device``: ``cudaFree`` synchronises the
            device), so there is nothing to record.

        Raises:
            ValueError: ``ptr`` is not a live allocation of this strategy.
        """
        check_stream(stream)
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise TypeError(f"ptr: expected an int pointer, got {type(ptr).__name__} {ptr!r}")
        d = self.accounts.device_of(ptr)
        if d is None:
            raise ValueError(f"{self.name}: {ptr:#x} is not the start of a live allocation of this strategy")
        sdev = getattr(stream, "device_id", -1)
        if isinstance(sdev, int) and not isinstance(sdev, bool) and sdev >= 0 and sdev != d:
            raise ValueError(f"stream: {stream!r} is on device {sdev}, but the block at {ptr:#x} is on device {d}")
        if self.backend.stream_destroyed(stream.ptr):
            raise ValueError(f"stream: {stream!r} (handle {stream.ptr:#x}) was destroyed")
        if self.free_waits_for_all_streams:
            return False
        self.deferred.record(ptr, stream, d)
        return True

    def _give_back_pending(self, entry: list) -> None:
        """A pending entry of :meth:`_defer` whose recorded streams are done
        (or were synchronised): its block goes back (:meth:`_give_back_block`).
        Must not raise."""
        self._give_back_block(entry[1], entry[2], entry[3])

    def _give_back_block(self, ptr: int, size: int, device: int) -> None:
        """What a free does after the accounting: give the block to the
        strategy's cache or back to CUDA (here: ``deallocate``). Caching
        strategies override it. Must not raise."""
        try:
            self._hooks()[1](ptr)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            self.backend.clear_last_error()
            warn_at_user(f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
                         RuntimeWarning)

    # -- frees that fail or name no live block; out of memory (off the hot path) --
    def _recover_hook(self, size: int, device: int, exc: BaseException) -> int:
        """The hot path's ``allocate(size)`` raised ``exc``: recover and
        retry (:meth:`_recover`), returning the pointer, or raise."""
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        allocate = self._hooks()[0]
        return self.recovery.recover(size, device, exc, lambda: allocate(size))

    def _deallocation_failed(self, ptr: int, size: int, device: int, exc: BaseException, stacklevel: int) -> None:
        """The C hot path's free: ``_deallocate`` raised. A finaliser must not
        raise, so this warns (as the Python free does, same stack level)."""
        warn_at_user(
            f"{self.name}: freeing 0x{ptr:x} ({size} bytes) on device {device} failed: {exc}",
            RuntimeWarning)

    def _unknown_free(self, ptr, stacklevel: int = 1) -> tuple[int, int | None]:
        """A free whose device hint was wrong: (device, size) of the live
        block, popped; else counts and warns an invalid free, (-1, None)."""
        __tracebackhide__ = True  # pytest shows the user's frames under -W error
        device, size = self.accounts.pop_live(ptr)
        if size is None and not (ptr == 0 and type(ptr) is int):
            self._invalid_free(ptr, 4 + stacklevel)
        return device, size

    def _invalid_free(self, ptr, stacklevel: int) -> None:
        __tracebackhide__ = True  # pytest shows the user's frames under -W error
        self.accounts.count_invalid_free()
        shown = f"0x{ptr:x}" if type(ptr) is int and ptr >= 0 else repr(ptr)
        warn_at_user(
            f"{self.name}: free of pointer {shown} that this strategy does not own "
            "(unknown, already freed, or not a pointer); ignored",
            InvalidFreeWarning)

    # -- lifetime: reachable while it has handed out memory, close, using()'s let-go --

    def _pin(self) -> None:
        # A strategy that has handed out memory stays reachable from this
        # module until close(): CuPy frees through it from finalisers, and the
        # garbage collector must never clear it while arrays that are garbage
        # in the same cycle still have to be freed (a test's traceback cycle
        # can hold both).
        REACHABLE.add(self)
        self._pinned = True

    # -- using(): let go once empty ----------------------------------------------------
    def close_when_empty(self) -> None:
        """:meth:`close` this strategy (giving its cache back) once its last live
        allocation is freed, or now if there is none: what :func:`cupy_memstrat.using`
        does at the end of its block for a strategy it made, when arrays outlive the block.
        :meth:`installed` cancels it."""
        self._watch[0] = self._check_empty
        self._check_empty()

    def installed(self) -> None:
        """Called by :func:`cupy_memstrat.use` and :func:`cupy_memstrat.using` each time they
        install this object: it stays open (a pending :meth:`close_when_empty` is cancelled)
        and is reachable again if it was closed (by :func:`cupy_memstrat.record_stream` and
        by other strategies' out-of-memory recovery)."""
        self._watch[0] = None
        if not self._pinned:
            self._pin()

    @staticmethod
    def owner_of_pointer(ptr: int, device: int):
        """The reachable strategy whose live table holds ``ptr`` (a pointer) on ``device`` (an
        ordinal), a checking layer before the strategy it wraps; None if no strategy does.

        Raises:
            TypeError: ``ptr`` or ``device`` is not an int.
        """
        for what, v in (("ptr", ptr), ("device", device)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"owner_of_pointer: {what}: expected an int, got {type(v).__name__} {v!r}")
        return REACHABLE.owner_of_pointer(ptr, device)

    def _check_empty(self) -> None:
        if self.accounts.any_live():
            return
        self._watch[0] = None
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - called from a finaliser
            self.backend.clear_last_error()
            warn_at_user(f"{self.name}: closing after its last array was freed failed: {exc}", RuntimeWarning)

    # -- close -----------------------------------------------------------------
    def close(self) -> None:
        """Let the strategy be garbage-collected once unreachable, and release
        what it holds beyond live allocations (nothing for ``device``).

        A strategy that has allocated stays referenced by cupy_memstrat until
        closed, because CuPy's finalisers free through it. Close it only once
        its arrays are gone and it is no longer CuPy's allocator (allocations
        through an allocator that is still installed do not pin it again;
        :meth:`raw_malloc` does). Closing twice is harmless. Blocks freed
        with :func:`cupy_memstrat.record_stream`'d streams still pending are
        given back first (after a synchronisation).
        """
        self._watch[0] = None
        self.deferred.flush()
        REACHABLE.discard(self)
        self._pinned = False


    # -- CuPy -------------------------------------------------------------------
    def malloc(self, size) -> "cupy.cuda.MemoryPointer":  # noqa: F821
        """CuPy's allocator interface, with size checks: ``size`` bytes ->
        ``cupy.cuda.MemoryPointer`` on CuPy's current device. Usable with
        ``cupy.cuda.set_allocator``; :func:`cupy_memstrat.use` installs the
        faster :meth:`cupy_allocator`, which skips these checks.

        Raises:
            TypeError, ValueError: ``size`` is not an int >= 0 (CuPy's own
                pool raises ``OverflowError`` for a negative size).
            cupy.cuda.memory.OutOfMemoryError: as :meth:`raw_malloc`.
        """
        __tracebackhide__ = True  # pytest shows the user's frames, not ours
        if size.__class__ is not int or size < 0 or size >= SIZE_T_LIMIT:
            size = check_size(size)
        cupy_malloc = self._cupy_malloc
        if cupy_malloc is None:
            cupy_malloc = self._make_cupy_malloc()
        return cupy_malloc(size)

    def cupy_allocator(self):
        """The callable :func:`cupy_memstrat.use` passes to ``cupy.cuda.set_allocator``.

        With CUDA it is the ``malloc`` of a ``cupy.cuda.PythonFunctionAllocator``
        over this strategy's hot path, with no Python wrapper in between (one
        Python frame less per allocation). Bad sizes then fail as they do with
        CuPy's own pool: ``cupy.cuda.alloc(-1)`` raises ``OverflowError``; call
        :meth:`malloc` for the ``ValueError`` / ``TypeError`` checks. With the
        fake backend it is :meth:`malloc`.
        """
        if not isinstance(self.backend, _backends.RealBackend):
            return self.malloc
        if self._cupy_malloc is None:
            self._make_cupy_malloc()
        return self._cupy_malloc

    @staticmethod
    def owner_of_allocator(allocator):
        """The strategy behind ``allocator``, a callable from :meth:`cupy_allocator` or
        :meth:`malloc` (or the history recorder's), as CuPy holds it; None for any other
        callable (CuPy's own pool, another library's)."""
        owner = getattr(allocator, "__self__", None)
        if isinstance(owner, Strategy):
            return owner
        recorded = getattr(allocator, "_memstrat_strategy", None)  # cupy_memstrat.history's recorder
        if isinstance(recorded, Strategy):
            return recorded
        ref = _pfa_owners.get(id(owner))
        s = ref() if ref is not None else None
        return s if s is not None and s._pfa is owner else None

    def _cupy_route(self, malloc, free):
        """CuPy's ``malloc(size) -> MemoryPointer`` over the hot path's
        ``malloc`` / ``free``, and the object that callable names as its
        ``__self__`` (None if it names none; :meth:`owner_of_allocator` finds the
        strategy through it). A strategy with a route of its own into CuPy
        overrides this (``pool``'s ``route="direct"``)."""
        cupy_malloc, pfa, self._gc_safe = cupy_malloc_over(self.backend, malloc, free, self.block_granule)
        return cupy_malloc, pfa

    def _make_cupy_malloc(self):
        malloc, free = self._hot_path()
        cupy_malloc, pfa = self._cupy_route(malloc, free)
        if pfa is not None:
            self._pfa = pfa
            _pfa_owners[id(pfa)] = weakref.ref(self)
        self._pin()
        self._cupy_malloc = cupy_malloc
        return cupy_malloc

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"<{type(self).__name__} {self.name!r} ({opts}) on {self.backend.name}>"

    def __reduce_ex__(self, protocol):
        """Strategies are not pickled or copied: one holds CUDA memory and this process's state.

        Raises:
            TypeError: always, saying what to send instead.
        """
        raise TypeError(
            f"a cupy_memstrat strategy ({type(self).__name__} {self.name!r}) cannot be pickled or copied: it "
            "holds CUDA memory and state of this process; send its spec string and create it where it runs "
            "(cupy_memstrat.use(spec)), or send what it reports (stats().as_dict(), cupy_memstrat.snapshot())"
        )
