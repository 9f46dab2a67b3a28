"""What cupy_memstrat.dask's per-task tracking costs (issue 19): a
LocalCluster with one worker process and one thread, a batch of small tasks
that each allocate and free two CuPy arrays, run with the plugin's
track_tasks=True and track_tasks=False in interleaved rounds; the median
batch time and the ratio. Without a GPU the worker runs on the fake backend
(the GPU's own work then takes no time, so the ratio is an upper bound of
what tracking adds).

Usage: python tools/probes/dask_task_cost.py [OUT.json] [--tasks N] [--rounds R]
"""

import argparse
import json
import os
import statistics
import time


def work(n):
    import cupy

    x = cupy.empty(n, dtype=cupy.uint8)
    y = cupy.empty(n // 2, dtype=cupy.uint8)
    del y
    return int(x.nbytes)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--tasks", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    from distributed import Client, LocalCluster

    import cupy_memstrat.dask as cmd
    from cupy_memstrat.info import collect

    try:
        from cupy_memstrat.cuda import get_backend

        get_backend()
        backend = "cuda"
    except Exception:  # noqa: BLE001 - no GPU: the fake backend on the worker
        os.environ["CUPY_MEMSTRAT_BACKEND"] = "fake:memory=8GiB"
        backend = "fake"
    samples = {"track_tasks=True": [], "track_tasks=False": []}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=50) as cluster, Client(cluster) as c:
        for r in range(args.rounds):
            for label in (list(samples) if r % 2 == 0 else list(samples)[::-1]):
                c.register_plugin(cmd.MemstratPlugin("pool", track_tasks=label.endswith("True")))
                c.gather(c.map(work, [4096] * 50, pure=False))  # warm
                t0 = time.perf_counter()
                c.gather(c.map(work, [4096 + i % 7 for i in range(args.tasks)], pure=False))
                samples[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    report = {"probe": "dask_task_cost", "backend": backend, "machine": collect() if backend == "cuda" else None,
              "params": {"tasks": args.tasks, "rounds": args.rounds, "workers": 1, "threads": 1,
                         "strategy": "pool"},
              "median_seconds_per_batch": med,
              "us_per_task": {k: v / args.tasks * 1e6 for k, v in med.items()},
              "ratio_tracked_to_untracked": med["track_tasks=True"] / med["track_tasks=False"],
              "samples_seconds": samples}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1, default=str) + "\n")
    for k, v in med.items():
        print(f"{k}: {v:.3f} s per {args.tasks} tasks ({v / args.tasks * 1e6:.0f} us a task)")
    print(f"ratio: {report['ratio_tracked_to_untracked']:.3f}")


if __name__ == "__main__":
    main()
