"""cupy_memstrat.dask on a real GPU: dask-cuda's LocalCUDACluster (one
worker per GPU, one thread each) running a dask.array workload with CuPy
chunks, a chunked matrix product and a reduction, under CuPy's pool without
the plugin (the reference), then under MemstratPlugin("managed") and
MemstratPlugin("async"): the results compared with the reference, the
per-task table (task_peaks by key prefix and the top tasks), each worker's
stats and heartbeat metrics, and a figure of the tasks' peaks. Then the cost
of per-task tracking: the same workload under MemstratPlugin("async") with
track_tasks=True and False in interleaved rounds, median seconds and ratio.
Then an out-of-memory task on the worker, and a normal one after it. Each
worker's Prometheus endpoint (/metrics) is read after each strategy's run.

Usage: python ci/dask_gpu.py OUT_DIR (ci/gpu.sh dask runs it) [--n 16384] [--chunk 4096] [--rounds 7] [--devices 0]
Writes OUT_DIR/dask-gpu.json and OUT_DIR/dask-task-peaks.png.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time
import urllib.request


def workload(client, n, chunk, seed=7):
    """sum over rows of (X @ X.T) / n, X uniform [0, 1) float32 of n x n in
    chunk x chunk blocks, made on the workers with CuPy's generator."""
    import cupy
    import dask.array as da

    rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
    x = rs.random_sample((n, n), chunks=(chunk, chunk)).astype("float32")
    y = ((x @ x.T) / n).sum(axis=0)
    return client.compute(y).result()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--devices", default="0", help="the cluster's CUDA_VISIBLE_DEVICES: one worker per GPU (0,1: two)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import cupy
    import numpy as np
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import cupy_memstrat.dask as cmd
    from cupy_memstrat.info import collect

    report = {"probe": "dask_gpu", "machine": collect(), "params": vars(args), "runs": {}}
    import dask
    import dask_cuda
    import distributed

    report["machine"]["packages"].update(dask=dask.__version__, distributed=distributed.__version__,
                                         dask_cuda=dask_cuda.__version__)
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES=args.devices, threads_per_worker=1, dashboard_address=":0",
                          silence_logs=40) as cluster, Client(cluster) as client:
        report["workers"] = client.run(lambda: {"device": cupy.cuda.runtime.getDevice(),
                                                "pci_bus_id": cupy.cuda.Device().pci_bus_id})
        t0 = time.perf_counter()
        ref = cupy.asnumpy(workload(client, args.n, args.chunk))
        report["reference"] = {"allocator": "CuPy's pool, no plugin", "seconds": time.perf_counter() - t0,
                               "first_values": ref[:4].tolist()}
        for spec in ("managed", "async"):
            client.register_plugin(cmd.MemstratPlugin(spec))
            t0 = time.perf_counter()
            got = cupy.asnumpy(workload(client, args.n, args.chunk))
            secs = time.perf_counter() - t0
            diff = float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))
            st = cmd.stats(client)
            metrics = client.run_on_scheduler(
                lambda dask_scheduler: {a: ws.metrics.get("cupy_memstrat") for a, ws in dask_scheduler.workers.items()})
            report["runs"][spec] = {
                "seconds": secs, "identical": bool(np.array_equal(got, ref)), "max_rel_diff": diff,
                "stats": {a: dataclasses.asdict(s) for a, s in st.items()},
                "heartbeat_metrics": metrics,
                "by_prefix": cmd.task_peaks(client, 50, by="prefix"),
                "top_tasks": cmd.task_peaks(client, 12),
                "n_tasks": sum(r["tasks"] for r in cmd.task_peaks(client, 1000, by="prefix")),
            }
            ports = client.run(lambda dask_worker: dask_worker.http_server.port)
            scraped = {}
            for addr, port in ports.items():  # each worker's Prometheus endpoint
                host = addr.split("://")[1].rsplit(":", 1)[0]
                try:
                    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
                    scraped[addr] = [ln for ln in text.splitlines() if "cupy_memstrat" in ln and not ln.startswith("#")]
                except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                    scraped[addr] = f"{type(exc).__name__}: {exc}"
            report["runs"][spec]["prometheus"] = scraped
            snaps = cmd.snapshot(client, os.path.join("/tmp", f"dask-snaps-{spec}"))
            report["runs"][spec]["snapshot_files"] = [os.path.basename(s) for s in snaps]
            print(spec, f"{secs:.2f} s", "identical" if np.array_equal(got, ref) else f"max rel diff {diff:.2e}",
                  flush=True)
            for r in report["runs"][spec]["by_prefix"]:
                print(f"  {r['prefix']:<28} {r['tasks']:>5} tasks  peak {r['peak_bytes'] / 2**20:10.1f} MiB  "
                      f"left {r['left_bytes'] / 2**20:8.1f} MiB", flush=True)

        # the cost of per-task tracking, side by side
        samples = {"track_tasks=True": [], "track_tasks=False": []}
        for r in range(args.rounds):
            for label in (list(samples) if r % 2 == 0 else list(samples)[::-1]):
                client.register_plugin(cmd.MemstratPlugin("async", track_tasks=label.endswith("True")))
                workload(client, args.n, args.chunk)  # warm
                t0 = time.perf_counter()
                workload(client, args.n, args.chunk)
                samples[label].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        report["tracking_cost"] = {"strategy": "async", "median_seconds": med, "samples_seconds": samples,
                                   "ratio_tracked_to_untracked": med["track_tasks=True"] / med["track_tasks=False"]}
        print("tracking cost:", json.dumps(report["tracking_cost"]["median_seconds"]),
              f"ratio {report['tracking_cost']['ratio_tracked_to_untracked']:.3f}", flush=True)

        # out of memory on the worker, then a normal task
        client.register_plugin(cmd.MemstratPlugin("async"))

        def too_big():
            import cupy

            return cupy.empty(1 << 50, dtype=cupy.uint8).nbytes

        def fine():
            import cupy

            return int(cupy.ones(1 << 20, dtype=cupy.float32).sum())

        try:
            client.submit(too_big, pure=False).result()
            oom = {"raised": None}
        except Exception as exc:  # noqa: BLE001 - what the client gets is the measurement
            oom = {"raised": f"{type(exc).__module__}.{type(exc).__name__}", "message": str(exc)[:600]}
        oom["next_task"] = client.submit(fine, pure=False).result()
        report["oom"] = oom
        print("oom:", json.dumps(oom)[:400], flush=True)

    with open(os.path.join(args.out, "dask-gpu.json"), "w") as f:
        f.write(json.dumps(report, indent=1, default=str) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, spec in zip(axes, ("managed", "async")):
        rows = report["runs"][spec]["by_prefix"]
        ax.barh([r["prefix"][:28] for r in rows], [r["peak_bytes"] / 2**20 for r in rows])
        ax.set_title(f"MemstratPlugin({spec!r}): peak per task, by key prefix")
        ax.set_xlabel("MiB (highest task of the prefix)")
    gpus = len(args.devices.split(","))
    fig.suptitle(f"dask.array on LocalCUDACluster, {gpus} GPU{'s' if gpus > 1 else ''}: sum((X @ X.T) / n), "
                 f"n={args.n}, chunks {args.chunk}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "dask-task-peaks.png"), dpi=110)


if __name__ == "__main__":
    main()
