"""Dask: every worker under a strategy, with per-worker and per-task GPU memory.

Built on ``distributed`` itself: :class:`MemstratPlugin` is a
``distributed.WorkerPlugin`` (a fixed name: registering it again replaces it on
every worker, and workers that join later get it too), and this module is
also a ``--preload`` module for the worker command line::

    client.register_plugin(MemstratPlugin("managed:prefetch=on_new"))
    dask worker SCHEDULER --preload cupy_memstrat.dask --memstrat-strategy=async

On each worker the plugin installs the strategy with :func:`cupy_memstrat.use`
before the worker's tasks allocate (``setup``), records per task the peak
bytes in use and the bytes left at its end through the worker's transition
hook, and gives memory back and puts CuPy's allocator back at ``teardown``.
:func:`stats`, :func:`task_peaks` and :func:`snapshot` gather from the client.

Per-task peaks are exact when a worker runs one task at a time (one thread
per worker, as dask-cuda runs one per GPU); where tasks overlap on a worker,
each overlapping task's record says so (``overlapped``) and its peak is the
worker's peak while it ran.
"""

from __future__ import annotations

import collections
import difflib
import logging
import operator
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace

import cupy_memstrat
from cupy_memstrat import history as memory_history

try:
    from distributed import WorkerPlugin
except ImportError as exc:  # pragma: no cover - the "dask" extra is not installed
    raise ImportError(
        "cupy_memstrat.dask needs distributed: pip install 'cupy-memstrat[dask]'"
    ) from exc

__all__ = ["MemstratPlugin", "TaskMemory", "stats", "task_peaks", "snapshot", "PLUGIN_NAME", "dask_setup"]

#: the plugin's name on every worker: registering another MemstratPlugin replaces it
PLUGIN_NAME = "cupy-memstrat"
_OWN_OPTIONS = ("track_tasks", "max_keys", "record_history")
_MOST_KEYS = 10**7
_active: dict[str, object] = {}  # worker address -> its plugin, in this process
# worker task states after which a task's thread no longer runs it (Worker State), but "released" from
# executing: a cancel, reported as executing -> released while the thread goes on, until "cancelled -> ..."
_THREAD_DONE = frozenset({"memory", "error", "released", "forgotten", "rescheduled", "waiting", "ready",
                          "constrained", "fetch", "flight", "missing"})


@dataclass(frozen=True)
class TaskMemory:
    """GPU memory of one task on one worker (bytes, on the worker's current
    device): ``peak_bytes`` over what was in use when it started,
    ``left_bytes`` still in use at its end that was not at its start (its
    result, or what it leaked), ``in_use_before`` at its start. ``overlapped``:
    another task ran on the worker at the same time (the peak is then the
    worker's, not the task's alone). ``state``: ``"memory"`` or ``"error"``.
    ``seconds``: from the start of its execution to its end."""

    key: str
    prefix: str
    worker: str
    device: int
    peak_bytes: int
    left_bytes: int
    in_use_before: int
    overlapped: bool
    state: str
    seconds: float


def _key_text(key) -> str:
    return key if isinstance(key, str) else str(key)


