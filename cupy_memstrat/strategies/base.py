"""The :class:`Strategy` base class: CuPy glue, accounting, errors.

A strategy subclass provides two hooks, the strategy contract
(docs/strategies.md, "Writing a strategy"):

* ``allocate(size) -> ptr``: obtain ``size`` bytes (> 0) on the current
  device (CuPy's, which is also the ``device`` that :meth:`Strategy.raw_malloc`
  records) or raise ``backend.Error``;
* ``deallocate(ptr)``: give them back;

and, if it caches, calls ``record_reserved(device, delta)`` when it takes
memory from CUDA or gives it back.

Everything else is shared, here and in the classes :class:`Strategy` is
composed of (the private modules of this package: ``_statistics``,
``_streams``, ``_recovery``, ``_cupy_glue``, ``_lifetime``; their state is set
in ``Strategy.__init__``): size validation, the live-allocation table, the
:class:`~cupy_memstrat.Stats` counters (exact under threads), origin
tracking, out-of-memory errors, invalid frees, and the CuPy allocator
callable.

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
Python closures. Both do the same operations in the same order; the C one
saves the Python frames of each alloc+free pair (docs/benchmarks.md has the
cost). The C one is used where it was built, except with
``track_origins=True`` (which walks the Python stack anyway); the environment
variable ``CUPY_MEMSTRAT_HOT_PATH`` = ``auto`` (default) / ``c`` / ``python``
chooses, read when a strategy builds its hot path (its first allocation).
"""

from __future__ import annotations

import difflib
import importlib.util
import operator
import os
import threading
from typing import ClassVar

from .. import backends as _backends
from ..options import Option, as_frames, as_output_file
from .._userwarn import warn_at_user
from ._contract import _ContractMixin
from ._cupy_glue import _CupyMixin
from ._lifetime import _LifetimeMixin
from ._recovery import _RecoveryMixin
from ._statistics import _StatisticsMixin
from .accounts import Accounts
from .deferred import DeferredFrees
from ._streams import _StreamsMixin, check_stream
from ._support import FOLD_AT, c_accounting, check_size, hot_path_status
from ..stats import origin_capture

# importable from here too (tests read base._pinned and base._pfa_owners, cupy_memstrat.history
# calls base.cupy_malloc_over)
from ._cupy_glue import _FakeOwner, _cupy_memory, _cupy_pool_hint, _free_cupy_pool_blocks  # noqa: F401
from ._cupy_glue import _pfa_owners, cupy_malloc_over  # noqa: F401
from ._lifetime import _pinned, _pinned_lock  # noqa: F401
from ._support import SIZE_T_LIMIT  # noqa: F401

__all__ = ["Strategy", "check_size", "check_stream", "hot_path_status"]

#: the default of every strategy's ``oom_snapshot`` option
OOM_SNAPSHOT_ENV = "CUPY_MEMSTRAT_OOM_SNAPSHOT"


class Strategy(_ContractMixin, _StreamsMixin, _RecoveryMixin, _StatisticsMixin, _CupyMixin, _LifetimeMixin):
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
        self.deferred = DeferredFrees(backend, lambda: self.name, self._give_back_pending, self._settle)
        # _watch[0]: called when the last live allocation is freed (using() lets go)
        self._watch: list = [None]
        # the recording (cupy_memstrat.record_history) that wants segment and out-of-memory
        # events, off the hot path; None when nothing records
        self._history = None
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
        :meth:`Accounts.fold <cupy_memstrat.strategies.accounts.Accounts.fold>`."""
        acc = Accounting(self.accounts.live, unknown_free, failed, self._Error, **tables)
        self.accounts.add_drain(acc.drain)
        return acc

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




def _bind_public(cls) -> None:
    """Bind the public methods and attributes of ``cls``'s mixins in ``cls`` too (the same
    objects; a subclass's override still comes first), so that the API reference (docs/api.md,
    Sphinx's autodoc, which lists no inherited member) documents them as ``Strategy``'s own."""
    for mixin in cls.__mro__[1:-1]:
        for name, value in list(vars(mixin).items()):
            if not name.startswith("_"):
                setattr(cls, name, value)


_bind_public(Strategy)
