"""Traces and their replay on the simulated GPU: the three inputs read and checked whole, every bad
trace refused before anything is allocated, a recording replayed under the strategy it was made
with reproducing its peaks, limits, and bench fragmentation's programs."""

import json
import os
import subprocess
import sys

import pytest

from cupy_memstrat.bench import fragmentation
from cupy_memstrat.replay import format_table, replay
from cupy_memstrat.testing import FakeBackend
from cupy_memstrat.trace import TraceError, read_trace, trace_from_events

MiB = 1 << 20


def _snapshot(events, **extra):
    return {"kind": "memory-history", "version": 2, "strategy": {"name": "managed"}, "dropped": 0,
            "max_entries": 100, "events": events, **extra}


def _ev(action, ptr, size, stream=0, device=0):
    return {"action": action, "ptr": ptr, "size": size, "device": device, "stream": stream}


GOOD = [_ev("alloc", 0x100, 4 * MiB), _ev("alloc", 0x200, 2 * MiB, stream=0xabc), _ev("free", 0x100, 4 * MiB),
        _ev("alloc", 0x100, 8 * MiB), _ev("free", 0x200, 2 * MiB, stream=0xabc), _ev("free", 0x100, 8 * MiB)]


def _write(tmp_path, name, content):
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def test_a_recording_is_read_whole_with_its_streams_and_peak(tmp_path):
    t = read_trace(_write(tmp_path, "rec.json", _snapshot(GOOD)))
    assert t.n_allocs == 3 and len(t.events) == 6 and t.streams == [0, 0xabc] and t.recorded_with == "managed"
    assert t.peak_in_use() == 10 * MiB and t.largest() == (8 * MiB, 3)
    assert t.events[2] == (1, 0, 4 * MiB, 0, 0)  # the free names the first block


def test_an_rmm_log_is_read_and_its_failed_allocations_skipped(tmp_path):
    log = ("Thread,Time,Action,Pointer,Size,Stream\n"
           "1,08:00:00.000,allocate,0x7f0000000000,1048576,0x0\n"
           "1,08:00:00.001,allocate failure,0x0,99999999999,0x0\n"
           "2,08:00:00.002,allocate,0x7f0000100000,512,0x55\n"
           "1,08:00:00.003,free,0x7f0000000000,1048576,0x0\n")
    t = read_trace(_write(tmp_path, "rmm.csv", log))
    assert [(e[0], e[2]) for e in t.events] == [(0, MiB), (0, 512), (1, MiB)] and t.streams == [0, 0x55]


def test_a_pytest_gpumem_report_gives_its_tests_timelines_in_order_or_the_one_named(tmp_path):
    rep = {"tests": [{"nodeid": "t.py::a", "history": _snapshot(GOOD[:3])},
                     {"nodeid": "t.py::b"},  # no timeline
                     {"nodeid": "t.py::c", "history": _snapshot([_ev("alloc", 0x900, MiB), _ev("free", 0x900, MiB)])}]}
    path = _write(tmp_path, "report.json", rep)
    assert read_trace(path).n_allocs == 3 and read_trace(path).recorded_with == "managed"  # every timeline's
    assert read_trace(path, test="::c").n_allocs == 1
    with pytest.raises(TraceError, match="matches 0 of the tests with a timeline"):
        read_trace(path, test="::b")
    with pytest.raises(TraceError, match="no test in this pytest_gpumem report has a timeline"):
        read_trace(_write(tmp_path, "empty.json", {"tests": [{"nodeid": "x"}]}))


