"""Strategy specs (``"async:release_threshold=4GiB"``) and option declarations.

A spec is ``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]``. An item without ``=``
continues the previous value (``device:check=streams,poison``). Values in a spec are
strings; each option's parser turns a string or a native Python value into the
same thing, so ``use("async:release_threshold=4GiB")`` and
``use("async", release_threshold="4GiB")`` mean the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .sizes import parse_size

__all__ = ["Option", "parse_spec", "as_bool", "as_size", "as_int", "as_frames", "as_output_file"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"NAME:KEY=VALUE,..."`` into ``(name, {key: value})``.

    Raises:
        TypeError: ``spec`` is not a str.
        ValueError: empty name, an item without ``=``, an empty key, or a key
            given twice; the message quotes the spec.
    """
    if not isinstance(spec, str):
        raise TypeError(f"strategy: expected a name such as 'device', got {type(spec).__name__} {spec!r}")
    if len(spec) > 1000:
        raise ValueError(f"strategy spec: {len(spec)} characters is too long to be a strategy spec")
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"strategy spec {spec!r}: expected NAME or NAME:KEY=VALUE,... with a name")
    options: dict[str, str] = {}
    if sep and rest.strip():
        last = None
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq and last is not None and key:
                # a value that itself has commas: check=streams,poison
                options[last] += "," + item.strip()
                continue
            if not eq or not key:
                raise ValueError(
                    f"strategy spec {spec!r}: expected KEY=VALUE after ':', got {item.strip()!r}"
                )
            if key in options:
                raise ValueError(f"strategy spec {spec!r}: option {key!r} is given twice")
            options[key] = value.strip()
            last = key
    return name, options


def as_bool(value, what: str) -> bool:
    """``True``/``False``, 1/0, or the strings 1/0, true/false, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{what}: expected true or false, got {value!r}")


def as_frames(value, what: str, most: int = 128):
    """``track_origins``: ``False`` (off), ``True`` or 1 (the first frame
    outside CuPy and cupy_memstrat), or N frames from 2 to ``most``: an int
    or a string (true/false, yes/no, on/off, or ASCII digits). 0 is refused,
    not taken as off: ``False`` says that."""
    expected = f"expected true or false, or a number of frames from 1 to {most}"
    if isinstance(value, bool):
        return value
    if type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy":  # numpy.bool
        return bool(value)
    if isinstance(value, str):
        t = value.strip().lower()
        if t in _TRUE - {"1"} or t in _FALSE - {"0"}:
            return t in _TRUE
        if not (t.isascii() and t.isdigit()):
            raise ValueError(f"{what}: {expected}, got {value!r}")
        if len(t.lstrip("0")) > 6:  # (int() of thousands of digits refuses on its own, unnamed)
            shown = value if len(value) <= 40 else value[:20] + "..."
            raise ValueError(f"{what}: {expected}, got {shown!r}")
        value = int(t)
    elif hasattr(value, "__index__") and not isinstance(value, float):
        value = value.__index__()
    else:
        raise ValueError(f"{what}: {expected}, got {type(value).__name__} {value!r}")
    if not 1 <= value <= most:
        off = " (False turns it off)" if value == 0 else ""
        raise ValueError(f"{what}: {expected}, got {value}{off}")
    return True if value == 1 else value


def as_output_file(value, what: str):
    """A file to write later (``None``: none): a str or os.PathLike, checked
    now as :func:`cupy_memstrat.paths.check_writable_file` checks it (not a
    directory, a FIFO or a device; its folder exists), and kept as an
    absolute path. Nothing is written."""
    import os

    from .paths import check_writable_file

    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{what}: expected a file path, got {type(value).__name__} {value!r}")
    path = os.fspath(value)
    if isinstance(path, bytes) or not path.strip():
        raise ValueError(f"{what}: expected a file path, got {value!r}")
    try:
        check_writable_file(path, what)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return os.path.abspath(path)  # as the folder was checked: a later chdir does not move it


def as_int(value, what: str) -> int:
    """An int, or a string of one."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected an integer, got bool {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        t = value.strip()
        body = t[1:] if t[:1] == "-" else t
        if body.isascii() and body.isdigit():  # int() would take "1_000", "+5" and other scripts' digits
            return int(t)
    raise ValueError(f"{what}: expected an integer (ASCII digits), got {value!r}")


def as_size(value, what: str) -> int | str:
    """Bytes (int or size string). A percentage is kept as the string and
    resolved against the device's memory by the strategy."""
    if isinstance(value, str) and value.strip().endswith("%"):
        parse_size(value, total=100, what=what)  # validate the form now
        return value.strip()
    return parse_size(value, what=what)


@dataclass(frozen=True)
class Option:
    """One strategy option: ``parse(value, what) -> value`` validates and
    converts; ``default`` is used when the option is not given."""

    name: str
    parse: Callable[[Any, str], Any]
    default: Any
    doc: str
