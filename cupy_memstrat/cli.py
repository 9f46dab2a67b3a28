"""``python -m cupy_memstrat``: ``info``, ``bench``, ``plot`` and ``run``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import MemstratError


def _cmd_info(args) -> int:
    from .info import collect, format_report

    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if "cuda" in report else 1


def _cmd_bench_all(args) -> int:
    """``bench`` with no group: every group, its table, JSON and figure into ``--out``."""
    import importlib

    from .bench.alloc import require_real_gpu

    try:
        require_real_gpu()  # at once, before anything is written
        import cupy  # noqa: F401
    except (MemstratError, ImportError) as exc:
        print(f"bench needs a CUDA device and CuPy: {_without_fake_hint(exc)}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else "memstrat-bench"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        print(f"bench: cannot write to --out {out!r}: {exc.strerror}", file=sys.stderr)
        return 2
    groups = list(_BENCH_MODULES)
    for group in groups:  # before anything runs: a file that cannot be written must not cost a run
        for ext in ("json", "png"):
            path = os.path.join(out, f"bench-{group}.{ext}")
            why = _writable(path)
            if why is not None:
                print(f"bench: cannot write {path!r} in --out {out!r}: {why}", file=sys.stderr)
                return 2
    written = []
    t_start = time.monotonic()

    def elapsed() -> str:
        s = int(time.monotonic() - t_start)
        return f"{s // 60}:{s % 60:02d}"

    for i, group in enumerate(groups, 1):
        mod = importlib.import_module(f".bench.{_BENCH_MODULES[group]}", __package__)
        base = mod.progress_printer()
        say = None if args.quiet else (
            lambda msg, i=i, group=group, base=base: base(f"[{elapsed()} {i}/{len(groups)}] {msg}"))
        kwargs = {} if args.rounds is None else {"rounds": args.rounds}
        report = mod.run(progress=say, **kwargs)
        print(f"\n== bench {group} (done at {elapsed()})\n" + mod.format_table(report), flush=True)
        path = os.path.join(out, f"bench-{group}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        written.append(path)
        png = os.path.join(out, f"bench-{group}.png")
        try:
            from .bench.plot import plot

            plot(report, png)
            written.append(png)
        except (RuntimeError, ValueError) as exc:  # no matplotlib, or nothing to draw: the JSON is still there
            print(f"bench {group}: no figure: {exc}", file=sys.stderr)
    print("\nwrote " + ", ".join(written))
    return 0


def _cmd_bench(args) -> int:
    import importlib

    group = args.group
    if group is None:
        return _cmd_bench_all(args)
    out = getattr(args, "out", None)
    if out is not None:  # bench GROUP --out DIR: DIR/bench-GROUP.json and .png, as bench --out DIR writes them
        if args.json:
            print(f"bench {group}: give --out DIR (bench-{group}.json and .png there) or --json PATH, not both",
                  file=sys.stderr)
            return 2
        from .bench.alloc import require_real_gpu

        try:  # before DIR is made: a run refused for want of a GPU leaves nothing behind
            require_real_gpu()
        except MemstratError as exc:
            print(f"bench {group} needs a CUDA device and CuPy: {_without_fake_hint(exc)}", file=sys.stderr)
            return 2
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            print(f"bench {group}: cannot write to --out {out!r}: {exc.strerror}", file=sys.stderr)
            return 2
        args.json = os.path.join(out, f"bench-{group}.json")
    mod = importlib.import_module(f".bench.{_BENCH_MODULES[group]}", __package__)
    if args.json:
        why = _writable(args.json)  # before the run: a bad path must not cost the measurements
        if why is not None:
            print(f"bench {group}: cannot write --json {args.json!r}: {why}", file=sys.stderr)
            return 2
    extra = {k: getattr(args, k) for k in ("strategies", "only", "min_sample_s") if getattr(args, k, None) is not None}
    if extra:
        try:  # before the GPU is touched: a typo must not cost a run
            mod.check_args(**extra)
        except (TypeError, ValueError) as exc:
            text = str(exc)
            for name, flag in (("min_sample_s: ", "--min-sample: "), ("strategies: ", "--strategies: "),
                               ("only: ", "--only: ")):
                if text.startswith(name):  # the option as the user typed it, not run()'s argument
                    text = flag + text[len(name):]
            print(f"bench {group}: {text}", file=sys.stderr)
            return 2
    say = None if args.quiet else mod.progress_printer()
    rounds = args.rounds if args.rounds is not None else _DEFAULT_ROUNDS.get(group, 7)
    try:
        report = mod.run(rounds=rounds, progress=say, **extra)
    except MemstratError as exc:
        print(f"bench {group} needs a CUDA device and CuPy: {_without_fake_hint(exc)}", file=sys.stderr)
        return 2
    print(mod.format_table(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as exc:
            print(f"bench {group}: cannot write --json {args.json!r}: {exc.strerror}; the results are above",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    if out is not None:
        png = os.path.join(out, f"bench-{group}.png")
        try:
            from .bench.plot import plot

            plot(report, png)
            print(f"wrote {png}")
        except (RuntimeError, ValueError) as exc:  # no matplotlib, or nothing to draw: the JSON is still there
            print(f"bench {group}: no figure: {exc}", file=sys.stderr)
    return 0


def _cmd_replay(args) -> int:
    from .replay import check_args, format_table, replay
    from .trace import TraceError, read_trace

    for flag, path in (("--json", args.json), ("--png", args.png)):
        why = None if path is None else "an empty path" if not path.strip() else _writable(path)
        if why is not None:  # before the trace is read: a bad path must not cost the replay
            print(f"replay: cannot write {flag} {path!r}: {why}", file=sys.stderr)
            return 2
    cupy_paths = [] if args.no_cupy else None
    def usage(exc) -> int:
        text = str(exc)
        for name in ("strategies", "limit"):
            if text.startswith(name + ": "):
                text = f"--{name}: " + text[len(name) + 2:]
        print(f"replay: {text}", file=sys.stderr)
        return 2

    try:
        check_args(strategies=args.strategies, cupy_paths=cupy_paths, limit=args.limit)
    except (TypeError, ValueError) as exc:
        return usage(exc)
    try:
        trace = read_trace(args.trace, test=args.test)
        if not trace.n_allocs:
            raise TraceError(f"{trace.source} holds no allocation: nothing to replay")
        say = None if args.quiet else (lambda msg: print(f"replay: {msg}", file=sys.stderr, flush=True))
        report = replay(trace, strategies=args.strategies, cupy_paths=cupy_paths, limit=args.limit,
                        touch=args.touch, progress=say)
    except TraceError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a limit above the device's memory, known once the device is
        return usage(exc)
    except OSError as exc:
        print(f"replay: cannot read {args.trace!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except MemstratError as exc:
        print(f"replay needs a CUDA device and CuPy: {_without_fake_hint(exc)}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as exc:
            print(f"replay: cannot write --json {args.json!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    if args.png:
        try:
            from .bench.plot import plot

            print(f"wrote {plot(report, args.png)}")
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"replay: no figure: {exc}", file=sys.stderr)
    if args.limit is not None and not any(r.get("fits") for r in report["results"].values()):
        print(f"replay: no path fits under --limit {args.limit}", file=sys.stderr)
        return 1
    return 0


def _not_json_why(path: str, exc: BaseException) -> str:
    """Why a file did not load as JSON, in a user's words where it is a pickle or not text."""
    if isinstance(exc, (UnicodeDecodeError, json.JSONDecodeError)):
        try:
            with open(path, "rb") as f:
                head = f.read(2)
        except OSError:
            head = b""
        if head[:1] == b"\x80":
            return "it is a pickle, not JSON (already exported? this reads the JSON that " \
                   "cupy_memstrat.snapshot(PATH) or pytest --gpumem-json writes)"
        if isinstance(exc, UnicodeDecodeError):
            return "it is not a text file, so not JSON"
        return f"it is not JSON ({exc})"
    return str(exc)