@pytest.mark.parametrize("name, content, message", [
    ("cut.json", json.dumps(_snapshot(GOOD))[:-40], "not whole JSON"),
    ("foreign.json", {"hello": 1}, "neither a recording"),
    ("list.json", "[1, 2]", "not a trace"),
    ("unknown-free.json", _snapshot([_ev("free", 0x100, MiB)]),
     "event 0: a free of 0x100 on device 0, which the trace never"),
    ("twice.json", _snapshot([_ev("alloc", 0x100, MiB), _ev("alloc", 0x100, MiB)]),
     "event 1: 0x100 is allocated again on device 0 while still live .allocated at event 0."),
    ("bad-size.json", _snapshot([_ev("alloc", 0x100, -5)]), "event 0: size: expected at least 0, got -5"),
    ("bad-action.json", _snapshot([_ev("grab", 0x100, 5)]), "event 0: action: expected 'alloc' or 'free'"),
    ("size-mismatch.json", _snapshot([_ev("alloc", 0x100, 5), _ev("free", 0x100, 6)]),
     "event 1: the free of 0x100 gives 6 bytes, its allocation 5"),
    ("dropped.json", _snapshot(GOOD, dropped=7), "dropped its 7 oldest events"),
    ("header.csv", "Thread,When,What\n1,2,3\n", "line 1: expected RMM's log header"),
    ("short.csv", "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10\n", "line 2: expected 6 fields"),
    ("binary.bin", "\x80\x04garbage", "not a trace"),
    ("dropped-text.json", _snapshot(GOOD, dropped="x"), "the recording: dropped: expected an integer, got 'x'"),
    ("long-size.csv", "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10," + "9" * 5000 + ",0x0\n",
     r"line 2: Size: expected an integer, got '9{59}$"),
    ("wide-digits.csv", "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,\uff11\uff10,0x0\n",
     "line 2: Size: expected an integer in ASCII digits"),
    ("underscore.csv", "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,1_024,0x0\n",
     "line 2: Size: expected an integer in ASCII digits"),
    ("huge-field.csv", "Thread,Time,Action,Pointer,Size,Stream\n1,0," + "a" * 140000 + ",0x10,1,0x0\n",
     "line 2: not a CSV line of an RMM log: field larger than field limit"),
])
def test_every_bad_trace_is_refused_naming_where(tmp_path, name, content, message):
    with pytest.raises(TraceError, match=message):
        read_trace(_write(tmp_path, name, content))


def test_a_log_that_is_not_utf8_and_a_malformed_strategy_field_are_refused_or_ignored(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes(b"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,1,0x0\n1,0,fr\xffe,0x10,1,0x0\n")
    with pytest.raises(TraceError, match="latin.csv, after line .*: not UTF-8 text"):
        read_trace(str(p))
    t = read_trace(_write(tmp_path, "odd.json", _snapshot(GOOD[:1], strategy="device")))
    assert t.recorded_with is None and t.n_allocs == 1  # a strategy field that is not an object: not known
    rep = {"tests": [{"nodeid": "t.py::a", "history": _snapshot(GOOD[:1], strategy=["x"])}]}
    assert read_trace(_write(tmp_path, "rep.json", rep)).recorded_with is None


def test_an_exact_node_id_picks_its_test_where_it_is_part_of_another(tmp_path):
    rep = {"tests": [{"nodeid": "t.py::test_x", "history": _snapshot(GOOD[:1])},
                     {"nodeid": "t.py::test_x_big", "history": _snapshot(GOOD[:3])}]}
    path = _write(tmp_path, "report.json", rep)
    assert read_trace(path, test="t.py::test_x").n_allocs == 1
    assert read_trace(path, test="x_big").n_allocs == 2  # GOOD[:3]: two allocations and a free


def test_nothing_is_allocated_before_a_bad_trace_is_refused(tmp_path):
    """The whole trace is read before the replay starts: an error in its last event, or an
    allocation larger than the device, leaves the device untouched."""
    fake = FakeBackend(memory="1GiB")
    bad_last = _write(tmp_path, "bad.json", _snapshot(GOOD + [_ev("free", 0x777, MiB)]))
    with pytest.raises(TraceError, match="event 6"):
        replay(read_trace(bad_last), backend=fake)
    too_big = trace_from_events([_ev("alloc", 0x100, MiB), _ev("alloc", 0x200, 2 << 30)], source="big")
    with pytest.raises(TraceError, match="big, event 1: 2.0 GiB .* more than device 0's 1.0 GiB"):
        replay(too_big, backend=fake)
    other_device = trace_from_events([_ev("alloc", 0x100, MiB, device=1)], source="dev1")
    with pytest.raises(TraceError, match=r"device 1, but this machine has devices \[0\]"):
        replay(other_device, backend=fake)
    with pytest.raises(ValueError, match="limit"):
        replay(read_trace(_write(tmp_path, "ok.json", _snapshot(GOOD))), backend=fake, limit="lots")
    assert fake.n_malloc_calls == 0 and fake.used_bytes(0) == 0


def test_a_replay_gives_every_path_the_same_program_and_the_table_says_so():
    fake = FakeBackend(memory="4GiB")
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["device", "managed", "async"])
    rows = rep["results"]
    assert set(rows) == {"device", "managed", "async"}
    assert all(r["peak_in_use"] == 128 * MiB and r["completed"] for r in rows.values())
    assert rows["device"]["peak_reserved"] == 128 * MiB and rows["device"]["reserved_over_in_use"] == 1.0
    assert rows["managed"]["peak_reserved"] >= rows["managed"]["peak_in_use"]
    assert rows["managed"]["growth_steps"] >= 1 and rows["managed"]["us_per_alloc"] > 0
    assert rows["device"]["growth_steps"] == 12  # one cudaMalloc per allocation, also after the frees
    assert fake.used_bytes(0) == 0  # every path gave its memory back
    text = format_table(rep)
    assert "16-then-32: 12 allocations on 1 stream, peak in use 128.0 MiB as recorded" in text
    assert "device" in text and "1.00" in text


