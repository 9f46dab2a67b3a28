"""The bench tables render every part of a report (no GPU: synthetic numbers)."""

from cupy_memstrat.bench import alloc, async_pool


def _summary(x):
    return {"median_us": x, "min_us": x, "max_us": x, "runs_us": [x]}


def _alloc_report(labels):
    keys = [str(s) for s in alloc.SIZES] + [alloc.WORKLOAD]
    res = {lab: {k: _summary(1.0 + i) for k in keys} for i, lab in enumerate(labels)}
    return {
        "params": {"workload": "w"},
        "results_us": res,
        "ratio_to_cupy_default": {lab: {k: 1.0 for k in keys} for lab in labels},
    }


def test_async_table_has_every_part():
    lat = _alloc_report(["cupy-default", "no-pool", "async", "cupy-async"])
    lat["ratios"] = {"async/cupy-async": {"512": 0.5}}
    report = {
        "latency": lat,
        "raw_cuda_floor_us": {"own-pool": {"512": _summary(1.2)}},
        "sync_loop": {
            "results_us": {"async": dict(_summary(3.0), reserved_after_bytes=64 << 20), "no-pool": _summary(90.0)},
            "threshold_0_over_default": 54.0,
        },
        "growth": [{"size": 1, "reserved_bytes": 32 << 20}],
        "trim": {
            "reserved_after_sync": 512 << 20,
            "reserved_after_trim_keep_128MiB": 128 << 20,
            "reserved_after_trim_0": 0,
        },
        "max_size": [{"max_size": 33 << 20, "largest_granted_MiB": 64, "smallest_refused_MiB": 65}],
    }
    text = async_pool.format_table(report)
    for needle in ("async/cupy-async: 512 0.500x", "own-pool 512 B 1.20", "54.0x slower", "1 B -> 32.0 MiB",
                   "trim() -> 0 B", "33.0 MiB grants up to 64 MiB"):
        assert needle in text
