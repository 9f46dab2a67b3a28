"""A program recorded on the GPU and replayed: under the strategy it was recorded with, the peak in
use comes back exactly and the peak reserved within one growth step; each recorded stream gets a
stream of its own; CuPy's pools run beside the strategies."""

import pytest

import cupy_memstrat
from cupy_memstrat.replay import replay
from cupy_memstrat.trace import read_trace

MiB = 1 << 20


def _program(cp):
    """Temporaries of mixed sizes on the null stream and two streams of its own, some kept."""
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    kept = []
    for step in range(60):
        s = streams[step % 2] if step % 3 else cp.cuda.Stream.null
        with s:
            a = cp.ones((step % 7 + 1) * 300_000, dtype=cp.float32)
            b = a * 2
            if step % 5 == 0:
                kept.append(b.sum())
            if step % 11 == 0:
                kept.append(cp.empty((step % 4 + 1) * 3 * MiB, dtype=cp.uint8))
            del a, b
        if len(kept) > 6:
            kept.pop(0)
    for s in streams:
        s.synchronize()
    kept.clear()


@pytest.mark.parametrize("spec", ["pool", "managed", "async", "device"])
def test_a_recording_replayed_under_its_own_strategy_gives_its_peaks_back(cp, tmp_path, spec):
    s = cupy_memstrat.use(spec)
    s.trim()
    s.reset_peak()
    cupy_memstrat.record_history(origins=False)
    _program(cp)
    cp.cuda.Device().synchronize()
    st = s.stats()
    cupy_memstrat.snapshot(str(tmp_path / "rec.json"))
    cupy_memstrat.record_history(False)
    s.trim()
    trace = read_trace(str(tmp_path / "rec.json"))
    assert trace.recorded_with == spec and len(trace.streams) == 3  # the null stream and two of its own
    rep = replay(trace, strategies=[spec], cupy_paths=[])
    row = rep["results"][spec]
    assert row["completed"] and row["peak_in_use"] == st.peak_bytes_in_use
    assert abs(row["peak_reserved"] - st.peak_bytes_reserved) <= max(row["largest_growth"], 2 * MiB)


def test_cupys_pools_and_the_strategies_replay_one_trace_side_by_side(cp, tmp_path):
    cupy_memstrat.use("pool")
    cupy_memstrat.record_history(origins=False)
    _program(cp)
    cupy_memstrat.snapshot(str(tmp_path / "rec.json"))
    cupy_memstrat.record_history(False)
    rep = replay(read_trace(str(tmp_path / "rec.json")), strategies=["device", "managed"])
    assert set(rep["results"]) == {"cupy-default", "cupy-async", "device", "managed"}
    assert all(r["completed"] and r["peak_in_use"] > 0 for r in rep["results"].values())
    assert rep["results"]["device"]["reserved_over_in_use"] == 1.0
    assert rep["machine"]["cuda"]["devices"][0]["name"]


@pytest.mark.parametrize("program, spec, reserved_mib", [
    ("16-then-32", "async", 192), ("32-then-16", "async", 192), ("alternating-batches", "async", 896),
    ("16-then-32", "managed", 256), ("32-then-16", "managed", 256), ("16-then-32", "device", 128),
])
def test_the_gpu_reserves_what_the_simulated_gpu_reserves_for_the_fragmenting_programs(cp, program, spec,
                                                                                       reserved_mib):
    # the same figures as tests/test_replay.py's on the simulated GPU
    from cupy_memstrat.bench import fragmentation

    rep = replay(fragmentation.program(program), strategies=[spec], cupy_paths=[])
    assert rep["results"][spec]["peak_reserved"] == reserved_mib * MiB