def _load_report(cmd: str, path: str, test: str | None, what: str):
    """The JSON object in ``path`` (with ``test``: that test's timeline from
    a pytest --gpumem-json report); None after printing why not."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block, /dev/zero never end
        print(f"{cmd}: cannot read {path!r}: a directory, a FIFO, a socket or a device, not a file",
              file=sys.stderr)
        return None
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        print(f"{cmd}: cannot read {path!r}: {_not_json_why(path, exc)}", file=sys.stderr)
        return None
    if not isinstance(report, dict):
        print(f"{cmd}: {path} is not a report: expected a JSON object written by {what}, "
              f"got a JSON {type(report).__name__}", file=sys.stderr)
        return None
    if isinstance(report.get("tests"), list):  # a --gpumem-json report
        with_history = [t for t in report["tests"] if isinstance(t, dict) and isinstance(t.get("history"), dict)
                        and isinstance(t.get("nodeid", ""), str)]
        want = test
        if want is not None:  # as the terminal printed it, relative to another folder: "../tests/x.py::t"
            while want.startswith(("../", "./")):
                want = want.split("/", 1)[1]
        picked = [t for t in with_history if want is None or want in t.get("nodeid", "")]
        if len(picked) != 1:
            ids = ", ".join(t.get("nodeid", "?") for t in (picked or with_history)[:10]) or "none"
            no_timeline = [t for t in report["tests"] if isinstance(t, dict) and t.get("history_error")
                           and want is not None and want in str(t.get("nodeid", ""))]
            if no_timeline:
                t = no_timeline[0]
                print(f"{cmd}: {t.get('nodeid')} has no timeline: {t['history_error']}", file=sys.stderr)
                return None
            why = "no test in it has a timeline (run pytest with --gpumem-history)" if not with_history else (
                f"--test {test!r} matches {len(picked)} of the tests with a timeline ({ids}"
                + ("; only tests that failed get one)" if not picked else ")") if test
                else f"{len(with_history)} tests have a timeline ({ids}): pick one with --test NODEID")
            print(f"{cmd}: {path} is a pytest_gpumem report; {why}", file=sys.stderr)
            return None
        return dict(picked[0]["history"], title=picked[0].get("nodeid"))  # the figure names the test
    if test is not None:
        print(f"{cmd}: --test picks a test of a pytest --gpumem-json report; {path} is not one", file=sys.stderr)
        return None
    return report


def _check_output_file(cmd: str, out: str, expected: str, source: str | None = None) -> bool:
    """Refuse (printing why) an output path that is empty, a directory, a FIFO
    or a device (writing would wait or go nowhere), in a missing folder, or
    the input file ``source`` itself."""
    o = out.strip()
    if not o or os.path.isdir(o) or o.endswith(os.sep):
        print(f"{cmd}: -o {out!r}: expected {expected}"
              + (f" ({o!r} is a directory)" if o and os.path.isdir(o) else ""), file=sys.stderr)
        return False
    if os.path.exists(o) and not os.path.isfile(o):
        print(f"{cmd}: -o {out!r}: a FIFO, a socket or a device, not a file to write; expected {expected}",
              file=sys.stderr)
        return False
    folder = os.path.dirname(os.path.abspath(o))
    if not os.path.isdir(folder):  # said before anything is done
        print(f"{cmd}: -o {out!r}: the folder {folder!r} does not exist", file=sys.stderr)
        return False
    if source is not None and os.path.exists(o) and os.path.realpath(o) == os.path.realpath(source):
        print(f"{cmd}: -o {out!r} is the input file {source!r}: writing it would destroy what is read",
              file=sys.stderr)
        return False
    return True


def _cmd_export(args) -> int:
    from .memory_viz import write_torch

    if not _check_output_file("export", args.output, "a file path such as 'snapshot.pickle'", source=args.json):
        return 2
    doc = _load_report("export", args.json, args.test, "cupy_memstrat.snapshot() or pytest --gpumem-json")
    if doc is None:
        return 2
    doc.pop("title", None)
    try:
        write_torch(doc, args.output.strip())
    except ValueError as exc:  # the input is no snapshot
        print(f"export: {args.json}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output cannot be written (the message names it)
        print(f"export: {exc}", file=sys.stderr)
        return 2
    out = args.output.strip()
    print(f"wrote {out} (PyTorch's memory snapshot): open it at https://pytorch.org/memory_viz, or make a page "
          f"with python -m torch.cuda._memory_viz trace_plot {out} -o {os.path.splitext(out)[0]}.html")
    return 0


def _write_plot(draw, what, output: str) -> int:
    """``draw(what, output)``; say what it wrote, or why it could not (exit status 2)."""
    try:
        written = draw(what, output)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def _cmd_plot(args) -> int:
    from .bench.plot import plot, plot_side_by_side

    paths = args.json
    for source in paths:
        if not _check_output_file("plot", args.output, "an image file path such as 'figure.png'", source=source):
            return 2
    if len(paths) > 1:  # snapshots side by side (each Dask worker's, for instance)
        if args.test is not None:
            print("plot: --test picks a test of one pytest --gpumem-json report; give one file with it",
                  file=sys.stderr)
            return 2
        docs = []
        for source in paths:
            doc = _load_report("plot", source, None, "cupy_memstrat.snapshot()")
            if doc is None:
                return 2
            docs.append((os.path.splitext(os.path.basename(source))[0], doc))
        return _write_plot(plot_side_by_side, docs, args.output)
    report = _load_report("plot", paths[0], args.test,
                          "bench --json, cupy_memstrat.snapshot() or pytest --gpumem-json")
    if report is None:
        return 2
    return _write_plot(plot, report, args.output)


def _cmd_run(args) -> int:
    import runpy

    from .api import ENV_VAR, use
    from .sizes import format_count, format_size

    spec = args.strategy if args.strategy is not None else os.environ.get(ENV_VAR, "")
    source = "--strategy" if args.strategy is not None else f"environment variable {ENV_VAR}"
    if not spec.strip():
        print(f"run: no strategy: pass --strategy SPEC (e.g. managed:prefetch=on_new) or set {ENV_VAR}",
              file=sys.stderr)
        return 2
    args.module = None
    if args.module_args is not None:
        if not args.module_args or args.target:
            print("run: -m takes a module name, then the module's arguments (nothing else after it)",
                  file=sys.stderr)
            return 2
        args.module, args.target = args.module_args[0], args.module_args[1:]
    if args.module is None:
        if not args.target:
            print("run: nothing to run: give a script (run [--strategy SPEC] script.py [args ...]) "
                  "or -m MODULE", file=sys.stderr)
            return 2
        script, rest = args.target[0], args.target[1:]
        if not os.path.isfile(script):
            why = ("a directory, not a script" if os.path.isdir(script) else
                   "not a regular file (a FIFO, a device or a socket)" if os.path.exists(script) else "no such file")
            print(f"run: cannot run {script!r}: {why}", file=sys.stderr)
            return 2
    else:
        script, rest = None, args.target

        sys.path.insert(0, os.getcwd())  # as python -m finds it
        try:
            why = _module_problem(args.module)  # found without importing it: its import runs under the strategy
        finally:
            sys.path.pop(0)
        if why is not None:
            print(f"run: cannot run -m {args.module!r}: {why}", file=sys.stderr)
            return 2
    if args.record is not None and not _check_output_file("run", args.record, "a file for the recording (.json)"):
        return 2
    try:
        strategy = use(spec.strip())
    except (ValueError, TypeError) as exc:
        print(f"run: {source}={spec!r}: {exc}", file=sys.stderr)
        return 2
    except (MemstratError, RuntimeError) as exc:
        print(f"run: {exc}", file=sys.stderr)
        return 2
    from . import checks

    check_mark = checks.mark()
    recording = None
    if args.record is not None:
        from .history import record_history

        recording = record_history(max_entries=args.record_max, origins=False)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    script_globals = None  # held until the summary: "live at exit" counts what the script kept
    try:
        if script is not None:
            sys.argv = [script, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            script_globals = runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = [args.module, *rest]
            sys.path.insert(0, os.getcwd())
            script_globals = runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - the script's error, shown as Python would show it
        _print_user_traceback(exc)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if recording is not None:
            _write_recording(recording, args.record)
        if not args.quiet:
            _run_summary(spec.strip(), strategy, format_size, format_count)
        del script_globals  # the script's arrays are freed: their frees are checked too
        found = _findings_at_exit(checks, check_mark)
    if found:
        print(f"cupy_memstrat: the checks found {format_count(len(found), 'problem')} during the run:\n"
              + "\n".join(str(f) for f in found[:20])
              + (f"\n... and {len(found) - 20} more" if len(found) > 20 else ""), file=sys.stderr)
        if code is None or code == 0:
            code = 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"), as Python itself does
    return 1


def _write_recording(recording, path: str) -> None:
    """``run --record``: the recording's snapshot to ``path``, and the recording ended."""
    from .history import record_history

    try:
        with open(path, "w") as f:
            json.dump(recording.as_dict(), f)
        note = f"{recording.n_events:,} events"
        if recording.dropped:
            note += (f", of which the {recording.dropped:,} oldest were dropped (raise --record-max to replay "
                     "it)")
        print(f"cupy_memstrat: wrote the recording to {path} ({note})", file=sys.stderr)
    except OSError as exc:
        print(f"cupy_memstrat: cannot write the recording to {path!r}: {exc.strerror or exc}", file=sys.stderr)
    finally:
        if recording.enabled:
            record_history(False)


