"""The plugin's settings: command line, environment, ini; markers.

Every setting has a command-line option, an environment variable and an ini
key. Precedence: marker (per test) > command line > environment > ini >
default. Every value is checked when pytest starts (markers when tests are
collected); a bad one is a ``pytest.UsageError`` that names where it came
from, e.g. ``environment variable GPUMEM_BUDGET='lots': cannot parse ...``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

import cupy_memstrat

from .limits import LIMITS, MARKER_HELP, OFF_WORDS, marker_errors, parse_fragmentation

__all__ = ["SETTINGS", "Settings", "add_options", "resolve", "Plan", "plan_for", "MARKERS"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(raw: str):
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def parse_budget(raw: str):
    """``None`` (off), bytes (int) or ``"N%"`` (a share of each device's memory)."""
    v = raw.strip()
    if v.lower() in OFF_WORDS:
        return None
    cupy_memstrat.parse_size(v, total=100, what="budget")  # checks the syntax, percentages included
    if v.endswith("%"):
        return v
    return cupy_memstrat.parse_size(v, what="budget")


def _choice(*choices):
    def parse(raw: str):
        v = raw.strip().lower()
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return v

    return parse


def parse_tolerance(raw: str):
    v = raw.strip()
    expected = "expected a size >= 0 such as '64MiB' or '1GiB'"
    if v.endswith("%"):
        raise ValueError(f"{expected} (a share of the device is not taken)")
    try:
        return cupy_memstrat.parse_size(v, what="tolerance")
    except ValueError:
        raise ValueError(expected) from None


def parse_interval_ms(raw: str):
    """Milliseconds between readings, as seconds: ASCII digits, 0 for none."""
    t = raw.strip()
    if not (t.isascii() and t.isdigit()):
        raise ValueError("expected a whole number of milliseconds >= 0 (0: no sampling)")
    ms = int(t)
    if ms > 60_000:
        raise ValueError(f"expected at most 60000 milliseconds, got {ms}")
    return ms / 1000


def parse_strategy(raw: str):
    spec = raw.strip()
    cupy_memstrat.validate(spec)
    return spec


def parse_top(raw: str):
    t = raw.strip()
    if not (t.isascii() and t.isdigit()):  # int() would take "1_0", "-1" and other scripts' digits
        raise ValueError("expected a whole number of tests >= 0 (ASCII digits)")
    return int(t)


def parse_check(raw: str):
    from cupy_memstrat.checks import parse_checks

    return parse_checks(raw)


def parse_compare(raw: str):
    from .baseline import load_baseline

    load_baseline(raw)  # read and checked at start-up; the plugin reads it again
    return raw.strip()


def parse_max_growth(raw: str):
    from .baseline import parse_growth

    return parse_growth(raw)


def parse_path(raw: str):
    return raw.strip()


def parse_json_path(raw: str):
    """A path the JSON report can be written to, checked at start-up (before any test runs):
    not a directory, and its folder (or the nearest one that exists, where the missing ones
    would be made) writable. Checked by making a file there and removing it again; nothing
    that exists is changed."""
    import os
    import tempfile

    path = raw.strip()
    if not path:
        raise ValueError("expected a file path, got an empty value")
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{path!r} is a directory; expected a file path such as "
                         f"{os.path.join(path, 'gpumem.json')!r}")
    real = os.path.realpath(path)  # a symbolic link: the file it names is written (report.write_json)
    if os.path.islink(real):  # realpath stops at a loop: writing would replace the link
        raise ValueError(f"{path!r} is a symbolic link in a loop; expected a file path")
    if os.path.exists(real) and not os.path.isfile(real):
        raise ValueError(f"{path!r} is not a regular file (a FIFO, a device or a socket); expected a file path")
    folder = os.path.dirname(real)
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path!r}: {folder!r} is not a directory")
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf here: the probe below decides
        name_max = path_max = None
    if path_max and len(real.encode(errors="surrogateescape")) >= path_max:
        raise ValueError(f"cannot write a {len(real)}-character path: the file system takes at most {path_max - 1}")
    if name_max:
        for part in os.path.relpath(real, folder).split(os.sep):
            if len(part.encode(errors="surrogateescape")) > name_max:
                raise ValueError(f"cannot write {path!r}: a {len(part)}-character file or folder name; the file "
                                 f"system takes at most {name_max}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gpumem-json-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write {path!r}: {exc.strerror or exc} in {folder!r}") from None
    return path


