"""cupy_memstrat.dask on a real distributed.LocalCluster (processes, two
workers) whose workers run on the fake backend (CUPY_MEMSTRAT_BACKEND=fake):
the plugin, per-task GPU memory, gathering, out of memory on a worker, the
worker command line's --preload."""

import json
import os
import subprocess
import sys
import time

import pytest

distributed = pytest.importorskip("distributed",
                                  reason="distributed is not installed (pip install 'cupy-memstrat[dask]')")
pytest.importorskip("cupy", reason="CuPy is not installed")

import cupy_memstrat  # noqa: E402
import cupy_memstrat.dask as cmd  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def client():
    saved = {k: os.environ.get(k) for k in ("CUPY_MEMSTRAT_BACKEND", "CUPY_MEMSTRAT")}
    os.environ["CUPY_MEMSTRAT_BACKEND"] = "fake:memory=1GiB"  # the workers inherit it
    os.environ.pop("CUPY_MEMSTRAT", None)
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                      silence_logs=50) as cluster, distributed.Client(cluster) as c:
            yield c
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _make(n):
    import cupy

    x = cupy.empty(n, dtype=cupy.uint8)
    y = cupy.empty(n // 2, dtype=cupy.uint8)  # the peak: n + n/2
    del y
    return int(x.nbytes)


def _on_each_worker(c, fn, *args):
    """One task per worker (pinned), results in worker order."""
    return c.gather([c.submit(fn, *args, workers=[a], pure=False, allow_other_workers=False)
                     for a in sorted(c.scheduler_info()["workers"])])


def test_every_worker_runs_the_strategy_and_each_task_is_measured(client):
    client.register_plugin(cmd.MemstratPlugin("device"))
    st = cmd.stats(client)
    assert len(st) == 2 and all(s.strategy == "device" and s.bytes_in_use == 0 for s in st.values())
    assert client.gather([client.submit(_make, (i + 1) * MiB, pure=False) for i in range(6)]) == [
        (i + 1) * MiB for i in range(6)]
    peaks = cmd.task_peaks(client, 3)
    assert [(p["prefix"], p["peak_bytes"], p["left_bytes"], p["overlapped"], p["state"]) for p in peaks] == [
        ("make", 9 * MiB, 0, False, "memory"), ("make", 15 * MiB // 2, 0, False, "memory"),
        ("make", 6 * MiB, 0, False, "memory")]
    assert {p["worker"] for p in cmd.task_peaks(client, 6)} == set(st)
    by_prefix = cmd.task_peaks(client, 10, by="prefix")
    assert sum(p["tasks"] for p in by_prefix if p["prefix"] == "make") == 6
    assert max(p["peak_bytes"] for p in by_prefix) == 9 * MiB


def test_a_task_that_leaves_memory_behind_is_named(client):
    client.register_plugin(cmd.MemstratPlugin("device"))

    def leak(n):
        import builtins

        import cupy

        builtins.__dict__.setdefault("_cupy_memstrat_test_keep", []).append(cupy.empty(n, dtype=cupy.uint8))
        return n

    client.submit(leak, 3 * MiB, pure=False, key="leaky-1").result()
    (row,) = [r for r in cmd.task_peaks(client, 50) if r["key"] == "leaky-1"]
    assert row["left_bytes"] == 3 * MiB and row["prefix"] == "leaky"
    assert sum(s.bytes_in_use for s in cmd.stats(client).values()) == 3 * MiB


def test_out_of_memory_on_a_worker_names_the_worker_and_the_task_and_the_worker_goes_on(client):
    client.register_plugin(cmd.MemstratPlugin("device"))

    def boom():
        import cupy

        cupy.empty(4 << 30, dtype=cupy.uint8)

    f = client.submit(boom, pure=False, key="boom-1")
    with pytest.raises(cupy_memstrat.OutOfMemoryError) as info:
        f.result()
    e = info.value
    assert e.requested == 4 << 30 and e.strategy == "device" and e.stats is not None
    assert "(Dask worker tcp://" in str(e) and "task 'boom-1'" in str(e)
    (row,) = [r for r in cmd.task_peaks(client, 50) if r["key"] == "boom-1"]
    assert row["state"] == "error"
    assert client.submit(_make, MiB, pure=False).result() == MiB  # the next task allocates normally


def test_registering_again_replaces_the_strategy_on_every_worker(client):
    client.register_plugin(cmd.MemstratPlugin("device"))
    client.register_plugin(cmd.MemstratPlugin("managed", prefetch="on_new"))
    assert {s.strategy for s in cmd.stats(client).values()} == {"managed"}
    assert _on_each_worker(client, _make, MiB) == [MiB, MiB]


def test_a_bad_spec_is_refused_at_the_client_and_nothing_is_sent(client):
    client.register_plugin(cmd.MemstratPlugin("device"))
    for bad, exc, match in (("devcie", ValueError, "unknown strategy 'devcie' .did you mean 'device'"),
                            ("async:release_threshold=lots", ValueError, "release_threshold"),
                            (7, TypeError, "expected a name")):
        with pytest.raises(exc, match=match):
            cmd.MemstratPlugin(bad)
    with pytest.raises(ValueError, match="max_keys: expected an int from 1 to 10000000, got 0"):
        cmd.MemstratPlugin("device", max_keys=0)
    with pytest.raises(ValueError, match=r"MemstratPlugin: unknown option 'max_key' \(did you mean 'max_keys'\?\); "
                                         r"its own: track_tasks, max_keys, record_history; "
                                         r"the options of strategy 'pool': oom_snapshot, "
                                         "route, track_origins"):
        cmd.MemstratPlugin("pool", max_key=5)
    # a path on the workers' machines: not checked against the client's file system
    assert cmd.MemstratPlugin("pool", oom_snapshot="/no/such/folder/on/the/client/oom.json").spec == "pool"
    assert {s.strategy for s in cmd.stats(client).values()} == {"device"}  # the workers kept theirs


def test_a_strategy_a_worker_cannot_install_is_reported_and_the_cluster_goes_on(client):
    client.register_plugin(cmd.MemstratPlugin("device"))
    with pytest.raises(ValueError, match="device 3 does not exist"):  # valid as a spec, refused on the workers
        client.register_plugin(cmd.MemstratPlugin("managed", preferred_location=3))
    # the workers keep serving, without a strategy (CuPy's allocator as before): register a good one
    client.register_plugin(cmd.MemstratPlugin("device"))
    assert client.submit(_make, MiB, pure=False).result() == MiB


def test_stats_before_registering_says_what_to_do(client):
    client.register_plugin(cmd.MemstratPlugin("device"))  # whatever ran before on this cluster (xdist order)
    client.unregister_worker_plugin(cmd.PLUGIN_NAME)
    with pytest.raises(RuntimeError, match=r"the MemstratPlugin is not registered on workers tcp://.*: call "
                                           r"client.register_plugin\(MemstratPlugin\(SPEC\)\) first"):
        cmd.stats(client)
    client.register_plugin(cmd.MemstratPlugin("device"))
    assert len(cmd.stats(client)) == 2
    for bad, match in ((0, "n: expected an int >= 1, got 0"), (True, "n: expected an int >= 1")):
        with pytest.raises(ValueError, match=match):
            cmd.task_peaks(client, bad)
    with pytest.raises(ValueError, match="by: expected 'key' or 'prefix', got 'task'"):
        cmd.task_peaks(client, 5, by="task")


def test_snapshot_writes_each_workers_memory_for_export(client, tmp_path):
    client.register_plugin(cmd.MemstratPlugin("managed"))
    paths = cmd.snapshot(client, str(tmp_path / "snaps"))
    assert len(paths) == 2 and all(os.path.basename(p).startswith("worker-127.0.0.1-") for p in paths)
    for p in paths:
        doc = json.loads(open(p).read())
        assert doc["kind"] == "memory-history" and doc["strategy"]["name"] == "managed"
        r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", p, "-o", p + ".pickle"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_record_history_gives_a_timeline_per_worker_and_plot_draws_them_side_by_side(client, tmp_path):
    pytest.importorskip("matplotlib")
    client.register_plugin(cmd.MemstratPlugin("async", record_history=True))
    client.gather(client.map(_make, [MiB * (i + 1) for i in range(6)], pure=False))
    paths = cmd.snapshot(client, str(tmp_path / "snaps"))
    for p in paths:
        doc = json.loads(open(p).read())
        assert doc["recording"] is True and doc["strategy"]["name"] == "async"
        assert {e["action"] for e in doc["events"]} >= {"alloc", "free"}
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "plot", *paths, "-o", str(tmp_path / "w.png")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "w.png").stat().st_size > 10_000
    client.register_plugin(cmd.MemstratPlugin("async"))  # replaced: the recordings end at teardown
    assert all(json.loads(open(p).read())["recording"] is False for p in cmd.snapshot(client, str(tmp_path / "s2")))
    # a snapshot without events is named
    quiet = dict(json.loads(open(paths[1]).read()), events=[])
    (tmp_path / "quiet-worker.json").write_text(json.dumps(quiet))
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "plot", paths[0], str(tmp_path / "quiet-worker.json"),
                        "-o", str(tmp_path / "q.png")], capture_output=True, text=True)
    assert r.returncode == 2 and "quiet-worker: nothing to draw" in r.stderr
    with pytest.raises(ValueError, match=r"record_history: expected True, False or an int >= 1 \(events to keep\), "
                                         r"got -3"):
        cmd.MemstratPlugin("async", record_history=-3)


