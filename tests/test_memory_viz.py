"""Export to PyTorch's memory viewer: snapshot(format="torch") and ``python -m
cupy_memstrat export``, checked against the layout of torch.cuda.memory._snapshot()
(the TypedDicts of torch/cuda/memory.py) and against what the viewer's page
(torch/utils/viz/MemoryViz.js) needs to draw every step, on the fake backend.
torch itself is not needed; where it is installed, its _memory_viz reads the file."""

import json
import pickle
import subprocess
import sys

import pytest

import cupy_memstrat
from cupy_memstrat.memory_viz import to_torch

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
MiB = 1 << 20
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}
STATES = {"active_allocated", "inactive"}




def _alloc(n):
    return cupy.empty(n, dtype=cupy.uint8)


def _workload(s):
    """Small and large arrays, some kept, some freed, one out-of-memory error."""
    keep = []
    for i in range(12):
        a = _alloc(1000 * (i + 1))
        b = _alloc((i % 4 + 1) * MiB + 100)
        if i % 3 == 0:
            keep.append(a)
        del a, b
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        _alloc(4 << 30)
    return keep


def _recorded(name, **options):
    s = cupy_memstrat.use(name, track_origins=4, **options)
    early = _alloc(3 * MiB)  # before recording: in the segments, its free in the trace without an alloc
    cupy_memstrat.record_history()
    keep = _workload(s)
    del early
    if name == "managed":
        s.trim()  # chunks given back: segment_free entries
    return s, keep