class MemstratPlugin(WorkerPlugin):
    """Install a cupy_memstrat strategy on every worker and measure its tasks.

    Args:
        spec: a strategy spec (``"async"``, ``"managed:prefetch=on_new"``);
            default ``"pool"``, CuPy's pool with this library's statistics.
        track_tasks: record each task's peak and what it left (default True).
        max_keys: task records kept per worker, the newest (default 10 000);
            per key prefix the totals are kept for every prefix.
        record_history: record each worker's allocation and free events
            (:func:`cupy_memstrat.record_history`, with origins) from setup
            on, so that :func:`snapshot` holds a timeline per worker
            (``python -m cupy_memstrat plot`` draws several side by side):
            False (default), True (the newest 100 000 events), or the number
            of events to keep (an int >= 1).
        **options: strategy options, as for :func:`cupy_memstrat.use`.

    Raises:
        ValueError, TypeError: a bad spec or option, at the client, before
            anything is sent to a worker (:func:`cupy_memstrat.validate`).
    """

    name = PLUGIN_NAME
    idempotent = False  # registered again: the new one replaces the old on every worker

    def __init__(self, spec: str = "pool", *, track_tasks: bool = True, max_keys: int = 10_000,
                 record_history: bool | int = False, **options):
        _check_spec(spec, options)  # refused here, at the client
        if type(track_tasks).__name__ in ("bool_", "bool") and type(track_tasks).__module__ == "numpy":
            track_tasks = bool(track_tasks)
        if not isinstance(track_tasks, bool):
            raise TypeError(f"track_tasks: expected True or False, got {type(track_tasks).__name__} {track_tasks!r}")
        if isinstance(max_keys, bool) or not hasattr(max_keys, "__index__"):
            raise TypeError(f"max_keys: expected an int from 1 to {_MOST_KEYS}, got {type(max_keys).__name__} "
                            f"{max_keys!r}")
        if not 1 <= operator.index(max_keys) <= _MOST_KEYS:
            raise ValueError(f"max_keys: expected an int from 1 to {_MOST_KEYS}, got {max_keys!r}")
        max_keys = operator.index(max_keys)
        if type(record_history).__module__ == "numpy" and hasattr(record_history, "item"):
            record_history = record_history.item()
        if isinstance(record_history, bool):
            record_history = 100_000 if record_history else 0
        elif not isinstance(record_history, int) or record_history < 1:
            raise ValueError(f"record_history: expected True, False or an int >= 1 (events to keep), got "
                             f"{record_history!r}")
        self.record_history = record_history
        self.spec, self.options = spec, dict(options)
        self.track_tasks, self.max_keys = track_tasks, max_keys
        self._reset_runtime()

    def _reset_runtime(self):
        self.strategy = None
        self._collector = None  # the Prometheus collector registered in this worker's process
        self._history = None  # the recording started at setup (record_history)
        self.setup_error: str | None = None  # why this worker could not install the strategy
        self._peaks: dict[int, int] = {}  # device -> the worker's peak in use before the last task's reset
        self.worker_address = None
        self._previous = None
        self._said_displaced = False
        self._lock = threading.Lock()
        self._running: dict[str, tuple[float, int, int]] = {}  # key -> (start, device, in use at start)
        self._overlapped: set[str] = set()
        self._cancelled: set[str] = set()  # cancelled while executing, their threads still running
        self._tasks: collections.OrderedDict = collections.OrderedDict()
        self._prefixes: dict[str, dict] = {}

    def __getstate__(self):  # sent to workers without the runtime state
        return {"spec": self.spec, "options": self.options, "track_tasks": self.track_tasks,
                "max_keys": self.max_keys, "record_history": self.record_history}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    # -- the worker's side ------------------------------------------------------------------
    def setup(self, worker) -> None:
        import cupy

        self.worker_address = worker.address
        from distributed import Worker

        others = {a for a, p in _active.items() if a != worker.address and p is not self}
        others |= {w.address for w in list(Worker._instances) if w is not worker and w.address
                   and getattr(w.status, "name", "") not in ("closed", "closing", "failed")}
        if others:  # LocalCluster(processes=False): one CuPy allocator for several workers
            self.setup_error = (f"workers {', '.join(sorted(others | {worker.address}))} share one process, and CuPy "
                                "has one allocator per process: each would count the others' memory; run them in "
                                "processes of their own (LocalCluster(processes=True), the default)")
            raise RuntimeError(f"cupy_memstrat.dask: {self.setup_error}")
        self._previous = cupy.cuda.get_allocator()
        mod = getattr(self._previous, "__module__", "") or ""
        if mod.startswith("rmm"):  # dask-cuda's RMMSetup (rmm_allocator_external_lib_list) set it
            msg = (f"cupy_memstrat.dask: on worker {worker.address} CuPy allocates through RMM ({self._previous!r}, "
                   f"set by dask-cuda's RMM plugin); {self.spec!r} replaces it for CuPy here (RMM stays for "
                   "other libraries)")
            logging.getLogger("distributed.worker.cupy_memstrat").warning(msg)  # in client.get_worker_logs()
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        try:
            self.strategy = cupy_memstrat.use(self.spec, **self.options)
        except Exception as exc:
            self.setup_error = f"{type(exc).__name__}: {exc}"
            raise
        self.strategy.oom_context = self._oom_context
        if self.record_history:
            self._history = cupy_memstrat.record_history(max_entries=self.record_history, strategy=self.strategy)
        worker.metrics["cupy_memstrat"] = self._metric
        _active[worker.address] = self
        self._collector = _prometheus_register(self)

    def teardown(self, worker) -> None:
        import cupy

        if _active.get(worker.address) is self:
            del _active[worker.address]
        s = self.strategy
        if s is None:
            return
        s.oom_context = None
        if self._history is not None and memory_history.recording() is self._history:
            cupy_memstrat.record_history(False)  # ends ours (CuPy's allocator back to the strategy)
        self._history = None
        worker.metrics.pop("cupy_memstrat", None)
        _prometheus_unregister(self._collector)
        self._collector = None
        if cupy_memstrat.current() is s:
            cupy.cuda.set_allocator(self._previous)
        s.trim()

    def _oom_context(self) -> str:
        try:
            from distributed.worker import thread_state

            key = getattr(thread_state, "key", None)
        except ImportError:  # pragma: no cover
            key = None
        task = f", task {_key_text(key)!r}" if key is not None else ""
        return f" (Dask worker {self.worker_address}{task})"

    def worker_stats(self, device: int | None = None):
        """The strategy's Stats with the worker's own peaks (each task's start
        resets the strategy's peak; the worker's highest is kept here)."""
        st = self.strategy.stats(device)
        peak = max(self._peaks.get(st.device, 0), st.peak_bytes_in_use)
        # what is in use is also reserved: the peak reserved is at least the peak in use (for
        # device, whose reserved bytes are its bytes in use, the per-task reset lowered it)
        return replace(st, peak_bytes_in_use=peak, peak_bytes_reserved=max(peak, st.peak_bytes_reserved))

    def _metric(self, worker) -> dict:
        """Each heartbeat: the worker's GPU bytes (``ws.metrics["cupy_memstrat"]`` on the scheduler)."""
        s = self.strategy
        st = self.worker_stats()
        return {"strategy": s.name, "device": st.device, "bytes_in_use": st.bytes_in_use,
                "bytes_reserved": st.bytes_reserved, "peak_bytes_in_use": st.peak_bytes_in_use,
                "peak_bytes_reserved": st.peak_bytes_reserved}

    def transition(self, key, start, finish, **kwargs) -> None:
        if not self.track_tasks or self.strategy is None:
            return
        if finish == "executing":
            s = self.strategy
            with self._lock:
                d = s.backend.get_device()
                now, peak = s.in_use(d)  # nothing read from CUDA, no Stats made: this runs per task
                if self._running:
                    self._overlapped.update(self._running)
                    self._overlapped.add(_key_text(key))
                else:  # alone: the peak from here is this task's; the worker's is kept first
                    self._peaks[d] = max(self._peaks.get(d, 0), peak)
                    s.reset_peak(d, reserved=False)  # the reserved peak stays the strategy's own
                self._running[_key_text(key)] = (time.perf_counter(), d, now)
        elif finish in _THREAD_DONE or start == "cancelled":
            k = _key_text(key)
            with self._lock:
                if k in self._cancelled:  # its thread went on after the cancel: running until it reports
                    if start == "cancelled":
                        self._cancelled.discard(k)
                        self._running.pop(k, None)
                        self._overlapped.discard(k)
                    return
                if start in ("executing", "long-running") and finish == "released" and k in self._running:
                    self._cancelled.add(k)  # cancelled while executing (Dask reports executing -> released)
                    return
                began = self._running.pop(k, None)
                if began is None or finish not in ("memory", "error"):  # cancelled, rescheduled: no record
                    self._overlapped.discard(k)
                    return
                t0, d, before = began
                now, peak = self.strategy.in_use(d)
                rec = TaskMemory(
                    key=k, prefix=_prefix(key), worker=self.worker_address, device=d,
                    peak_bytes=max(0, peak - before), left_bytes=max(0, now - before),
                    in_use_before=before, overlapped=k in self._overlapped, state=finish,
                    seconds=time.perf_counter() - t0,
                )
                self._overlapped.discard(k)
                self._tasks[k] = rec
                self._tasks.move_to_end(k)
                while len(self._tasks) > self.max_keys:
                    self._tasks.popitem(last=False)
                p = self._prefixes.setdefault(rec.prefix, {"prefix": rec.prefix, "tasks": 0, "peak_bytes": 0,
                                                           "left_bytes": 0, "errors": 0})
                p["tasks"] += 1
                p["peak_bytes"] = max(p["peak_bytes"], rec.peak_bytes)
                p["left_bytes"] += rec.left_bytes
                p["errors"] += finish == "error"

    def displaced_by(self) -> str | None:
        """``repr`` of CuPy's allocator on this worker when it is no longer this
        plugin's strategy (another worker plugin, dask-cuda's ``RMMSetup`` for
        one, or a task set it after ``setup``), else None: from then on the
        strategy counts nothing CuPy allocates here."""
        if self.strategy is None:
            return None
        if cupy_memstrat.current() is self.strategy:  # (also through our recording's allocator)
            return None
        import cupy

        return repr(cupy.cuda.get_allocator())

    def records(self) -> dict:
        """This worker's records (picklable): ``stats``, ``tasks`` and ``prefixes``."""
        displaced = self.displaced_by()
        if displaced is not None and not self._said_displaced:
            self._said_displaced = True
            logging.getLogger("distributed.worker.cupy_memstrat").warning(
                "cupy_memstrat.dask: on worker %s CuPy's allocator is now %s, set after MemstratPlugin(%r): "
                "the strategy counts nothing CuPy allocates here since", self.worker_address, displaced, self.spec)
        with self._lock:
            return {"stats": self.worker_stats() if self.strategy is not None else None,
                    "strategy": self.strategy.name if self.strategy is not None else None,
                    "error": self.setup_error, "displaced_by": displaced,
                    "tasks": [asdict(r) for r in self._tasks.values()],
                    "prefixes": [dict(p) for p in self._prefixes.values()]}