def _findings_at_exit(checks, since: int) -> list:
    """Every finding of the checks since ``since`` (a ``checks.mark()``), after finishing the
    pending ones (quarantined blocks, queued kernels), whatever each strategy's ``on_finding``:
    a finding of the script's last frees is not lost at exit."""
    try:
        checks.collect()
    except checks.CheckError:
        pass  # on_finding="raise": recorded all the same, listed below
    except Exception as exc:  # noqa: BLE001 - the GPU may be unusable after the script's error
        print(f"cupy_memstrat: the checks' last findings could not be collected: {exc}", file=sys.stderr)
    return checks.findings(since=since)


def _run_summary(spec: str, strategy, format_size, format_count) -> None:
    """``run``'s summary of the strategy it installed, and of the one CuPy allocates with at exit
    where the script installed another."""
    from .api import current

    now = current()
    shown = [(strategy, spec + (" (replaced by the script)" if now is not strategy else ""))]
    if now is not None and now is not strategy:
        shown.append((now, f"{now.name} (installed by the script)"))
    for s, label in shown:
        for d in range(s.backend.device_count()):
            st = s.stats(d)
            if st.n_allocs:
                print(f"cupy_memstrat: {label} on device {d}: peak in use "
                      f"{format_size(st.peak_bytes_in_use)}, peak reserved {format_size(st.peak_bytes_reserved)}, "
                      f"{format_count(st.n_allocs, 'allocation')}, {st.n_live} live at exit", file=sys.stderr)
    if now is None:
        print("cupy_memstrat: the script replaced CuPy's allocator with one that is not a cupy_memstrat "
              "strategy; what it allocated after that is not counted above", file=sys.stderr)


