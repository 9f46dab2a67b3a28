"""cupy_memstrat.dask on a real GPU, the paths dask_gpu.py does not take (issue 19):

1. Next to dask-cuda's RMM plugin. A LocalCUDACluster with rmm_pool_size and
   rmm_allocator_external_lib_list=["cupy"] (RMM is CuPy's allocator on the
   worker): the reference result under RMM, then MemstratPlugin("async")
   registered after it (which allocator CuPy has, what the worker's log and
   the client say, the result compared), the plugin removed (is RMM back?),
   then the other order: MemstratPlugin("managed") first and dask-cuda's
   RMMSetup registered after it (what stats() says).
2. The worker command line: a scheduler and two `dask cuda worker`
   processes on GPU 0, one with `--preload cupy_memstrat.dask
   --memstrat-strategy=async`, one with `--preload cupy_memstrat.dask` and
   CUPY_MEMSTRAT=managed in its environment: each worker's strategy, the
   workload's result compared with the reference.
3. record_history=True on both workers, snapshot(), and
   `python -m cupy_memstrat plot` drawing the two workers side by side.

Usage: python tools/probes/dask_gpu_more.py OUT_DIR [--n 8192] [--chunk 2048]
Writes OUT_DIR/dask-gpu-more.json, OUT_DIR/dask-workers-side-by-side.png and
the workers' logs.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
import warnings


def workload(client, n, chunk, seed=7):
    """sum over rows of (X @ X.T) / n, X uniform [0, 1) float32 (as dask_gpu.py)."""
    import cupy
    import dask.array as da

    rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
    x = rs.random_sample((n, n), chunks=(chunk, chunk)).astype("float32")
    y = ((x @ x.T) / n).sum(axis=0)
    return cupy.asnumpy(client.compute(y).result())


def allocators(client):
    def one():
        import cupy

        import cupy_memstrat

        s = cupy_memstrat.current()
        return {"cupy_allocator": repr(cupy.cuda.get_allocator())[:160], "strategy": s.name if s else None}

    return client.run(one)


def memstrat_log_lines(client):
    return {a: [line for _, line in lines if "cupy_memstrat" in line]
            for a, lines in client.get_worker_logs(n=200).items()}


def compare(got, ref):
    import numpy as np

    return {"identical": bool(np.array_equal(got, ref)),
            "max_rel_diff": float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import dask
    import dask_cuda
    import distributed
    import rmm

    from cupy_memstrat.info import collect

    report = {"probe": "dask_gpu_more", "machine": collect(), "params": vars(args)}
    report["machine"]["packages"].update(dask=dask.__version__, distributed=distributed.__version__,
                                         dask_cuda=dask_cuda.__version__, rmm=rmm.__version__)
    n, chunk = args.n, args.chunk

    try:
        ref = rmm_paths(report, n, chunk)
    except Exception:  # noqa: BLE001 - recorded; the command-line part still runs
        report["rmm_error"] = traceback.format_exc()
        print(report["rmm_error"], flush=True)
        ref = None
    try:
        command_line(report, args, ref)
    except Exception:  # noqa: BLE001 - recorded
        report["command_line_error"] = traceback.format_exc()
        print(report["command_line_error"], flush=True)
    with open(os.path.join(args.out, "dask-gpu-more.json"), "w") as f:
        f.write(json.dumps(report, indent=1, default=str) + "\n")


def observe(client, n, chunk, ref):
    """The workload again under the allocators installed now: its values against ref, the
    plugin's stats (with the warnings the client saw reading them) and the workers' log lines."""
    import cupy_memstrat.dask as cmd

    got = workload(client, n, chunk)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        st = cmd.stats(client)
    return dict(compare(got, ref), stats={a: dataclasses.asdict(s) for a, s in st.items()},
                client_warnings=[str(w.message) for w in seen], worker_log=memstrat_log_lines(client))


def rmm_paths(report, n, chunk):
    """1. next to dask-cuda's RMM plugin; returns the reference result."""
    from dask_cuda import LocalCUDACluster
    from dask_cuda.plugins import RMMSetup
    from distributed import Client

    import cupy_memstrat.dask as cmd

    rm = report["rmm"] = {}
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", threads_per_worker=1, dashboard_address=":0",
                          rmm_pool_size="2GiB", rmm_allocator_external_lib_list=["cupy"],
                          silence_logs=30) as cluster, Client(cluster) as client:
        rm["before"] = allocators(client)
        ref = workload(client, n, chunk)
        rm["reference"] = {"allocator": "RMM (dask-cuda RMMSetup, pool 2 GiB)", "first_values": ref[:4].tolist()}
        print("under RMM:", rm["before"], flush=True)

        client.register_plugin(cmd.MemstratPlugin("async"))
        rm["memstrat_after_rmm"] = {"allocators": allocators(client)}
        rm["memstrat_after_rmm"].update(observe(client, n, chunk, ref))
        print("MemstratPlugin after RMM:", json.dumps(rm["memstrat_after_rmm"], default=str)[:900], flush=True)

        client.unregister_worker_plugin(cmd.PLUGIN_NAME)
        rm["after_unregister"] = allocators(client)
        print("plugin removed:", rm["after_unregister"], flush=True)

        client.register_plugin(cmd.MemstratPlugin("managed"))
        client.register_plugin(RMMSetup(initial_pool_size="1GiB", maximum_pool_size=None, managed_memory=False,
                                        async_alloc=False, release_threshold=None, log_directory=None,
                                        track_allocations=False, external_lib_list=["cupy"]))
        rm["rmm_after_memstrat"] = {"allocators": allocators(client)}
        rm["rmm_after_memstrat"].update(observe(client, n, chunk, ref))
        print("RMMSetup after MemstratPlugin:", json.dumps(rm["rmm_after_memstrat"], default=str)[:900], flush=True)
    return ref