class _Collector:
    """The worker's GPU memory for its Prometheus endpoint (``/metrics`` on the
    worker's dashboard port, which ``distributed`` serves from
    ``prometheus_client.REGISTRY`` when ``prometheus-client`` is installed):
    gauges named as ``distributed`` names its own worker metrics, with the
    namespace of ``distributed.dashboard.prometheus.namespace`` (default
    ``dask``):

    * ``dask_worker_cupy_memstrat_bytes{kind, strategy, device}``: ``kind`` is
      ``in_use``, ``reserved``, ``peak_in_use`` or ``peak_reserved`` (bytes;
      the peaks are the worker's, across its tasks);
    * ``dask_worker_cupy_memstrat_failed_allocations_total{strategy, device}``
      and ``..._oom_recoveries_total``: counts since the strategy was installed.
    """

    def __init__(self, plugin):
        import weakref

        import dask.config

        self._plugin = weakref.ref(plugin)
        ns = dask.config.get("distributed.dashboard.prometheus.namespace", "dask")
        self._prefix = "_".join(x for x in (ns, "worker", "cupy_memstrat") if x)

    def describe(self):  # no samples at registration (prometheus_client calls collect() otherwise)
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        plugin = self._plugin()
        if plugin is None or plugin.strategy is None:
            return
        try:
            st = plugin.worker_stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail the worker's endpoint
            return
        labels = [plugin.strategy.name, str(st.device)]
        g = GaugeMetricFamily(f"{self._prefix}_bytes", "GPU memory of the worker's cupy_memstrat strategy (bytes)",
                              labels=["kind", "strategy", "device"])
        for kind, v in (("in_use", st.bytes_in_use), ("reserved", st.bytes_reserved),
                        ("peak_in_use", st.peak_bytes_in_use), ("peak_reserved", st.peak_bytes_reserved)):
            g.add_metric([kind, *labels], v)
        yield g
        for name, doc, v in (("failed_allocations", "allocations the strategy could not make", st.n_failed),
                             ("oom_recoveries", "allocations made after giving memory back", st.n_oom_recoveries)):
            c = CounterMetricFamily(f"{self._prefix}_{name}", doc, labels=["strategy", "device"])
            c.add_metric(labels, v)
            yield c


