"""A snapshot at out of memory (the ``oom_snapshot`` option, or
CUPY_MEMSTRAT_OOM_SNAPSHOT): written after the recovery, before raising, on
the fake backend; named by the error and by the pytest plugin."""

import json
import os

import pytest

import cupy_memstrat
from cupy_memstrat.memory_viz import to_torch
from cupy_memstrat.testing import FakeBackend

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
MiB = 1 << 20
NAMES = ["device", "managed", "async", "pool"]




def _alloc(n):
    return cupy.empty(n, dtype=cupy.uint8)


@pytest.mark.parametrize("name", NAMES)
def test_an_out_of_memory_error_writes_the_live_set_and_names_the_file(fake_cupy, tmp_path, name):
    path = str(tmp_path / "oom.json")
    s = cupy_memstrat.use(name, oom_snapshot=path, track_origins=3)
    keep = [_alloc(5 * MiB), _alloc(3000)]
    assert not os.path.exists(path)  # nothing written before an error
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        _alloc(2 << 30)
    exc = info.value
    assert exc.snapshot == path and f"snapshot of the memory at this error: {path}" in str(exc)
    doc = json.loads(open(path).read())
    oom = doc["oom"]
    assert doc["kind"] == "memory-history" and doc["version"] == 2 and doc["recording"] is False
    assert oom["requested_bytes"] == 2 << 30 and oom["device"] == 0 and oom["message"].startswith(f"{name} strategy")
    live = {(a.ptr, a.size) for a in s.live_allocations()}
    assert {(r["ptr"], r["size"]) for r in oom["live"]} == live and len(live) == 2
    assert all(r["origin"].startswith(__file__) and r["frames"][0][2] == "_alloc" for r in oom["live"])
    assert oom["stats"][0]["bytes_in_use"] == s.stats(0).bytes_in_use
    data = to_torch(doc)  # PyTorch's viewer: the live set, and the error in the trace
    assert [e["action"] for e in data["device_traces"][0]] == ["oom"]
    assert sum(b["requested_size"] for seg in data["segments"] for b in seg["blocks"]
               if b["state"] == "active_allocated") == s.stats(0).bytes_in_use
    del keep


def test_while_recording_the_snapshot_holds_the_recent_events(fake_cupy, tmp_path):
    path = str(tmp_path / "oom.json")
    cupy_memstrat.use("managed", oom_snapshot=path)
    cupy_memstrat.record_history()
    a = _alloc(MiB)
    del a
    b = _alloc(2 * MiB)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        _alloc(2 << 30)
    doc = json.loads(open(path).read())
    assert doc["recording"] is True and [e["action"] for e in doc["events"]] == ["alloc", "free", "alloc"]
    assert doc["oom_events"][-1]["size"] >= 2 << 30 and len(doc["oom"]["live"]) == 1
    del b


def test_the_environment_variable_is_the_default_and_is_checked_at_use(fake_cupy, tmp_path):
    path = str(tmp_path / "env.json")
    fake_cupy.setenv("CUPY_MEMSTRAT_OOM_SNAPSHOT", path)
    s = cupy_memstrat.use("device")
    assert s.config["oom_snapshot"] == path
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        _alloc(2 << 30)
    assert json.loads(open(path).read())["oom"]["requested_bytes"] == 2 << 30
    fake_cupy.setenv("CUPY_MEMSTRAT_OOM_SNAPSHOT", str(tmp_path / "no" / "x.json"))
    with pytest.raises(ValueError, match=r"environment variable CUPY_MEMSTRAT_OOM_SNAPSHOT: cannot write .*"
                                         r"the folder .* does not exist"):
        cupy_memstrat.use("managed")
    assert cupy_memstrat.current() is s  # the strategy before stays installed


@pytest.mark.parametrize("bad, match", [
    ("", "expected a file path, got ''"),
    ("   ", "expected a file path"),
    (7, "expected a file path, got int 7"),
    ("{dir}", "is a directory, not a file to write"),
    ("{dir}/missing/x.json", "the folder .* does not exist"),
])
def test_a_bad_path_is_refused_at_use_and_nothing_changes(fake_cupy, tmp_path, bad, match):
    s = cupy_memstrat.use("device")
    x = _alloc(MiB)
    if isinstance(bad, str):
        bad = bad.format(dir=tmp_path)
    with pytest.raises(ValueError, match=f"option oom_snapshot: .*{match}"):
        cupy_memstrat.use("async", oom_snapshot=bad)
    assert cupy_memstrat.current() is s and s.stats(0).bytes_in_use == MiB and os.listdir(tmp_path) == []
    del x


def test_a_snapshot_that_cannot_be_written_never_hides_the_error(fake_cupy, tmp_path):
    folder = tmp_path / "gone"
    folder.mkdir()
    cupy_memstrat.use("device", oom_snapshot=str(folder / "oom.json"))
    folder.rmdir()  # after use(): the write fails at the error
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError, match="the out-of-memory snapshot could not be "
                                                                 "written to .*oom.json") as info:
        _alloc(2 << 30)
    assert info.value.snapshot is None and info.value.requested == 2 << 30


