"""Finding out where GPU memory went, on the GPU: the export to PyTorch's
memory viewer read by the image's own torch.cuda._memory_viz, its numbers
against the strategy's, and the out-of-memory snapshot's live set against
live_allocations(). With GPUMEM_VIZ_OUT=DIR each strategy's export is
written there (docs/results/memory-viz-h200/ keeps two)."""

import json
import os
import shutil

import pytest

import cupy_memstrat
from cupy_memstrat import history

MiB = 1 << 20
NAMES = ["device", "managed", "async", "pool"]


def _too_much(cp):
    free, total = cp.cuda.runtime.memGetInfo()
    return total + (64 << 30)  # more than the device has: refused at once (managed: by its guard)


@pytest.fixture
def recorded(cp):
    made = []

    def make(name, **options):
        s = cupy_memstrat.use(name, track_origins=8, **options)
        made.append(s)
        return s

    yield make
    if history._active is not None:
        cupy_memstrat.record_history(False)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    for s in made:
        s.close()


def _workload(cp):
    keep = []
    for i in range(16):
        a = cp.arange(1000 * (i + 1), dtype=cp.float32)
        b = cp.ones((i % 4 + 1) * MiB, dtype=cp.uint8)
        if i % 3 == 0:
            keep.append(a * 2)
        del a, b
    return keep


@pytest.mark.gpu_exclusive  # asks for more than the device: the async pool may fill it before refusing
@pytest.mark.parametrize("name", NAMES)
def test_torchs_memory_viz_reads_the_export_and_the_numbers_are_ours(cp, recorded, name, tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz", reason="PyTorch is not installed")
    s = recorded(name)
    cupy_memstrat.record_history()
    keep = _workload(cp)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):
        cp.empty(_too_much(cp), dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    data = cupy_memstrat.snapshot(str(tmp_path / "s.pickle"), format="torch")
    live = [b for seg in data["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    st = s.stats()
    assert sum(b["requested_size"] for b in live) == st.bytes_in_use
    if name == "managed":
        assert sum(seg["total_size"] for seg in data["segments"]) == st.bytes_reserved
    assert {a.data.ptr for a in keep} <= {b["address"] for b in live}
    summary = mv.segsum(data)
    assert f"segments: {len(data['segments'])}" in summary
    assert "raise OutOfMemoryError" in mv.trace(data)
    pages = {"trace": mv.trace_plot(data), "segments": mv.segment_plot(data)}
    assert all("MemoryViz.js" in html for html in pages.values())
    out = os.environ.get("GPUMEM_VIZ_OUT")
    if out:  # the export, for PyTorch's viewer (pytorch.org/memory_viz) or its trace_plot / segment_plot
        os.makedirs(out, exist_ok=True)
        shutil.copyfile(tmp_path / "s.pickle", os.path.join(out, f"memory-viz-{name}.pickle"))
    del keep


@pytest.mark.gpu_exclusive  # asks for more than the device: the async pool may fill it before refusing
@pytest.mark.parametrize("name", NAMES)
def test_the_oom_snapshot_holds_the_live_allocations(cp, recorded, name, tmp_path):
    path = str(tmp_path / "oom.json")
    s = recorded(name, oom_snapshot=path)
    keep = [cp.ones(5 * MiB, dtype=cp.uint8), cp.arange(1000)]
    with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
        cp.empty(_too_much(cp), dtype=cp.uint8)
    assert info.value.snapshot == path
    doc = json.loads(open(path).read())
    assert {(r["ptr"], r["size"]) for r in doc["oom"]["live"]} == {(a.ptr, a.size) for a in s.live_allocations()}
    assert all(r["frames"] for r in doc["oom"]["live"])
    del keep