@dataclass(frozen=True)
class Setting:
    name: str  # attribute of Settings; the option's dest is "gpumem_" + name
    option: str
    env: str
    ini: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    flag: bool = False
    metavar: str | None = None
    env_fallback: str | None = None  # a second variable, read after env (CUPY_MEMSTRAT for the strategy)
    ini_type: str = "string"  # pytest's ini type: TOML's native [tool.pytest] table takes values of this type

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


SETTINGS = (
    Setting("measure", "--gpumem", "GPUMEM", "gpumem", parse_bool, False,
            "measure every test's GPU memory (peak, leaks where checked) and report it", flag=True,
            ini_type="bool"),
    Setting("budget", "--gpumem-budget", "GPUMEM_BUDGET", "gpumem_budget", parse_budget, None,
            "fail a test whose peak GPU memory (on top of what was in use when its call began) exceeds "
            "SIZE: '512MiB', '2GB', '10%%' of the device's memory; 'off' for none", metavar="SIZE"),
    Setting("max_fragmentation", "--gpumem-max-fragmentation", "GPUMEM_MAX_FRAGMENTATION",
            "gpumem_max_fragmentation", parse_fragmentation, None,
            "fail a test whose strategy reserved more GPU memory during it than RATIO x its peak in use + SLACK "
            "(default slack 32MiB): '1.5', '1.25+64MiB'; 'off' for none. The strategy's cache is trimmed before "
            "each such test", metavar="RATIO[+SLACK]"),
    Setting("leaks", "--gpumem-leaks", "GPUMEM_LEAKS", "gpumem_leaks", _choice("fail", "warn", "off"), "off",
            "a test that leaves GPU memory allocated after it ends: fail, warn or off (default)",
            metavar="fail|warn|off"),
    Setting("outside", "--gpumem-outside", "GPUMEM_OUTSIDE", "gpumem_outside", parse_bool, True,
            "read the driver's used GPU memory before and after each measured test, beside the strategy's "
            "count: memory a test holds outside the strategy (PyTorch, Numba, raw cudaMalloc, another CuPy "
            "pool) is reported, and counts as leaked under --gpumem-leaks (default on; off: no reading)",
            metavar="on|off", ini_type="bool"),
    Setting("outside_tolerance", "--gpumem-outside-tolerance", "GPUMEM_OUTSIDE_TOLERANCE",
            "gpumem_outside_tolerance", parse_tolerance, 1 << 30,
            "growth of the driver's used memory that no library the plugin reads explains and that is not a "
            "leak up to SIZE per device: CUDA's own growth (about 0.5 GiB at a first reduction on an H100, modules "
            "loaded, library workspaces) and other processes on the device (default 1GiB)", metavar="SIZE"),
    Setting("driver_sample", "--gpumem-driver-sample", "GPUMEM_DRIVER_SAMPLE", "gpumem_driver_sample",
            parse_interval_ms, 0.0,
            "also read the driver's used GPU memory every MS milliseconds during each measured call, on a "
            "thread of its own, for the driver-level peak (memory outside the strategy freed before the call "
            "ends); 0 (default): only at the call's start and end", metavar="MS", ini_type="int"),
    Setting("budget_reading", "--gpumem-budget-reading", "GPUMEM_BUDGET_READING", "gpumem_budget_reading",
            _choice("strategy", "driver"), "strategy",
            "what a budget judges: strategy (default): the peak in use through the strategy; driver: also the "
            "strategy's peak reserved and the growth of the device's used memory at the end of the call, so "
            "that memory from any library counts", metavar="strategy|driver"),
    Setting("strategy", "--gpumem-strategy", "GPUMEM_STRATEGY", "gpumem_strategy", parse_strategy, None,
            "run the session with this cupy_memstrat strategy as CuPy's allocator, e.g. 'device' "
            "(default: CuPy's own pool; measured through the 'pool' strategy when measuring)",
            metavar="NAME[:KEY=VALUE,...]", env_fallback="CUPY_MEMSTRAT"),
    Setting("faults", "--gpumem-faults", "GPUMEM_FAULTS", "gpumem_faults", parse_bool, False,
            "count unified-memory page faults and migrations per test (driver counters, CUPTI fallback)",
            flag=True, ini_type="bool"),
    Setting("faults_missing", "--gpumem-faults-missing", "GPUMEM_FAULTS_MISSING", "gpumem_faults_missing",
            _choice("skip", "fail"), "skip",
            "a test with limit_page_faults where no page-fault counter exists: skip (default) or fail",
            metavar="skip|fail"),
    Setting("top", "--gpumem-top", "GPUMEM_TOP", "gpumem_top", parse_top, 10,
            "show the N measured tests with the highest peak at the end (0: no table; default 10)", metavar="N",
            ini_type="int"),
    Setting("check", "--gpumem-check", "GPUMEM_CHECK", "gpumem_check", parse_check, frozenset(),
            "run every test under cupy_memstrat's checking layer and fail a test in which a check finds a "
            f"problem: any of {', '.join(cupy_memstrat.checks.CHECKS)} (comma-separated), all, or off "
            "(docs/checks.md)",
            metavar=",".join(cupy_memstrat.checks.CHECKS)),
    Setting("stream_policy", "--gpumem-stream-policy", "GPUMEM_STREAM_POLICY", "gpumem_stream_policy",
            _choice("current", "fresh"), "current",
            "fresh: run each test's call on a new non-blocking current stream, which exposes code that "
            "hard-codes the legacy default stream (reported with --gpumem-check=streams); current: as is",
            metavar="current|fresh"),
    Setting("history", "--gpumem-history", "GPUMEM_HISTORY", "gpumem_history", parse_bool, False,
            "record each measured test's allocations and frees (cupy_memstrat.record_history) and put the "
            "timeline of every test that fails into --gpumem-json (draw one with python -m cupy_memstrat plot)",
            flag=True, ini_type="bool"),
    Setting("history_keep", "--gpumem-history-keep", "GPUMEM_HISTORY_KEEP", "gpumem_history_keep",
            _choice("failing", "all"), "failing",
            "with --gpumem-history: whose timelines go into --gpumem-json: failing (the tests that fail) or all "
            "(every measured test, for python -m cupy_memstrat replay)", metavar="failing|all"),
    Setting("json", "--gpumem-json", "GPUMEM_JSON", "gpumem_json", parse_json_path, None,
            "write every measured test's numbers, with machine and versions, to PATH as JSON", metavar="PATH"),
    Setting("compare", "--gpumem-compare", "GPUMEM_COMPARE", "gpumem_compare", parse_compare, None,
            "compare each measured test's peak and leak with its entry in BASELINE, the --gpumem-json report "
            "of an earlier run, and fail a test that grew by more than --gpumem-max-growth", metavar="BASELINE"),
    Setting("max_growth", "--gpumem-max-growth", "GPUMEM_MAX_GROWTH", "gpumem_max_growth", parse_max_growth,
            None, "with --gpumem-compare: the growth allowed over the baseline, a share of its value ('10%%', "
            "the default) or a size on top of it ('1MiB')", metavar="GROWTH"),
)