def command_line(report, args, ref):
    """2. the worker command line, and 3. two workers' timelines side by side."""
    from distributed import Client, LocalCluster

    import cupy_memstrat.dask as cmd

    n, chunk = args.n, args.chunk
    if ref is None:  # the RMM part failed: the reference under CuPy's own pool, in this process
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                          silence_logs=40) as c0, Client(c0) as client:
            ref = workload(client, n, chunk)

    # 2. the worker command line, and 3. two workers' timelines side by side
    cli = report["command_line"] = {}
    procs, logs = [], []
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40) as cluster, \
            Client(cluster) as client:
        for label, flag, env_value in (("async-flag", ["--memstrat-strategy=async"], None),
                                       ("managed-env", [], "managed")):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
            env.pop("CUPY_MEMSTRAT", None)
            if env_value:
                env["CUPY_MEMSTRAT"] = env_value
            log = open(os.path.join(args.out, f"dask-cuda-worker-{label}.log"), "w")
            cmdline = [sys.executable, "-m", "dask", "cuda", "worker", cluster.scheduler_address,
                       "--nthreads", "1", "--no-dashboard", "--name", label,
                       "--preload", "cupy_memstrat.dask", *flag]
            cli.setdefault("commands", {})[label] = {
                "argv": " ".join(["dask", "cuda", "worker", "SCHEDULER", *cmdline[6:]]),
                "env": {"CUPY_MEMSTRAT": env_value} if env_value else {}}
            procs.append(subprocess.Popen(cmdline, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
        try:
            client.wait_for_workers(2, timeout=120)
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            st = cmd.stats(client)
            cli["strategies"] = {names[a]: s.strategy for a, s in st.items()}
            print("dask cuda worker --preload:", cli["strategies"], flush=True)
            t0 = time.perf_counter()
            got = workload(client, n, chunk)
            cli["workload"] = dict(compare(got, ref), seconds=time.perf_counter() - t0,
                                   stats={names[a]: dataclasses.asdict(s) for a, s in cmd.stats(client).items()},
                                   by_prefix=cmd.task_peaks(client, 20, by="prefix"))
            print("workload on the command-line workers:", cli["workload"]["identical"],
                  cli["workload"]["max_rel_diff"], flush=True)

            hist = report["record_history"] = {}
            client.register_plugin(cmd.MemstratPlugin("async", record_history=True))
            got = workload(client, n, chunk)
            hist.update(compare(got, ref))
            folder = os.path.join("/tmp", "dask-more-snaps")
            paths = cmd.snapshot(client, folder)
            events = {}
            for path in paths:
                with open(path) as f:
                    doc = json.load(f)
                events[os.path.basename(path)] = {"strategy": doc["strategy"]["name"], "events": len(doc["events"]),
                                                  "dropped": doc["dropped"], "segments": len(doc["segments"])}
            hist["snapshots"] = events
            png = os.path.join(args.out, "dask-workers-side-by-side.png")
            r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "plot", *paths, "-o", png],
                               capture_output=True, text=True, timeout=120)
            hist["plot"] = {"rc": r.returncode, "stdout": r.stdout[-600:], "stderr": r.stderr[-600:],
                            "png_bytes": os.path.getsize(png) if os.path.exists(png) else None}
            print("record_history + plot:", json.dumps(hist, default=str)[:900], flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for log in logs:
                log.close()


if __name__ == "__main__":
    main()