def test_a_limit_is_held_by_a_cap_or_by_memory_set_aside_and_the_report_says_which():
    fake = FakeBackend(memory="4GiB")
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["device", "async"], limit="100MiB")
    dev, asy = rep["results"]["device"], rep["results"]["async"]
    assert dev["limit_held_by"] == "memory set aside" and dev["fits"] is False
    assert dev["failed_at"] == "16-then-32, event 6"  # the seventh 16 MiB block does not fit in 100 MiB
    assert asy["limit_held_by"] == "max_size" and asy["fits"] is False  # its cap acts in steps: 128 MiB reserved
    assert fake.used_bytes(0) == 0
    text = format_table(rep)
    assert "no: out of memory at 16-then-32, event 6 (memory set aside)" in text
    assert "no: reserved 128.0 MiB > limit 100.0 MiB (max_size)" in text  # completed, but over the limit
    with pytest.raises(ValueError, match=r"limit: 8.0 GiB is above device 0's memory \(4.0 GiB\)"):
        replay(fragmentation.program("16-then-32"), backend=fake, strategies=["async"], limit="8GiB")
    long = "async:release_threshold=1GiB,max_size=2GiB"
    text = format_table(replay(fragmentation.program("16-then-32"), backend=fake, strategies=["device", long]))
    rows = [line for line in text.splitlines() if line.startswith("  ")]
    assert len({line.index(" MiB") for line in rows if " MiB" in line}) == 1  # one column, however long a spec
    roomy = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["device"], limit="1GiB")
    assert roomy["results"]["device"]["fits"] is True
    assert "  yes (memory set aside)" in format_table(roomy)


def test_managed_under_a_limit_keeps_the_headroom_a_device_of_that_size_would_get():
    fake = FakeBackend(memory="4GiB")
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["managed"], limit="512MiB")
    row = rep["results"]["managed"]
    assert row["fits"] is True and row["limit_held_by"] == "memory set aside; guard headroom 25.6 MiB"
    # the control: the real device's 1 GiB headroom, out of the 512 MiB left free, refuses the first block
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["managed:headroom=1GiB"],
                 limit="512MiB")
    row = rep["results"]["managed:headroom=1GiB"]
    assert row["fits"] is False and row["failed_at"] == "16-then-32, event 0"
    # under a limit below the program's peak the guard refuses, as on a device of that size
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["managed"], limit="100MiB")
    assert rep["results"]["managed"]["failed_at"] == "16-then-32, event 5"
    assert fake.used_bytes(0) == 0