def add_options(parser) -> None:
    group = parser.getgroup("gpumem", "GPU memory (cupy-memstrat)")
    for s in SETTINGS:
        env = f" [env {s.env}{', then ' + s.env_fallback if s.env_fallback else ''}, ini {s.ini}]"
        if s.flag:
            group.addoption(s.option, action="store_const", const=True, default=None, dest=s.dest,
                            help=s.help + env)
            group.addoption("--no-" + s.option[2:], action="store_const", const=False, dest=s.dest,
                            help=f"switch {s.option} off (over the environment and the ini file)")
        else:
            group.addoption(s.option, default=None, dest=s.dest, metavar=s.metavar, help=s.help + env)
        # typed, so that pytest 9's native [tool.pytest] table takes `gpumem = true` and `gpumem_top = 5`
        # (the ini file's text and [tool.pytest.ini_options] are converted to the type); unset: None
        parser.addini(s.ini, f"{s.help} (as {s.option})".replace("%%", "%"), type=_ini_type(s.ini_type),
                      default=None)


def _ini_type(name: str):
    """pytest's ini type for a setting of type ``name``.

    From pytest 9.2, ``str | bool`` (``str | int``): an ini file's text stays text, read by this
    plugin's own parser (``gpumem_top = 1_000`` refused as on the command line), and TOML's
    native ``[tool.pytest]`` table takes ``gpumem = true``. Before 9.2, ``name`` itself (pytest
    converts the text), or "string" on a pytest without ``int`` (before 8.4)."""
    version = tuple(pytest.version_tuple[:2])
    if name != "string" and version >= (9, 2):
        return str | (bool if name == "bool" else int)
    if name == "int" and version < (8, 4):
        return "string"
    return name