def _plain(x):
    """Only the types PyTorch's snapshot holds (a pickle of plain dicts)."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (int, float, str, bool)


def _replay_like_the_viewer(data, device):
    """The segment view of MemoryViz.js steps back from the snapshot through
    the trace: at every step each live block must lie in a segment, and each
    segment_alloc must find its segment. Returns the steps checked."""
    segs = {s["address"]: s["total_size"] for s in data["segments"] if s["device"] == device}
    blocks = {b["address"]: b["requested_size"] for s in data["segments"] if s["device"] == device
              for b in s["blocks"] if b["state"] == "active_allocated"}

    def check():
        for addr in blocks:
            assert any(a <= addr < a + n for a, n in segs.items()), f"block 0x{addr:x} in no segment"

    check()
    trace = data["device_traces"][device]
    for e in reversed(trace):
        if e["action"] == "alloc":
            blocks.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            blocks[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            segs[e["addr"]] = e["size"]
        elif e["action"] == "segment_alloc":
            assert segs.pop(e["addr"], None) == e["size"], f"segment_alloc 0x{e['addr']:x} before its segment"
        check()
    return len(trace)


@pytest.mark.parametrize("name", ["device", "managed", "async", "pool"])
def test_the_export_has_pytorchs_layout_and_our_numbers(fake_cupy, name):
    s, keep = _recorded(name)
    data = cupy_memstrat.snapshot(format="torch")
    assert set(data) == {"segments", "device_traces"} and _plain(data)
    assert len(data["device_traces"]) == 1  # one list per device
    for seg in data["segments"]:
        assert {"device", "address", "total_size", "stream", "segment_type", "allocated_size", "active_size",
                "blocks"} <= set(seg) and seg["segment_type"] in ("small", "large")
        addr = seg["address"]
        for b in seg["blocks"]:  # the blocks tile the segment in address order
            assert b["address"] == addr and b["state"] in STATES and b["size"] > 0
            assert 0 <= b["requested_size"] <= b["size"] and isinstance(b["frames"], list)
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
    live = [b for seg in data["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    st = s.stats(0)
    assert sum(b["requested_size"] for b in live) == st.bytes_in_use  # what our stats say is in use
    if name == "managed":
        assert sum(seg["total_size"] for seg in data["segments"]) == st.bytes_reserved
    kept = {a.data.ptr for a in keep}
    assert kept <= {b["address"] for b in live}
    frames = next(b["frames"] for b in live if b["address"] in kept)
    assert frames[0]["filename"] == __file__  # innermost first, up to track_origins=4 frames
    assert [f["name"] for f in frames] == ["_alloc", "_workload", "_recorded",
                                           "test_the_export_has_pytorchs_layout_and_our_numbers"]
    trace = data["device_traces"][0]
    for e in trace:
        assert e["action"] in ACTIONS and {"size", "stream", "frames", "time_us"} <= set(e)
        assert ("addr" in e) == (e["action"] != "oom")
    ours = cupy_memstrat.snapshot()
    assert sum(e["action"] == "alloc" for e in trace) == sum(e["action"] == "alloc" for e in ours["events"])
    assert sum(e["action"] == "free_completed" for e in trace) == sum(e["action"] == "free" for e in ours["events"])
    (oom,) = [e for e in trace if e["action"] == "oom"]
    assert oom["size"] >= 4 << 30 and oom["device_free"] > 0
    assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
    if name == "managed":  # its chunks: made while recording, and given back by trim()
        assert {"segment_alloc", "segment_free"} <= {e["action"] for e in trace}
    assert _replay_like_the_viewer(data, 0) == len(trace) > 20


def test_snapshot_writes_a_protocol_4_pickle_and_export_writes_the_same(fake_cupy, tmp_path):
    _recorded("managed")
    data = cupy_memstrat.snapshot(str(tmp_path / "s.pickle"), format="torch")
    raw = (tmp_path / "s.pickle").read_bytes()
    assert raw[:2] == b"\x80\x04" and pickle.loads(raw) == data
    cupy_memstrat.snapshot(str(tmp_path / "s.json"))
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", str(tmp_path / "s.json"), "-o",
                        str(tmp_path / "e.pickle")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "pytorch.org/memory_viz" in r.stdout and "trace_plot" in r.stdout
    assert pickle.loads((tmp_path / "e.pickle").read_bytes()) == to_torch(json.loads((tmp_path / "s.json").read_text()))


def test_a_bad_format_or_an_old_snapshot_is_refused_and_nothing_is_written(fake_cupy, tmp_path):
    _recorded("device")
    with pytest.raises(ValueError,
                       match=r"format: expected 'json' or 'torch' \(PyTorch's memory viewer\), got 'pickle'"):
        cupy_memstrat.snapshot(str(tmp_path / "s.bin"), format="pickle")
    assert not (tmp_path / "s.bin").exists()
    with pytest.raises(ValueError, match="this snapshot is version 1; PyTorch's viewer needs version 2"):
        to_torch({"kind": "memory-history", "version": 1, "events": []})
    with pytest.raises(ValueError, match=r"expected a cupy_memstrat.snapshot\(\) \(kind 'memory-history'\), got 'x'"):
        to_torch({"kind": "x"})


@pytest.mark.parametrize("content, err", [
    ("not json", "cannot read"),
    ("\x80\x04\x95 pickled", "it is a pickle, not JSON (already exported?"),
    ('{"kind": "memory-history", "version": 1, "events": []}', "this snapshot is version 1"),
    ('{"benchmark": "alloc"}', "expected a cupy_memstrat.snapshot() (kind 'memory-history'), got None"),
    ("[1, 2]", "is not a report: expected a JSON object"),
])
def test_export_refuses_what_is_not_a_snapshot(tmp_path, content, err):
    (tmp_path / "in.json").write_bytes(content.encode("latin-1"))
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", str(tmp_path / "in.json"), "-o",
                        str(tmp_path / "out.pickle")], capture_output=True, text=True)
    assert r.returncode == 2 and err in r.stderr and r.stderr.startswith("export: "), r.stderr
    assert not (tmp_path / "out.pickle").exists()


def test_export_refuses_a_bad_output_before_reading(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", "missing.json", "-o",
                        str(tmp_path / "no" / "x.pickle")], capture_output=True, text=True)
    assert r.returncode == 2 and "the folder" in r.stderr and "does not exist" in r.stderr


def test_torchs_own_memory_viz_reads_the_export(fake_cupy, tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz", reason="PyTorch is not installed")
    s, _ = _recorded("managed")
    data = cupy_memstrat.snapshot(format="torch")
    summary = mv.segsum(data)  # checks that the blocks add up to each segment
    assert f"segments: {len(data['segments'])}" in summary
    assert "raise OutOfMemoryError" in mv.trace(data)
    lines = mv.memory(data, format_flamegraph=lambda text, *a: text)
    assert "_workload" in lines
    for html in (mv.trace_plot(data), mv.segment_plot(data), mv.trace_plot(data, plot_segments=True)):
        assert "MemoryViz.js" in html


def test_export_takes_one_tests_timeline_from_a_pytest_report(fake_cupy, tmp_path):
    _recorded("device")
    report = {"version": 1, "tests": [{"nodeid": "tests/test_a.py::test_one", "history": cupy_memstrat.snapshot()},
                                      {"nodeid": "tests/test_a.py::test_two", "history": cupy_memstrat.snapshot()}]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    cmd = [sys.executable, "-m", "cupy_memstrat", "export", str(tmp_path / "r.json"), "-o", str(tmp_path / "t.pickle")]
    r = subprocess.run(cmd + ["--test", "test_two"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert pickle.loads((tmp_path / "t.pickle").read_bytes()) == to_torch(report["tests"][1]["history"])
    r = subprocess.run(cmd, capture_output=True, text=True)  # two timelines: which one?
    assert r.returncode == 2 and "2 tests have a timeline" in r.stderr and "pick one with --test NODEID" in r.stderr


def _good_snapshot(tmp_path):
    _s, keep = _recorded("device")  # kept alive: the snapshot's segments hold its live blocks
    doc = cupy_memstrat.snapshot(str(tmp_path / "good.json"))
    assert doc["segments"], "the mangling below needs a live segment"
    del keep
    return doc


@pytest.mark.parametrize("mangle, err", [
    (lambda d: d["events"][0].pop("ptr"), "not a valid snapshot: events[0] lacks 'ptr'"),
    (lambda d: d["events"][0].update(t="soon"), "events[0].t is 'soon': expected seconds"),
    (lambda d: d.update(events=None), "'events' is not a list of objects"),
    (lambda d: d.update(started=None), "'started' is None: expected seconds"),
    (lambda d: d.update(started=1e308), "'started' is 1e+308: expected seconds"),
    (lambda d: d.update(oom_events=[{"t": 0}]), "oom_events[0] lacks 'device'"),
    (lambda d: d.update(devices=10**12), "'devices' is 1000000000000: expected a whole number >= 0 and at most 1024"),
    (lambda d: d.update(devices=-1), "'devices' is -1"),
    (lambda d: d["events"][0].update(action="bogus"), "events[0].action is 'bogus': expected one of alloc, free"),
    (lambda d: d["events"][0].update(device=3), "events[0].device is 3: expected a whole number >= 0 and at most 0"),
    (lambda d: d["segments"][0]["blocks"][0].update(state="maybe"), "segments[0].blocks[0].state is 'maybe'"),
    (lambda d: d["segments"][0].update(address=-4), "segments[0].address is -4"),
    (lambda d: d["segments"][0].update(segment_type=[1]), "segments[0].segment_type is [1]"),
    (lambda d: d["segments"][0].update(stream="s"), "segments[0].stream is 's'"),
    (lambda d: d["events"][0].update(size=2**70), "events[0].size is 1180591620717411303424"),
    (lambda d: d.update(version=2.0), "this snapshot is version 2.0"),
])
def test_export_refuses_a_mangled_snapshot_naming_the_field(fake_cupy, tmp_path, mangle, err):
    doc = _good_snapshot(tmp_path)
    mangle(doc)
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", str(tmp_path / "bad.json"), "-o",
                        str(tmp_path / "out.pickle")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and err in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out.pickle").exists()


def test_export_refuses_a_fifo_or_its_own_input_as_output(fake_cupy, tmp_path):
    import os

    _good_snapshot(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    good = str(tmp_path / "good.json")
    for out, err in ((str(tmp_path / "fifo"), "a FIFO, a socket or a device, not a file to write"),
                     (good, "is the input file"), (str(tmp_path / "." / "good.json"), "is the input file")):
        r = subprocess.run([sys.executable, "-m", "cupy_memstrat", "export", good, "-o", out],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and err in r.stderr, r.stderr
    assert json.loads(open(good).read())["kind"] == "memory-history"  # the input is untouched


def test_a_write_that_fails_leaves_the_previous_file_and_names_the_output(fake_cupy, tmp_path):
    _good_snapshot(tmp_path)
    out = tmp_path / "prev.pickle"
    out.write_text("previous")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); "
            "from cupy_memstrat import cli; sys.exit(cli.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "export", str(tmp_path / "good.json"), "-o", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"cannot write {str(out)!r}" in r.stderr, r.stderr
    assert out.read_text() == "previous" and sorted(p.name for p in tmp_path.iterdir()) == ["good.json", "prev.pickle"]


def test_a_finished_recording_keeps_the_segments_its_events_left(fake_cupy):
    s, keep = _recorded("device")
    cupy_memstrat.record_history(False)
    later = _alloc(7 * MiB)  # after the recording: not in its events, so not in its segments
    del keep
    data = cupy_memstrat.snapshot(format="torch")
    assert later.data.ptr not in {seg["address"] for seg in data["segments"]}
    assert _replay_like_the_viewer(data, 0) > 20  # still consistent with the trace