def test_the_guard_and_the_checks_layer_write_it_too(fake_cupy, tmp_path):
    path = str(tmp_path / "g.json")
    s = cupy_memstrat.create("managed", backend=FakeBackend(memory="1GiB"), oom_snapshot=path)
    with pytest.raises(MemoryError) as info:
        s.raw_malloc(1 << 30)  # refused by the oversubscription guard (headroom)
    assert info.value.reason == "oversubscription_guard" and json.loads(open(path).read())["oom"]["reason"] == (
        "oversubscription_guard")
    path2 = str(tmp_path / "c.json")
    c = cupy_memstrat.create("device:check=all", backend=FakeBackend(memory="1GiB"), oom_snapshot=path2)
    assert c.config["oom_snapshot"] == path2
    with pytest.raises(MemoryError):
        c.raw_malloc(2 << 30)
    assert os.path.exists(path2)


def test_the_plugin_names_the_snapshot_of_a_test_that_ran_out_of_memory(pytester, fake_env, tmp_path):
    snap = tmp_path / "oom.json"
    pytester.makepyfile("""
import cupy
def test_big():
    cupy.empty(2 << 30, dtype=cupy.uint8)
def test_small():
    cupy.empty(100, dtype=cupy.uint8)
""")
    r = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--gpumem",
                                     f"--gpumem-strategy=device:oom_snapshot={snap}",
                                     f"--gpumem-json={tmp_path / 'r.json'}")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines([f"*out of memory: the strategy wrote the memory at the error to {snap}*",
                            f"*python -m cupy_memstrat export {snap} -o oom.pickle*"])
    recs = {t["nodeid"].split("::")[-1]: t for t in json.loads((tmp_path / "r.json").read_text())["tests"]}
    assert recs["test_big"]["oom_snapshot"] == str(snap) and "oom_snapshot" not in recs["test_small"]
    assert json.loads(snap.read_text())["oom"]["requested_bytes"] == 2 << 30


def test_errors_in_several_threads_at_once_leave_one_whole_file(fake_cupy, tmp_path):
    import threading

    path = str(tmp_path / "oom.json")
    s = cupy_memstrat.create("device", backend=FakeBackend(memory="1GiB"), oom_snapshot=path)
    keep = [s.raw_malloc(4096) for _ in range(2000)]  # a large live set: each write takes a while
    errors, bad = [], []

    def work():
        for _ in range(10):
            try:
                s.raw_malloc(2 << 30)
            except MemoryError as exc:
                errors.append(exc)
            try:
                json.loads(open(path).read())
            except FileNotFoundError:
                pass
            except ValueError as exc:  # half a file
                bad.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 40 and all(e.snapshot == path for e in errors) and not bad
    assert len(json.loads(open(path).read())["oom"]["live"]) == 2000
    assert sorted(os.listdir(tmp_path)) == ["oom.json"]  # no temporary file left
    del keep


def test_a_relative_path_is_kept_as_given_at_use_whatever_the_directory_later(fake_cupy, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fake_cupy.chdir(tmp_path / "a")
    s = cupy_memstrat.use("device", oom_snapshot="rel.json")
    assert s.config["oom_snapshot"] == str(tmp_path / "a" / "rel.json")
    fake_cupy.chdir(tmp_path / "b")
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        _alloc(2 << 30)
    assert info.value.snapshot == str(tmp_path / "a" / "rel.json") and (tmp_path / "a" / "rel.json").exists()
    assert os.listdir(tmp_path / "b") == []


@pytest.mark.parametrize("bad, match", [
    ("x\0y", "contains a NUL character"),
    ("a" * 5000, r"\(5000 characters\): the name is too long for the file system"),
])
def test_paths_no_file_system_takes_are_refused_at_use(fake_cupy, tmp_path, bad, match):
    fake_cupy.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        cupy_memstrat.use("device", oom_snapshot=bad)


def test_the_checks_layer_keeps_track_origins_frames(fake_cupy):
    s = cupy_memstrat.create("device:check=all,track_origins=4", backend=FakeBackend(memory="1GiB"))

    def inner():
        return s.raw_malloc(100)

    def outer():
        return inner()

    outer()
    frames = s.live_allocations()[0].origin.frames
    assert [f[2] for f in frames[:3]] == ["inner", "outer", "test_the_checks_layer_keeps_track_origins_frames"]


def test_files_keep_their_permissions_and_links_in_a_loop_are_refused(fake_cupy, tmp_path):
    from cupy_memstrat.paths import write_file_atomically

    p = tmp_path / "private.json"
    p.write_text("old")
    os.chmod(p, 0o600)
    write_file_atomically(p, b"{}")
    assert p.read_text() == "{}" and (os.stat(p).st_mode & 0o777) == 0o600
    os.symlink(tmp_path / "loopB", tmp_path / "loopA")
    os.symlink(tmp_path / "loopA", tmp_path / "loopB")
    with pytest.raises(ValueError, match="is a symbolic link in a loop, not a file to write"):
        cupy_memstrat.use("device", oom_snapshot=str(tmp_path / "loopA"))
    with pytest.raises(OSError, match="a symbolic link in a loop"):
        write_file_atomically(tmp_path / "loopA", b"{}")
    assert os.path.islink(tmp_path / "loopA")


def test_a_recording_under_the_checks_layer_keeps_the_frames(fake_cupy):
    cupy_memstrat.use("device:check=all,track_origins=4")
    cupy_memstrat.record_history()

    def inner():
        return _alloc(100)

    x = inner()
    (ev,) = [e for e in cupy_memstrat.snapshot()["events"] if e["action"] == "alloc"]
    assert [f[2] for f in ev["frames"][:3]] == ["_alloc", "inner", "test_a_recording_under_the_checks_layer_keeps_"
                                                                   "the_frames"]
    del x