_BENCH_MODULES = {"alloc": "alloc", "async": "async_pool", "managed": "managed", "workloads": "workloads",
                  "streams": "streams", "fragmentation": "fragmentation", "plugin": "plugin"}
_DEFAULT_ROUNDS = {"workloads": 5, "streams": 5, "plugin": 5}  # the others: 7


def _program_names():
    from .bench.fragmentation import PROGRAMS  # no CuPy import: the programs are traces

    return list(PROGRAMS)


def _workload_names():
    from .bench.workloads import WORKLOADS  # no CuPy import: the programs take the array module as an argument

    return list(WORKLOADS)


def _spec_list(text: str) -> list[str]:
    """``--strategies``: specs separated by ';' (a spec has commas of its own)."""
    specs = [t.strip() for t in text.split(";") if t.strip()]
    if not specs:
        raise argparse.ArgumentTypeError(f"expected one or more strategy specs separated by ';', got {text!r}")
    from .registry import get_registry

    names = get_registry().names()
    for spec in specs:
        parts = [p.strip() for p in spec.split(",")]
        if ":" not in spec and len(parts) > 1 and all(p in names for p in parts):
            raise argparse.ArgumentTypeError(
                f"{spec!r} names {len(parts)} strategies: separate specs with ';' (a spec has commas of its "
                f"own), quoted in the shell: '{';'.join(parts)}'")
    return specs