def test_the_scheduler_gets_each_workers_gpu_bytes_in_its_heartbeats(client):
    client.register_plugin(cmd.MemstratPlugin("device"))

    def seen(dask_scheduler):
        return {a: ws.metrics.get("cupy_memstrat") for a, ws in dask_scheduler.workers.items()}

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = client.run_on_scheduler(seen)
        if all(m and m["strategy"] == "device" for m in got.values()):  # (the last heartbeat may be older)
            break
        time.sleep(0.2)
    assert all(m["strategy"] == "device" and m["bytes_in_use"] >= 0 and "bytes_reserved" in m for m in got.values())


class _CommandLineWorker:
    """A scheduler and one `python -m dask worker SCHEDULER --preload ...` process on the fake backend."""

    def __init__(self, tmp_path, args, env=None, argv=None):
        self.env = dict(os.environ, CUPY_MEMSTRAT_BACKEND="fake:memory=1GiB")
        self.env.pop("CUPY_MEMSTRAT", None)
        self.env.update(env or {})
        self.args, self.log_path = args, tmp_path / "worker.log"
        self.argv = argv or [sys.executable, "-m", "dask", "worker", "{scheduler}", "--nthreads", "1", "--no-nanny",
                             "--no-dashboard"]

    def __enter__(self):
        self.cluster = distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=50)
        self.log = open(self.log_path, "w")
        argv = [a.format(scheduler=self.cluster.scheduler_address) for a in self.argv]
        self.worker = subprocess.Popen([*argv, *self.args], env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = distributed.Client(self.cluster)
        self.client.wait_for_workers(1, timeout=60)
        return self.client

    def __exit__(self, *exc):
        self.client.close()
        self.worker.terminate()
        self.worker.wait(30)
        self.log.close()
        self.cluster.close()


def test_the_worker_command_line_preload_installs_the_strategy(tmp_path):
    with _CommandLineWorker(tmp_path, ["--preload", "cupy_memstrat.dask", "--memstrat-strategy=async"]) as c:
        assert [s.strategy for s in cmd.stats(c).values()] == ["async"]

        def make(n):  # defined here: sent by value (this worker cannot import the test module)
            import cupy

            return int(cupy.empty(n, dtype=cupy.uint8).nbytes)

        assert c.submit(make, MiB, pure=False).result(timeout=60) == MiB


def test_the_preload_leaves_other_preloads_options_to_them(tmp_path):
    """`dask cuda worker` gives every preload the same arguments (dask_cuda.initialize gets
    --create-cuda-context): ours takes CUPY_MEMSTRAT and lets the other preload have its option."""
    other = os.path.join(os.path.dirname(__file__), "data", "dask_other_preload.py")
    # as dask_cuda.CUDAWorker starts its workers: the preloads and one flat list of their arguments
    script = ("import asyncio, sys, distributed\n"
              "async def main():\n"
              "    async with distributed.Worker(sys.argv[1], nthreads=1, "
              "preload=['cupy_memstrat.dask', sys.argv[2]],\n"
              "                                  preload_argv=['--create-cuda-context']) as w:\n"
              "        await w.finished()\n"
              "asyncio.run(main())\n")
    with _CommandLineWorker(tmp_path, [other], env={"CUPY_MEMSTRAT": "async"},
                            argv=[sys.executable, "-c", script, "{scheduler}"]) as c:
        assert [s.strategy for s in cmd.stats(c).values()] == ["async"]
        assert list(c.run(lambda dask_worker: getattr(dask_worker, "_test_other_preload_ran", None)).values()) == [
            True]


def test_a_misspelt_option_of_the_preload_is_refused_not_ignored(tmp_path):
    """Other preloads' options are left to them, but one that looks like ours is a typo: refused, so
    that the worker does not run the default strategy in silence."""
    script = ("import asyncio, sys, distributed\n"
              "async def main():\n"
              "    async with distributed.Worker(sys.argv[1], nthreads=1, preload=['cupy_memstrat.dask'],\n"
              "                                  preload_argv=['--memstrat-stratgy=device']) as w:\n"
              "        await w.finished()\n"
              "asyncio.run(main())\n")
    with _CommandLineWorker(tmp_path, [], argv=[sys.executable, "-c", script, "{scheduler}"]) as c:
        with pytest.raises(RuntimeError, match="the MemstratPlugin is not registered on worker"):
            cmd.stats(c)
    log = (tmp_path / "worker.log").read_text()
    assert "unknown option '--memstrat-stratgy=device' (did you mean '--memstrat-strategy'?)" in log


def _pin(c):
    return sorted(c.scheduler_info()["workers"])[0]


def test_a_cancelled_task_does_not_spoil_the_next_records_and_the_worker_keeps_its_peak(client):
    client.register_plugin(cmd.MemstratPlugin("device"))
    a = _pin(client)

    def slow(n):
        import time as t

        import cupy

        x = cupy.empty(n, dtype=cupy.uint8)
        t.sleep(3)
        return int(x.nbytes)

    f = client.submit(slow, MiB, key="slow-1", workers=[a], pure=False)
    time.sleep(1)
    f.cancel()
    time.sleep(1)
    client.submit(_make, 100 * MiB, key="big-1", workers=[a], pure=False).result()
    client.submit(_make, MiB, key="small-1", workers=[a], pure=False).result()
    rows = {r["key"]: r for r in cmd.task_peaks(client, 100) if r["worker"] == a}
    assert "slow-1" not in rows
    assert (rows["big-1"]["peak_bytes"], rows["big-1"]["overlapped"]) == (150 * MiB, False)
    assert (rows["small-1"]["peak_bytes"], rows["small-1"]["overlapped"]) == (3 * MiB // 2, False)
    time.sleep(2.5)  # the cancelled task ends; its array goes
    assert cmd.stats(client)[a].peak_bytes_in_use >= 150 * MiB  # the worker's peak, not the last task's


def test_a_worker_that_could_not_install_the_strategy_is_named(client):
    with pytest.raises(ValueError, match="device 3 does not exist"):
        client.register_plugin(cmd.MemstratPlugin("managed", preferred_location=3))
    for fn in (cmd.stats, lambda c: cmd.task_peaks(c, 3), lambda c: cmd.snapshot(c, "/tmp/never")):
        with pytest.raises(RuntimeError, match=r"workers tcp://.* could not install the strategy \(tcp://[^:]*:\d+: "
                                               r"ValueError: managed: option preferred_location.*device 3 does not "
                                               r"exist"):
            fn(client)
    client.register_plugin(cmd.MemstratPlugin("device"))
    with pytest.raises(ValueError, match="folder: expected a folder path"):
        cmd.snapshot(client, "")


def test_workers_that_share_one_process_are_refused():
    import cupy

    prev = cupy.cuda.get_allocator()
    saved = os.environ.get("CUPY_MEMSTRAT_BACKEND")
    os.environ["CUPY_MEMSTRAT_BACKEND"] = "fake:memory=1GiB"
    from cupy_memstrat import backends as C

    old_backend = C._backend
    C._backend = None
    try:
        with distributed.LocalCluster(n_workers=2, processes=False, dashboard_address=":0", silence_logs=50) as cl, \
                distributed.Client(cl) as c:
            with pytest.raises(RuntimeError, match="share one process, and CuPy has one allocator per process"):
                c.register_plugin(cmd.MemstratPlugin("device"))
            assert cupy.cuda.get_allocator() == prev  # no worker took over this process's allocator
    finally:
        cupy.cuda.set_allocator(prev)
        C._backend = old_backend
        if saved is None:
            os.environ.pop("CUPY_MEMSTRAT_BACKEND", None)
        else:
            os.environ["CUPY_MEMSTRAT_BACKEND"] = saved


def test_a_task_cancelled_while_its_thread_runs_on_counts_as_running(tmp_path):
    saved = os.environ.get("CUPY_MEMSTRAT_BACKEND")
    os.environ["CUPY_MEMSTRAT_BACKEND"] = "fake:memory=1GiB"
    try:
        with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0",
                                      silence_logs=50) as cl, distributed.Client(cl) as c:
            c.register_plugin(cmd.MemstratPlugin("device"))

            def grow():
                import time as t

                import cupy

                t.sleep(1.5)
                x = cupy.empty(100 << 20, dtype=cupy.uint8)  # after the cancel: its thread goes on
                t.sleep(0.5)
                return int(x.nbytes)

            f = c.submit(grow, key="grow-1", pure=False)
            time.sleep(0.5)
            f.cancel()
            c.submit(_make, MiB, key="small-1", pure=False).result()
            (row,) = [r for r in cmd.task_peaks(c, 10) if r["key"] == "small-1"]
            assert row["overlapped"] is True  # its peak may be the cancelled task's: it says so
            time.sleep(2)
            c.submit(_make, MiB, key="small-2", pure=False).result()
            (row,) = [r for r in cmd.task_peaks(c, 10) if r["key"] == "small-2"]
            assert (row["overlapped"], row["peak_bytes"]) == (False, 3 * MiB // 2)
    finally:
        if saved is None:
            os.environ.pop("CUPY_MEMSTRAT_BACKEND", None)
        else:
            os.environ["CUPY_MEMSTRAT_BACKEND"] = saved


def test_the_workers_prometheus_endpoint_shows_their_gpu_memory(client):
    """distributed serves each worker's /metrics from prometheus_client's registry; the
    plugin adds its gauges there, read here over HTTP from the real endpoint."""
    import re
    import urllib.request

    pytest.importorskip("prometheus_client")
    client.register_plugin(cmd.MemstratPlugin("device"))
    client.gather(client.map(_make, [3 * MiB, MiB], pure=False))
    ports = client.run(lambda dask_worker: dask_worker.http_server.port)
    st = cmd.stats(client)
    for addr, port in ports.items():
        host = addr.split("://")[1].rsplit(":", 1)[0]
        text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
        got = {m[0]: float(m[1]) for m in re.findall(
            r'^dask_worker_cupy_memstrat_bytes\{device="0",kind="(\w+)",strategy="device"\} (\S+)$', text, re.M)}
        assert set(got) == {"in_use", "reserved", "peak_in_use", "peak_reserved"}, text[-2000:]
        assert got["in_use"] == st[addr].bytes_in_use == 0
        assert got["peak_in_use"] == st[addr].peak_bytes_in_use > 0
        assert re.search(r'^dask_worker_cupy_memstrat_failed_allocations_total\{device="0",strategy="device"\} 0\.0$',
                         text, re.M)
    client.unregister_worker_plugin(cmd.PLUGIN_NAME)  # teardown takes the gauges away
    for addr, port in ports.items():
        host = addr.split("://")[1].rsplit(":", 1)[0]
        text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
        assert "dask_worker_cupy_memstrat_bytes" not in text
        assert "dask_worker_tasks" in text  # distributed's own metrics are still served


class _SetsCuPysAllocator(distributed.WorkerPlugin):
    """What dask-cuda's RMMSetup does with rmm_allocator_external_lib_list=["cupy"]: set CuPy's
    allocator at setup (here to a CuPy pool of its own, as RMM is not installed in CI)."""

    name = "sets-cupys-allocator"

    def setup(self, worker):
        import cupy

        worker._test_pool = cupy.cuda.MemoryPool()
        cupy.cuda.set_allocator(worker._test_pool.malloc)


def test_an_allocator_set_after_the_plugin_is_named_not_silently_counted_as_nothing(client, tmp_path):
    client.register_plugin(cmd.MemstratPlugin("device"))
    with _no_warning():
        cmd.stats(client)
    client.register_plugin(_SetsCuPysAllocator())  # registered after ours: it wins for CuPy
    try:
        with pytest.warns(RuntimeWarning, match=r"CuPy's allocator was replaced after the MemstratPlugin \(now "
                                                r"<built-in method malloc of cupy.cuda.memory.MemoryPool object.*"
                                                r"register the MemstratPlugin last"):
            st = cmd.stats(client)
        assert all(s.strategy == "device" for s in st.values())
        with pytest.warns(RuntimeWarning, match="replaced after the MemstratPlugin"):
            paths = cmd.snapshot(client, tmp_path / "snaps")  # the plugin's strategy's memory, not current()'s
        assert len(paths) == 2 and all(json.load(open(p))["kind"] == cupy_memstrat.history.SNAPSHOT_KIND
                                       for p in paths)
        logs = client.get_worker_logs()
        assert all(any("CuPy's allocator is now <built-in method malloc of cupy.cuda.memory.MemoryPool" in line
                       for _, line in lines)
                   for lines in logs.values())
    finally:
        client.unregister_worker_plugin(_SetsCuPysAllocator.name)
    client.register_plugin(cmd.MemstratPlugin("device"))  # registered again, last: it wins, no warning
    with _no_warning():
        assert all(s.strategy == "device" for s in cmd.stats(client).values())


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings(record=True)
        self.seen = self._w.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
        assert not [w for w in self.seen if "replaced after the MemstratPlugin" in str(w.message)]