def test_the_report_says_which_paths_it_left_out_and_why():
    fake = FakeBackend(memory="4GiB")
    rep = replay(fragmentation.program("16-then-32"), backend=fake)
    out = rep["left_out"]
    assert out["cupy-default"] == out["cupy-async"] == "the simulated GPU has no CuPy pool"
    assert set(out) >= {"cupy-default", "cupy-async", "rmm"} and not set(out) & set(rep["results"])
    assert "rmm" in out["rmm"]
    assert "  cupy-async: not replayed: the simulated GPU has no CuPy pool" in format_table(rep).splitlines()
    rep = replay(fragmentation.program("16-then-32"), backend=fake, strategies=["device"])
    assert set(rep["left_out"]) == {"cupy-default", "cupy-async"}  # strategies named: none left out


def _run_cli(tmp_path, *args):
    env = dict(os.environ, CUPY_MEMSTRAT_BACKEND="fake")
    env.pop("CUPY_MEMSTRAT", None)
    return subprocess.run([sys.executable, "-m", "cupy_memstrat", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


PROGRAM = """
import json, random, cupy, cupy_memstrat
rng = random.Random(3)
live = []
for step in range(300):
    if live and rng.random() < 0.45:
        live.pop(rng.randrange(len(live)))
    else:
        live.append(cupy.empty(rng.choice([512, 3000, 70_000, 1 << 20, 3 << 20, 9 << 20]), dtype=cupy.uint8))
live.clear()
st = cupy_memstrat.current().stats()
json.dump({"peak_in_use": st.peak_bytes_in_use, "peak_reserved": st.peak_bytes_reserved}, open("peaks.json", "w"))
"""


@pytest.mark.parametrize("spec", ["managed", "async", "device"])
def test_a_recording_replayed_under_its_own_strategy_reproduces_its_peaks(tmp_path, spec):
    pytest.importorskip("cupy", reason="CuPy is not installed")
    (tmp_path / "prog.py").write_text(PROGRAM)
    r = _run_cli(tmp_path, "run", "-s", spec, "--record", "rec.json", "prog.py")
    assert r.returncode == 0, r.stderr
    assert "wrote the recording to rec.json" in r.stderr
    recorded = json.loads((tmp_path / "peaks.json").read_text())
    r = _run_cli(tmp_path, "replay", "rec.json", "--strategies", spec, "--json", "out.json", "--quiet")
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "out.json").read_text())["results"][spec]
    assert row["peak_in_use"] == recorded["peak_in_use"]  # exactly
    assert abs(row["peak_reserved"] - recorded["peak_reserved"]) <= row["largest_growth"]  # one growth step