def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more names separated by ',', got {text!r}")
    return names


def _without_fake_hint(exc) -> str:
    """The reason without the hint to try the fake backend: benchmarks time real kernels."""
    text = str(exc)
    cut = text.find("; to try strategies without a GPU")
    return text[:cut] + ")" if cut >= 0 else text


def _blocks_or_is_a_folder(path: str) -> bool:
    """A directory, a FIFO or a socket (opening a FIFO blocks until the other
    end opens it); a device such as /dev/null is fine."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISDIR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _writable(path: str) -> str | None:
    """Why ``path`` cannot be written, or None. Checked by opening it to
    append, which changes nothing that is there; a file this check created is
    removed again (only that: nothing that existed is ever deleted)."""
    if _blocks_or_is_a_folder(path):
        return "a directory, a FIFO or a socket, not a file (opening a FIFO would wait for a reader)"
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        os.unlink(path)
    return None


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` could not run, found without importing anything
    (a package's ``__init__`` must run under the strategy): "no such module",
    a package without ``__main__``, or None."""
    import importlib.machinery
    import importlib.util

    if not name or name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        return "no such module"
    path, spec = None, None
    parts = name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        if full in sys.modules and getattr(sys.modules[full], "__spec__", None) is not None:
            spec = sys.modules[full].__spec__  # already imported (the standard library, say)
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(full, path)
                if spec is None and i == 0:
                    spec = importlib.util.find_spec(full)  # a built-in or frozen module
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            return "no such module"
        path = spec.submodule_search_locations
        if i < len(parts) - 1 and path is None:
            return "no such module"  # a module, not a package, before the last dot
    if spec.submodule_search_locations is not None:
        if importlib.machinery.PathFinder.find_spec(name + ".__main__", spec.submodule_search_locations) is None:
            return "it is a package without a __main__ module (python -m cannot run it either)"
    return None