@dataclass
class Settings:
    """Resolved session settings: each value with the place it came from."""

    values: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    texts: dict = field(default_factory=dict)  # each given value as the user wrote it

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def source(self, name: str) -> str | None:
        return self.sources.get(name)

    def text(self, name: str) -> str | None:
        """The value of ``name`` as the user wrote it (``"200MB"``), or None
        for a default."""
        return self.texts.get(name)

    @property
    def checks_asked(self) -> frozenset:
        """The checks asked for the session: ``--gpumem-check`` (its variable, its ini key) or a
        ``check=`` in the strategy spec (``--gpumem-strategy``, ``GPUMEM_STRATEGY``,
        ``CUPY_MEMSTRAT``, its ini key). A ``--gpumem-check`` given anywhere decides:
        ``--gpumem-check=off`` switches off the checks of the strategy spec too."""
        if self.source("check") is not None:
            return self.check
        return self.values.get("spec_check") or self.values.get("adopted_check") or frozenset()

    @property
    def measuring(self) -> bool:
        """Whether every test (not only marked ones) is measured: any limit or check asked for the
        session (checks in the strategy spec too: their findings are judged per test)."""
        return bool(
            self.measure or self.budget is not None or self.leaks != "off" or self.faults or self.checks_asked
            or self.max_fragmentation is not None
            or self.stream_policy != "current" or self.history or self.compare
        )


def resolve(config, environ=None) -> Settings:
    """Read every setting (command line > environment > ini > default; for
    the strategy, ``GPUMEM_STRATEGY`` before ``CUPY_MEMSTRAT``).

    Raises:
        pytest.UsageError: a bad value; the message names its source.
    """
    environ = os.environ if environ is None else environ
    out = Settings()
    for s in SETTINGS:
        cli = config.getoption(s.dest)
        if cli is not None:
            if s.flag:
                out.values[s.name], out.sources[s.name] = cli, s.option if cli else "--no-" + s.option[2:]
                continue
            raw, label, src = cli, f"{s.option}={cli!r}", s.option
        elif environ.get(s.env, "").strip():
            raw = environ[s.env]
            label, src = f"environment variable {s.env}={raw!r}", f"environment variable {s.env}"
        elif s.env_fallback and environ.get(s.env_fallback, "").strip():
            raw = environ[s.env_fallback]
            label = f"environment variable {s.env_fallback}={raw!r}"
            src = f"environment variable {s.env_fallback}"
        elif (ini := _ini_value(config, s)) is not None:
            raw = ini
            label, src = f"ini key {s.ini}={raw!r}", f"ini key {s.ini}"
        else:
            out.values[s.name], out.sources[s.name] = s.default, None
            continue
        if not raw.strip():  # an empty command-line value: the default, over the environment and ini
            out.values[s.name], out.sources[s.name] = s.default, src
            continue
        try:
            out.values[s.name] = s.parse(raw)
        except (ValueError, TypeError) as exc:
            raise pytest.UsageError(f"{label}: {exc}") from None
        out.sources[s.name], out.texts[s.name] = src, raw.strip()
    out.values["spec_check"] = _spec_checks(out.values["strategy"])  # checked above: no error here
    return out