def _prometheus_register(plugin):
    """Register the plugin's collector in this process's ``prometheus_client``
    registry (nothing when ``prometheus-client`` is not installed)."""
    try:
        import prometheus_client
    except ImportError:
        return None
    collector = _Collector(plugin)
    try:
        prometheus_client.REGISTRY.register(collector)
    except Exception as exc:  # noqa: BLE001 - metrics must not stop the worker's strategy
        logging.getLogger("distributed.worker.cupy_memstrat").warning(
            "cupy_memstrat.dask: the Prometheus collector was not registered: %r", exc)
        return None
    return collector


def _prometheus_unregister(collector) -> None:
    if collector is None:
        return
    import prometheus_client

    try:
        prometheus_client.REGISTRY.unregister(collector)
    except KeyError:  # already gone
        pass


def _prefix(key) -> str:
    from dask.utils import key_split

    return key_split(key)


# -- the client's side ---------------------------------------------------------------------


def _records_on_worker(dask_worker=None):
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    if plugin is None:
        return None
    return plugin.records()


def _snapshot_on_worker(dask_worker=None):
    """The worker's recording, or the plugin's strategy's memory now (also when another plugin
    has since replaced CuPy's allocator: then no strategy is current)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    return cupy_memstrat.snapshot(strategy=getattr(plugin, "strategy", None))


def _check_spec(spec, options: dict) -> None:
    """The spec and options as :func:`cupy_memstrat.validate` checks them,
    at the client, but ``oom_snapshot``: a path on the workers' machines,
    checked there."""
    from .options import parse_spec

    opts = {k: v for k, v in options.items() if k != "oom_snapshot"}
    name, given = parse_spec(spec)  # (TypeError for a non-str spec)
    given.pop("oom_snapshot", None)
    for where in (options.get("oom_snapshot"), (parse_spec(spec)[1]).get("oom_snapshot")):
        if where is not None and (not isinstance(where, (str, os.PathLike)) or not os.fspath(where).strip()):
            raise ValueError(f"oom_snapshot: expected a file path (on the workers), got {where!r}")
    _, config = cupy_memstrat.validate(name)
    for k in given:
        if k in _OWN_OPTIONS:
            raise ValueError(f"MemstratPlugin: {k} is the plugin's own option, not the strategy's: pass it as "
                             f"MemstratPlugin({name!r}, {k}=...), not in the spec")
    for k in opts:
        if k not in config:
            near = difflib.get_close_matches(k, list(config) + list(_OWN_OPTIONS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"MemstratPlugin: unknown option {k!r}{hint}; its own: {', '.join(_OWN_OPTIONS)}; "
                             f"the options of strategy {name!r}: {', '.join(sorted(config))}")
    cupy_memstrat.validate(name, **given, **opts)


def _gather(client) -> dict:
    got = client.run(_records_on_worker, on_error="return")
    gone = sorted(a for a, r in got.items() if isinstance(r, BaseException))
    if gone:
        raise RuntimeError(
            f"cupy_memstrat.dask: cannot reach worker{'s' if len(gone) > 1 else ''} {', '.join(gone)} "
            f"({type(got[gone[0]]).__name__}: one may have just died or be restarting); try again"
        )
    missing = sorted(a for a, r in got.items() if r is None)
    if missing:
        raise RuntimeError(
            f"cupy_memstrat.dask: the MemstratPlugin is not registered on worker{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}: call client.register_plugin(MemstratPlugin(SPEC)) first (a --preload that "
            "failed says why in the worker's log)"
        )
    failed = sorted(a for a, r in got.items() if r["strategy"] is None)
    if failed:
        why = "; ".join(f"{a}: {got[a]['error']}" for a in failed)
        raise RuntimeError(
            f"cupy_memstrat.dask: worker{'s' if len(failed) > 1 else ''} {', '.join(failed)} could not install the "
            f"strategy ({why}); register a MemstratPlugin they can run"
        )
    displaced = sorted(a for a, r in got.items() if r.get("displaced_by"))
    if displaced:
        warnings.warn(
            f"cupy_memstrat.dask: on worker{'s' if len(displaced) > 1 else ''} {', '.join(displaced)} CuPy's "
            f"allocator was replaced after the MemstratPlugin (now {got[displaced[0]]['displaced_by']}; dask-cuda's "
            "RMMSetup registered after it does this): the statistics there count only what CuPy allocated before; "
            "register the MemstratPlugin last", RuntimeWarning, stacklevel=3)
    return got


def stats(client) -> dict:
    """``{worker address: Stats}``: each worker's statistics for its current
    device (under dask-cuda's ``LocalCUDACluster``, its own GPU).

    Raises:
        RuntimeError: a worker has no :class:`MemstratPlugin`.
    """
    return {a: r["stats"] for a, r in _gather(client).items()}


def task_peaks(client, n: int = 20, *, by: str = "key") -> list[dict]:
    """The ``n`` tasks (``by="key"``) or key prefixes (``by="prefix"``) with
    the highest peak, over every worker, highest first: :class:`TaskMemory`
    fields as dicts (prefixes: ``prefix``, ``tasks``, ``peak_bytes``,
    ``left_bytes``, ``errors``, per worker).

    Raises:
        ValueError: a bad ``n`` or ``by``.
        RuntimeError: a worker has no :class:`MemstratPlugin`.
    """
    if isinstance(n, bool) or not hasattr(n, "__index__") or operator.index(n) < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    n = operator.index(n)
    if by not in ("key", "prefix"):
        raise ValueError(f"by: expected 'key' or 'prefix', got {by!r}")
    rows = []
    for addr, r in _gather(client).items():
        if by == "key":
            rows.extend(r["tasks"])
        else:
            rows.extend(dict(p, worker=addr) for p in r["prefixes"])
    rows.sort(key=lambda t: -t["peak_bytes"])
    return rows[:n]


def snapshot(client, folder) -> list[str]:
    """Each worker's :func:`cupy_memstrat.snapshot` (its recording, or its
    memory now), written into ``folder`` (made if missing) as
    ``worker-HOST-PORT.json``; ``python -m cupy_memstrat plot`` and
    ``export`` read each. Returns the paths written.

    Raises:
        RuntimeError: a worker has no :class:`MemstratPlugin`.
        OSError: ``folder`` cannot be made or written.
    """
    import json

    from .paths import write_file_atomically

    if not isinstance(folder, (str, os.PathLike)) or isinstance(os.fspath(folder), bytes) or not os.fspath(folder):
        raise ValueError(f"folder: expected a folder path (str or os.PathLike), got {folder!r}")
    _gather(client)
    docs = client.run(_snapshot_on_worker, on_error="return")
    gone = sorted(a for a, d in docs.items() if isinstance(d, BaseException))
    if gone:
        raise RuntimeError(f"cupy_memstrat.dask: worker {gone[0]} failed its snapshot "
                           f"({type(docs[gone[0]]).__name__}: {docs[gone[0]]}); nothing was written")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for addr, doc in sorted(docs.items()):
        name = "worker-" + addr.split("://")[-1].replace(":", "-").replace("/", "-") + ".json"
        path = os.path.join(folder, name)
        write_file_atomically(path, json.dumps(doc).encode())
        paths.append(path)
    return paths


# -- the worker command line: dask worker --preload cupy_memstrat.dask --memstrat-strategy=SPEC ----------

try:
    import click
except ImportError:  # pragma: no cover - distributed brings click
    click = None

if click is not None:

    # distributed gives every preload of a worker the same arguments when they are one flat list, as
    # `dask cuda worker` makes them (its own preload dask_cuda.initialize gets --create-cuda-context):
    # the options of the others are taken here and left alone
    @click.command(context_settings={"ignore_unknown_options": True})
    @click.option("--memstrat-strategy", default=None,
                  help="the cupy_memstrat strategy spec for this worker (default: $CUPY_MEMSTRAT, else pool)")
    @click.argument("other_preloads_argv", nargs=-1, type=click.UNPROCESSED)
    async def dask_setup(worker, memstrat_strategy, other_preloads_argv=()):
        """Register :class:`MemstratPlugin` on this worker at start-up.

        Arguments meant for the worker's other preloads are left to them.
        Under ``dask cuda worker`` every preload gets the same arguments,
        and dask-cuda's own preload (``dask_cuda.initialize``) refuses
        ``--memstrat-strategy``, so that the worker starts without its CUDA
        context made up front: there, set ``CUPY_MEMSTRAT`` in the worker's
        environment instead (docs/dask.md); a warning in the worker's log
        says so."""
        ours = [a for a in other_preloads_argv if a.startswith("--memstrat")]
        if ours:  # a misspelt option of ours, left over by ignore_unknown_options
            near = difflib.get_close_matches(ours[0].split("=")[0], ["--memstrat-strategy"], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"cupy_memstrat.dask: unknown option {ours[0]!r}{hint}; this preload takes "
                             "--memstrat-strategy=SPEC")
        if memstrat_strategy and other_preloads_argv:
            logging.getLogger("distributed.worker.cupy_memstrat").warning(
                "cupy_memstrat.dask: this worker's preloads share their arguments (%s), so the others get "
                "--memstrat-strategy too, and a preload that knows no such option fails (dask cuda worker's own "
                "dask_cuda.initialize does); set %s=%s in the worker's environment instead",
                " ".join(other_preloads_argv), cupy_memstrat.api.ENV_VAR, memstrat_strategy)
        env = os.environ.get(cupy_memstrat.api.ENV_VAR, "")
        spec = memstrat_strategy or env.strip() or "pool"
        try:
            plugin = MemstratPlugin(spec)
        except (ValueError, TypeError) as exc:
            where = "--memstrat-strategy" if memstrat_strategy else f"environment variable {cupy_memstrat.api.ENV_VAR}"
            raise ValueError(f"cupy_memstrat.dask: {where}={spec!r}: {exc}") from None
        try:
            await worker.plugin_add(plugin, name=PLUGIN_NAME, catch_errors=False)
        except Exception as exc:  # a spec this worker cannot install: say where it came from
            where = "--memstrat-strategy" if memstrat_strategy else f"environment variable {cupy_memstrat.api.ENV_VAR}"
            raise RuntimeError(f"cupy_memstrat.dask: {where}={spec!r} cannot be installed here: "
                               f"{type(exc).__name__}: {exc}") from None
