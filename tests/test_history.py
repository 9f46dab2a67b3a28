"""Memory timelines: record_history(), snapshot() and their plot, on the fake backend."""

import json

import pytest

import cupy_memstrat

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
MiB = 1 << 20




def _alloc(n):
    return cupy.empty(n, dtype=cupy.uint8)


def test_records_allocations_and_their_frees_with_origins(fake_cupy, tmp_path):
    s = cupy_memstrat.use("device")
    before = _alloc(MiB)  # before recording: baseline only
    h = cupy_memstrat.record_history()
    assert cupy_memstrat.current() is s  # the recorder is in front of the same strategy
    a = _alloc(2 * MiB)
    b = _alloc(3 * MiB)
    del a
    del before  # allocated before recording: its free is not recorded
    doc = cupy_memstrat.snapshot(str(tmp_path / "snap.json"))
    assert json.loads((tmp_path / "snap.json").read_text()) == doc
    assert doc["kind"] == "memory-history" and doc["strategy"]["name"] == "device" and doc["recording"] is True
    assert doc["baseline_bytes_in_use"] == [MiB] and doc["dropped"] == 0
    ev = [(e["action"], e["size"], e["device"]) for e in doc["events"]]
    assert ev == [("alloc", 2 * MiB, 0), ("alloc", 3 * MiB, 0), ("free", 2 * MiB, 0)]
    first = doc["events"][0]
    assert first["origin"].startswith(f"{__file__}:") and first["origin"].endswith("in _alloc")
    assert first["stream"] == 0 and doc["events"][2]["origin"] is None
    assert [e["t"] for e in doc["events"]] == sorted(e["t"] for e in doc["events"])
    assert s.stats().bytes_in_use == 3 * MiB  # the strategy still counts everything
    ended = cupy_memstrat.record_history(False)
    assert ended is h and cupy_memstrat.current() is s and cupy.cuda.get_allocator() == s.cupy_allocator()
    _alloc(MiB)  # after the recording: not recorded
    del b  # allocated while recording, freed after it ended: not recorded either
    doc = cupy_memstrat.snapshot()
    assert doc["recording"] is False and len(doc["events"]) == 3


def test_the_buffer_keeps_the_newest_events(fake_cupy):
    cupy_memstrat.use("managed")
    cupy_memstrat.record_history(max_entries=4, origins=False)
    for n in range(1, 6):
        _alloc(n * 1024)  # alloc and free each: 10 events
    doc = cupy_memstrat.snapshot()
    assert doc["dropped"] == 6 and [(e["action"], e["size"]) for e in doc["events"]] == [
        ("alloc", 4096), ("free", 4096), ("alloc", 5120), ("free", 5120)]
    assert all(e["origin"] is None for e in doc["events"])


def test_bad_input_is_refused_and_nothing_changes(fake_cupy):
    with pytest.raises(RuntimeError, match=r"no memory history and no strategy installed: call "
                                           r"cupy_memstrat.use\(\) \(and cupy_memstrat.record_history\(\)"):
        cupy_memstrat.snapshot()
    with pytest.raises(cupy_memstrat.NoStrategyError, match="no cupy_memstrat strategy is installed"):
        cupy_memstrat.record_history()
    s = cupy_memstrat.use("device")
    allocator = cupy.cuda.get_allocator()
    for bad, exc, msg in ((0, ValueError, "max_entries: expected an int >= 1, got 0"),
                          (2.5, TypeError, "max_entries: expected an int >= 1, got float 2.5"),
                          (True, TypeError, "got bool True")):
        with pytest.raises(exc, match=msg):
            cupy_memstrat.record_history(max_entries=bad)
    for bad in ("no", [], None, 1):  # "no" meant True
        with pytest.raises(TypeError, match="origins: expected True or False, got"):
            cupy_memstrat.record_history(origins=bad)
    assert cupy.cuda.get_allocator() is allocator and cupy_memstrat.current() is s
    assert cupy_memstrat.record_history(False) is None  # nothing was running