def _ini_value(config, s: Setting) -> str | None:
    """The ini key's value as text (``True`` -> ``"true"``, ``5`` -> ``"5"``), or None where it is
    unset or empty.

    Raises:
        pytest.UsageError: pytest cannot read it as its type (``gpumem_top = many``).
    """
    try:
        value = config.getini(s.ini)
    except (ValueError, TypeError, pytest.UsageError) as exc:  # pytest 9 raises UsageError for some
        # pytest's message names the value ("invalid truth value 'maybe'"): said as for the other sources
        found = re.search(r"(?:invalid truth value|invalid literal for int\(\) with base 10:|, got \w+:) (.*)$",
                          str(exc))
        where = f"ini key {s.ini}={found.group(1)}" if found else f"ini key {s.ini}: {exc}"
        raise pytest.UsageError(f"{where}: expected {_INI_WORDS[s.ini_type]}") from None
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return text if text.strip() else None


_INI_WORDS = {"string": "a string (in quotes in TOML)", "bool": f"one of {', '.join(_TRUE + _FALSE)}",
              "int": "a whole number of tests >= 0 (ASCII digits)"}


def _spec_checks(spec: str | None) -> frozenset:
    """The checks a strategy spec turns on (``"async:check=all"``), or an empty set."""
    if not spec:
        return frozenset()
    _, parsed = cupy_memstrat.validate(spec)
    return frozenset(parsed.get("check") or ())


# -- markers -------------------------------------------------------------------------

#: The markers' lines for ``pytest --markers`` (each limit's, then gpumem_skip).
MARKERS = MARKER_HELP


@dataclass
class Plan:
    """What the plugin does for one test."""

    budget: Any = None  # None, bytes, or "N%"
    budget_text: str | None = None  # the size as the user wrote it ("200MB"), or None
    budget_source: str | None = None
    budget_reading: str = "strategy"  # strategy | driver (--gpumem-budget-reading)
    leaks: str = "off"  # off | warn | fail
    outside_tolerance: int = 1 << 30  # bytes (--gpumem-outside-tolerance)
    leak_limit: int = 0
    leak_source: str | None = None
    faults: bool = False  # count page faults
    fault_limits: dict | None = None  # {"gpu": int, "cpu": int, "migrated": int} (given ones only)
    fault_source: str | None = None
    fragmentation: tuple | None = None  # (ratio, slack bytes), or None
    fragmentation_source: str | None = None


def plan_for(item, settings: Settings) -> Plan | None:
    """The plan for ``item``, or None if nothing is measured for it. The
    closest marker of each kind applies (a function's over its class's over
    its module's).

    Raises:
        pytest.UsageError: a bad marker (names the marker and the test); every
        bad marker of the test is named, one per line (:func:`marker_errors`).
    """
    errors = marker_errors(item)
    if errors:
        raise pytest.UsageError("\n".join(errors))
    if item.get_closest_marker("gpumem_skip") is not None:
        return None
    plan = Plan(
        budget=settings.budget,
        budget_text=settings.text("budget"),
        budget_source=settings.source("budget"),
        budget_reading=settings.budget_reading,
        leaks=settings.leaks,
        outside_tolerance=settings.outside_tolerance,
        leak_source=settings.source("leaks"),
        faults=settings.faults,
        fragmentation=settings.max_fragmentation,
        fragmentation_source=settings.source("max_fragmentation"),
    )
    marked = False
    for unit in LIMITS:  # each limit's closest marker replaces the settings' limit
        m = item.get_closest_marker(unit.marker) if unit.marker else None
        if m is not None:
            marked = True
            unit.apply(plan, m)
    if not (marked or settings.measuring):
        return None
    return plan