def _print_user_traceback(exc: BaseException) -> None:
    """The traceback of an exception the script raised, as ``python script.py``
    prints it: without the frames of this package and of runpy before the
    script's first one."""
    import traceback

    ours = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(_runpy_file()), "<frozen runpy>")
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ours):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _runpy_file() -> str:
    import runpy

    return runpy.__file__


def _positive_int(text: str) -> int:
    t = text.strip()
    if not (t.isascii() and t.isdigit()):  # int() would take "1_0" and other scripts' digits
        raise argparse.ArgumentTypeError(f"expected a positive integer (ASCII digits), got {text!r}")
    value = int(t)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        # the console script calls itself cupy-memstrat; python -m cupy_memstrat otherwise
        prog="cupy-memstrat" if os.path.basename(sys.argv[0] or "") == "cupy-memstrat" else "python -m cupy_memstrat",
        description="GPU memory strategies for CuPy."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="devices, versions, memory and feature support")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser(
        "bench", help="benchmarks (need a GPU); with no GROUP: all of them, tables, JSON and figures",
        description="With no GROUP, run every group in turn at its default sizes, print the tables and "
        "write bench-GROUP.json and bench-GROUP.png for each into --out.",
    )
    bench.add_argument("--out", metavar="DIR", default=None,
                       help="where the JSON and figures go (bench-GROUP.json and .png; with no GROUP, default "
                            "./memstrat-bench/)")
    bench.add_argument("--rounds", type=_positive_int, default=None,
                       help="interleaved rounds (default: each group's own: 7, workloads and streams 5)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    bench.set_defaults(func=_cmd_bench)
    groups = bench.add_subparsers(dest="group", required=False, metavar="GROUP")
    helps = {
        "alloc": "alloc+free latency and a small-temporaries workload for every allocator path",
        "async": "the async strategy against CuPy's MemoryAsyncPool, RMM and cudaMalloc: latency, "
        "a 64 MiB sync loop at release threshold 0 and default, pool growth, trim, max_size",
        "managed": "the managed strategy: alloc+free latency against CuPy's pool, a 1 GiB first GPU pass "
        "under each advice / prefetch policy with page-fault counts, read-mostly's cost",
        "workloads": "real CuPy programs (CG Poisson solve, FFT convolution, k-means, a Monte Carlo pricer, "
        "one data set larger than a quarter of the GPU, four streams of allocate / compute / free) under "
        "CuPy's pool and every strategy: time, peaks, page faults, results checked against CuPy's pool",
        "streams": "stream patterns that hand a block to one stream while another still uses it (late "
        "writers, frees from another stream or the collector, per-thread default streams, cupy#8068 with "
        "and without record_stream): wrong elements under CuPy's pool and every strategy",
        "fragmentation": "programs that fragment a cache (16 MiB then 32 MiB blocks and the reverse, a growing "
        "buffer, random sizes from 1 MiB to 1 GiB, alternating batch sizes) replayed under CuPy's pools and "
        "every strategy: peak reserved against peak in use",
        "plugin": "the pytest plugin's cost per test (pytest subprocesses of small GPU tests): without it, "
        "measuring through the strategy, and with the driver-level reading beside it",
    }
    for group, text in helps.items():
        g = groups.add_parser(group, help=text, description=text)
        g.add_argument("--json", metavar="PATH", help="also write the results (with machine info) here")
        # SUPPRESS: bench --out DIR GROUP and bench GROUP --out DIR are the same
        g.add_argument("--out", metavar="DIR", default=argparse.SUPPRESS,
                       help=f"write bench-{group}.json and bench-{group}.png into DIR")
        # SUPPRESS: given before the group (bench --rounds 3 workloads), the value still counts
        g.add_argument("--rounds", type=_positive_int, default=argparse.SUPPRESS,
                       help=f"interleaved rounds (default {_DEFAULT_ROUNDS.get(group, 7)})")
        g.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress lines")
        if group == "workloads":
            g.add_argument("--strategies", metavar="SPEC;SPEC...", type=_spec_list, default=None,
                           help="strategy specs to run beside CuPy's pool and its A/A control, separated by ';' "
                                "(default: every strategy needing no other library, managed's prefetch "
                                "policies and pool:route=wrap)")
            g.add_argument("--only", metavar="NAME,NAME...", type=_name_list, default=None,
                           help="workloads to run (default: all): " + ", ".join(_workload_names()))
            g.add_argument("--min-sample", metavar="SECONDS", type=float, default=None, dest="min_sample_s",
                           help="seconds a timed sample lasts at least, 0 to 10; a short program runs several "
                                "times in one sample (default 0.25)")
        if group == "fragmentation":
            g.add_argument("--strategies", metavar="SPEC;SPEC...", type=_spec_list, default=None,
                           help="strategy specs to run beside CuPy's pools, separated by ';' (default: every "
                                "strategy needing no other library, and torch where PyTorch is installed)")
            g.add_argument("--only", metavar="NAME,NAME...", type=_name_list, default=None,
                           help="programs to run (default: all): " + ", ".join(_program_names()))
        g.set_defaults(func=_cmd_bench)

    rp = sub.add_parser(
        "replay", help="replay a recorded program's allocations under each strategy and CuPy's pools",
        description="Replay the allocations and frees of a recording (cupy_memstrat.snapshot, or run --record), "
        "a pytest_gpumem report (--gpumem-history --gpumem-history-keep=all --gpumem-json) or an RMM log "
        "(CSV), in order, with their sizes and streams, under each strategy and CuPy's MemoryPool and "
        "MemoryAsyncPool: peak in use, peak reserved, growth steps, time per allocation, and whether it fits "
        "under --limit. The trace is read and checked whole before anything is allocated. Exit status: 0 "
        "when the replay ran (with --limit: and at least one path fits), 1 when --limit is given and no path "
        "fits, 2 on bad input.",
    )
    rp.add_argument("trace", help="the recording, report or RMM log")
    rp.add_argument("--strategies", metavar="SPEC;SPEC...", type=_spec_list, default=None,
                    help="strategy specs, separated by ';' (default: every strategy needing no other library, "
                         "and torch where PyTorch is installed)")
    rp.add_argument("--no-cupy", action="store_true", help="leave out CuPy's own pools")
    rp.add_argument("--limit", metavar="SIZE", help="memory a path may use per device (e.g. 40GiB): held by "
                                                    "its own cap where it has one, else by memory set aside")
    rp.add_argument("--touch", action="store_true", help="write each block once (managed memory is then placed)")
    rp.add_argument("--test", metavar="NODEID", help="in a pytest_gpumem report: only this test's timeline")
    rp.add_argument("--json", metavar="PATH", help="also write the report here")
    rp.add_argument("--png", metavar="PATH", help="also draw reserved memory over the replay, per path")
    rp.add_argument("--quiet", action="store_true", help="no progress lines")
    rp.set_defaults(func=_cmd_replay)

    pl = sub.add_parser("plot", help="draw a benchmark's JSON, or a memory timeline (needs matplotlib)")
    pl.add_argument("json", nargs="+", help="a file written by bench ... --json, by cupy_memstrat.snapshot(PATH), or "
                                             "by pytest --gpumem-history --gpumem-json=PATH (then --test picks the "
                                             "test); several snapshots (each Dask worker's, from "
                                             "cupy_memstrat.dask.snapshot) are drawn side by side")
    pl.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, ...)")
    pl.add_argument("--test", metavar="NODEID", help="in a pytest_gpumem report: the test whose timeline to draw "
                                                     "(a part of its node id)")
    pl.set_defaults(func=_cmd_plot)
    ex = sub.add_parser("export", help="a memory snapshot in PyTorch's format, for its memory viewer "
                        "(pytorch.org/memory_viz)")
    ex.add_argument("json", help="a file written by cupy_memstrat.snapshot(PATH), or a pytest --gpumem-json "
                    "report (with --test)")
    ex.add_argument("-o", "--output", required=True, help="the pickle to write (PyTorch's snapshot layout)")
    ex.add_argument("--test", metavar="NODEID", help="in a pytest_gpumem report: the test whose timeline to export "
                    "(a part of its node id)")
    ex.set_defaults(func=_cmd_export)
    run = sub.add_parser(
        "run",
        help="run a Python script (or -m MODULE) unchanged under a strategy, like python -m cProfile",
        description="Install a strategy as CuPy's allocator, then run a script or module as __main__ "
        "with its own arguments. The strategy comes from --strategy, else the environment variable "
        "CUPY_MEMSTRAT. A summary (peak in use and reserved per device) goes to stderr at the end.",
    )
    run.add_argument("-s", "--strategy", metavar="SPEC",
                     help="a strategy spec, e.g. managed:prefetch=on_new (default: $CUPY_MEMSTRAT)")
    run.add_argument("-m", dest="module_args", nargs=argparse.REMAINDER, metavar="MODULE [args ...]",
                     help="run a module, as python -m MODULE; everything after it is the module's")
    run.add_argument("-q", "--quiet", action="store_true", help="no summary at the end")
    run.add_argument("--record", metavar="PATH", help="record every allocation and free CuPy makes through the "
                     "strategy (cupy_memstrat.record_history) and write the recording to PATH at exit, for "
                     "python -m cupy_memstrat replay")
    run.add_argument("--record-max", metavar="N", type=_positive_int, default=2_000_000,
                     help="events the recording keeps at most (default 2,000,000; a recording that dropped "
                          "events cannot be replayed)")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args ...] (or the module's args)")
    run.set_defaults(func=_cmd_run)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