def test_the_plot_draws_a_snapshot(fake_cupy, tmp_path):
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.cli import main

    cupy_memstrat.use("device")
    cupy_memstrat.record_history()
    keep = [_alloc(k * MiB) for k in range(1, 4)]
    cupy_memstrat.snapshot(str(tmp_path / "s.json"))
    assert main(["plot", str(tmp_path / "s.json"), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    del keep
    empty = dict(json.loads((tmp_path / "s.json").read_text()), events=[])
    (tmp_path / "e.json").write_text(json.dumps(empty))
    assert main(["plot", str(tmp_path / "e.json"), "-o", str(tmp_path / "e.png")]) == 2


def test_plot_picks_a_test_timeline_from_a_gpumem_report(fake_cupy, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    from cupy_memstrat.cli import main

    cupy_memstrat.use("device")
    cupy_memstrat.record_history()
    keep = _alloc(MiB)
    snap = cupy_memstrat.snapshot()
    del keep
    report = {"version": 1, "tests": [{"nodeid": "t.py::test_a"}, {"nodeid": "t.py::test_b", "history": snap},
                                       {"nodeid": "t.py::test_c", "history": snap}]}
    path = tmp_path / "gpumem.json"
    path.write_text(json.dumps(report))
    assert main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert ("2 tests have a timeline (t.py::test_b, t.py::test_c): pick one with --test NODEID"
            in capsys.readouterr().err)
    assert main(["plot", str(path), "--test", "test_c", "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").exists()
    assert main(["plot", str(path), "--test", "test_z", "-o", str(tmp_path / "z.png")]) == 2
    assert "--test 'test_z' matches 0 of the tests with a timeline" in capsys.readouterr().err
    path.write_text(json.dumps({"tests": [{"nodeid": "t.py::test_a"}]}))
    assert main(["plot", str(path), "-o", str(tmp_path / "n.png")]) == 2
    assert "no test in it has a timeline (run pytest with --gpumem-history)" in capsys.readouterr().err


def test_recording_another_strategy_puts_the_installed_one_back_at_the_end(fake_cupy):
    a = cupy_memstrat.use("device")
    before = cupy.cuda.get_allocator()
    b = cupy_memstrat.create("managed")
    cupy_memstrat.record_history(strategy=b)
    x = _alloc(MiB)
    assert b.stats().n_live == 1 and a.stats().n_live == 0  # b allocates while recording
    cupy_memstrat.record_history(False)
    assert cupy.cuda.get_allocator() == before and cupy_memstrat.current() is a
    del x


def test_a_bad_call_leaves_the_recording_in_progress_running(fake_cupy):
    cupy_memstrat.use("device")
    h = cupy_memstrat.record_history()
    for bad, exc in ((0, ValueError), (10**30, ValueError), ("5", TypeError)):
        with pytest.raises(exc, match="max_entries: expected an int >= 1"):
            cupy_memstrat.record_history(max_entries=bad)
    _alloc(MiB)
    assert h.recording and len(cupy_memstrat.snapshot()["events"]) == 2


def test_installing_another_strategy_ends_the_events_and_the_snapshot_says_so(fake_cupy):
    cupy_memstrat.use("device")
    cupy_memstrat.record_history()
    _alloc(MiB)
    cupy_memstrat.use("managed")
    _alloc(MiB)
    doc = cupy_memstrat.snapshot()
    assert doc["recording"] is False and len(doc["events"]) == 2


# -- bad calls change nothing (issue 16) ------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err, match", [
    (dict(enabled="no"), TypeError, "enabled: expected True or False, got str 'no'"),
    (dict(strategy=5), TypeError, "strategy: expected a cupy_memstrat.Strategy object .*got int 5"),
    (dict(strategy="device"), TypeError, "strategy: expected a cupy_memstrat.Strategy object .*got str 'device'"),
    (dict(max_entries=0), ValueError, "max_entries: expected an int >= 1, got 0"),
    (dict(max_entries=2.5), TypeError, "max_entries: expected an int >= 1, got float 2.5"),
])
def test_a_bad_call_is_refused_and_the_recording_in_progress_goes_on(fake_cupy, kwargs, err, match):
    s = cupy_memstrat.use("device")
    h = cupy_memstrat.record_history()
    with pytest.raises(err, match=match):
        cupy_memstrat.record_history(**kwargs)
    assert h.recording and cupy_memstrat.current() is s
    x = _alloc(MiB)
    assert [e[1] for e in h.events] == ["alloc"]
    del x
    assert cupy_memstrat.record_history(False) is h


def test_max_entries_takes_numpy_integers(fake_cupy):
    import numpy as np

    cupy_memstrat.use("device")
    assert cupy_memstrat.record_history(max_entries=np.int64(5)).max_entries == 5
    cupy_memstrat.record_history(False)


def test_inside_using_recording_is_refused_up_front_and_nothing_changes(fake_cupy):
    s = cupy_memstrat.use("device")
    h = cupy_memstrat.record_history()
    with cupy_memstrat.using("device"):
        with pytest.raises(RuntimeError, match="record_history.*inside cupy_memstrat.using.*nothing was changed"):
            cupy_memstrat.record_history()
        with pytest.raises(RuntimeError, match="nothing was changed"):
            cupy_memstrat.record_history(False)  # the recorder could not be taken out here
    assert h.recording and cupy_memstrat.current() is s
    assert cupy_memstrat.record_history(False) is h and not h.recording


def test_snapshot_refuses_an_int_path(fake_cupy):
    cupy_memstrat.use("device")
    cupy_memstrat.record_history()
    with pytest.raises(TypeError, match="path: expected a file path .*got int 2"):
        cupy_memstrat.snapshot(2)  # not a file descriptor: stderr stays open
    cupy_memstrat.record_history(False)


def test_snapshot_refuses_a_path_that_is_no_file_before_writing(fake_cupy, tmp_path):
    import os

    cupy_memstrat.use("device")
    cupy_memstrat.record_history()
    x = cupy.empty(100, dtype=cupy.uint8)
    os.mkfifo(tmp_path / "fifo")  # opening it would wait for a reader: refused, never opened
    for bad, exc, msg in ((tmp_path / "fifo", ValueError, "is a FIFO, not a file to write"),
                          (tmp_path, ValueError, "is a directory, not a file to write"),
                          ("", ValueError, "path: expected a file path, got an empty one"),
                          (tmp_path / "no" / "x.json", FileNotFoundError, "the folder .* does not exist")):
        with pytest.raises(exc, match=msg):
            cupy_memstrat.snapshot(bad)
    assert cupy_memstrat.snapshot(tmp_path / "ok.json")["events"]  # the recording goes on
    del x


def test_record_history_takes_numpy_bools():
    import numpy as np

    assert cupy_memstrat.record_history(enabled=np.bool_(False)) is None


def test_without_a_recording_the_snapshot_is_the_installed_strategys_memory_now(fake_cupy, tmp_path):
    s = cupy_memstrat.use("managed")
    x = _alloc(3 * MiB)
    doc = cupy_memstrat.snapshot(str(tmp_path / "now.pickle"))  # a .pickle path: PyTorch's format
    assert "device_traces" in cupy_memstrat.snapshot(str(tmp_path / ".PKL"))  # a name that is all suffix too
    assert doc["device_traces"] == [[]] and len(doc["segments"]) == 1
    assert doc["segments"][0]["allocated_size"] == s.stats(0).bytes_in_use == 3 * MiB
    assert (tmp_path / "now.pickle").read_bytes()[:2] == b"\x80\x04"
    j = cupy_memstrat.snapshot(str(tmp_path / "now.json"))
    assert j["recording"] is False and j["events"] == [] and json.loads((tmp_path / "now.json").read_text()) == j
    del x


def test_snapshot_of_a_strategy_given_when_nothing_is_recorded_and_none_is_installed(monkeypatch):
    """The Dask plugin's snapshot after another plugin replaced CuPy's allocator: no strategy is
    current, the plugin's still holds the worker's memory."""
    from cupy_memstrat import history
    from cupy_memstrat.testing import FakeBackend

    monkeypatch.setattr(history, "_active", None)
    monkeypatch.setattr(history, "_last", None)
    monkeypatch.setattr(cupy_memstrat.api, "current", lambda: None)
    with pytest.raises(RuntimeError, match="no memory history and no strategy installed"):
        cupy_memstrat.snapshot()
    s = cupy_memstrat.create("device", backend=FakeBackend())
    p = s.raw_malloc(4096)
    doc = cupy_memstrat.snapshot(strategy=s)
    assert doc["strategy"]["name"] == "device" and doc["events"] == [] and doc["baseline_bytes_in_use"] == [4096]
    with pytest.raises(TypeError, match="strategy: expected a cupy_memstrat.Strategy, got str 'device'"):
        cupy_memstrat.snapshot(strategy="device")
    s.raw_free(p)