def test_the_replay_command_refuses_bad_input_before_reading_or_allocating(tmp_path):
    good = _write(tmp_path, "rec.json", _snapshot(GOOD))
    r = _run_cli(tmp_path, "replay", good, "--strategies", "nosuch")
    assert r.returncode == 2 and "replay: " in r.stderr and "nosuch" in r.stderr
    r = _run_cli(tmp_path, "replay", good, "--strategies", "managed,device")
    assert r.returncode == 2 and "'managed,device' names 2 strategies: separate specs with ';'" in r.stderr
    r = _run_cli(tmp_path, "replay", good, "--limit", "-3")
    assert r.returncode == 2 and "--limit: expected a size above 0, got '-3'" in r.stderr
    r = _run_cli(tmp_path, "replay", good, "--limit", "1024TiB")
    assert r.returncode == 2 and "--limit: 1.0 PiB is above device 0's memory" in r.stderr
    assert "Traceback" not in r.stderr
    r = _run_cli(tmp_path, "replay", good, "--json", str(tmp_path))
    assert r.returncode == 2 and "cannot write --json" in r.stderr
    r = _run_cli(tmp_path, "replay", good, "--json=")
    assert r.returncode == 2 and "cannot write --json '': an empty path" in r.stderr
    r = _run_cli(tmp_path, "replay", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    bad = _write(tmp_path, "bad.json", _snapshot([_ev("free", 0x100, MiB)]))
    r = _run_cli(tmp_path, "replay", bad)
    assert r.returncode == 2 and "bad.json, event 0: a free of 0x100" in r.stderr


def test_the_replay_command_writes_its_table_json_and_figure(tmp_path):
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    rec = _write(tmp_path, "rec.json", _snapshot(GOOD))
    r = _run_cli(tmp_path, "replay", rec, "--strategies", "device;managed", "--json", "o.json", "--png", "o.png",
                 "--limit", "512MiB")
    assert r.returncode == 0, r.stderr
    assert "peak in use 10.0 MiB as recorded (recorded with managed); limit 512.0 MiB per device" in r.stdout
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["results"]["device"]["fits"] is True and (tmp_path / "o.png").stat().st_size > 0
    if os.path.exists("/dev/full"):  # opens, then refuses every write: found after the replay
        r = _run_cli(tmp_path, "replay", rec, "--strategies", "device", "--json", "/dev/full")
        assert r.returncode == 2 and "replay: cannot write --json '/dev/full': No space left on device" in r.stderr
        assert "Traceback" not in r.stderr
    r = _run_cli(tmp_path, "replay", rec, "--strategies", "device", "--no-cupy", "--limit", "4MiB")
    assert r.returncode == 1 and "replay: no path fits under --limit 4MiB" in r.stderr  # a script can gate on it
    assert "no: out of memory at" in r.stdout


def test_bench_fragmentation_programs_and_bad_arguments():
    t = fragmentation.program("32-then-16")
    assert t.n_allocs == 12 and t.peak_in_use() == 128 * MiB
    assert fragmentation.program("random-sizes").peak_in_use() <= 3 << 30
    assert fragmentation.program("random-sizes").events == fragmentation.program("random-sizes").events  # seeded
    with pytest.raises(ValueError, match="unknown program 'nope'"):
        fragmentation.program("nope")
    with pytest.raises(ValueError, match="unknown program 'nope'"):
        fragmentation.check_args(only=["nope"])
    with pytest.raises(ValueError, match=r"scale: expected a number in \(0, 1\]"):
        fragmentation.check_args(scale=2)
    with pytest.raises(ValueError, match="each spec once"):
        fragmentation.check_args(strategies=["device", "device"])
    with pytest.raises(ValueError, match="'expandable' is the same strategy with the same options as 'vmm'"):
        replay(fragmentation.program("16-then-32"), backend=FakeBackend(memory="1GiB"),
               strategies=["vmm", "expandable"])


# What the H100 gave for these programs (docs/results/h100/bench-fragmentation.json); the
# simulated pool follows it, and tests/gpu/test_replay_gpu.py checks the same figures on the GPU.
MEASURED_RESERVED = {("16-then-32", "async"): 192 * MiB, ("32-then-16", "async"): 192 * MiB,
                     ("alternating-batches", "async"): 896 * MiB, ("16-then-32", "managed"): 256 * MiB,
                     ("32-then-16", "managed"): 256 * MiB, ("16-then-32", "device"): 128 * MiB}


@pytest.mark.parametrize("program, spec", sorted(MEASURED_RESERVED))
def test_the_simulated_gpu_reserves_what_the_gpu_reserved_for_the_fragmenting_programs(program, spec):
    # a stream-ordered pool serves a request from idle memory of other sizes (splitting a larger
    # block, joining smaller ones) before it grows; async's 64 MiB stream cache keeps the rest
    fake = FakeBackend(memory="8GiB")
    rep = replay(fragmentation.program(program), backend=fake, strategies=[spec])
    assert rep["results"][spec]["peak_reserved"] == MEASURED_RESERVED[(program, spec)]
