"""Byte sizes: parsing ``"512MiB"``, ``"1.5GB"``, ``"80%"`` and printing IEC units.

Units: ``B``; decimal ``kB``/``KB``, ``MB``, ``GB``, ``TB`` (powers of 10**3);
binary ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 2**10). Unit names are
matched case-insensitively, so ``"2gib"`` is 2 GiB and ``"2gb"`` is 2 GB.
A percentage (``"80%"``) is a share of a total the caller supplies, normally
the device's memory.
"""

from __future__ import annotations

import math
import operator
import re

__all__ = ["parse_size", "format_size", "format_count"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*([A-Za-z]*)\s*$")
_MAX = 2**64  # no device has more; larger values are typos
_PCT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_size(value, *, total: int | None = None, what: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Args:
        value: an ``int`` (bytes), or a string such as ``"512MiB"``, ``"2 GiB"``,
            ``"1.5GB"``, ``"4096"`` or ``"80%"``.
        total: bytes that a percentage refers to (usually the device's total
            memory); required when ``value`` is a percentage.
        what: the name used in error messages (an option name, say).

    Returns:
        int: bytes, >= 0. Fractional byte counts are rounded down.

    Raises:
        TypeError: ``value`` is neither an int nor a str (``bool`` and
            ``float`` are refused: say ``"1.5GB"``), or ``total`` is not an int.
        ValueError: the string cannot be parsed, the unit is unknown, the
            number is negative, or a percentage is given without ``total`` or
            is above 100%.
    """
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
        raise TypeError(f"total: expected an int number of bytes or None, got {type(total).__name__} {total!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        if hasattr(value, "__index__") and not isinstance(value, bool):
            try:
                value = operator.index(value)
            except TypeError:  # a numpy array of several values, say
                raise TypeError(f"{what}: expected an int number of bytes or a size string such as '512MiB', "
                                f"got {type(value).__name__} {value!r}") from None
        else:
            raise TypeError(
                f"{what}: expected an int number of bytes or a size string such as "
                f"'512MiB', got {type(value).__name__} {value!r}"
            )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: expected a size >= 0 bytes, got {value}")
        if value >= _MAX:
            raise ValueError(f"{what}: {value} bytes does not fit in 64 bits "
                             "(16 EiB and more: no device has that much)")
        return value
    if value.strip().startswith("-"):
        raise ValueError(f"{what}: expected a size >= 0 bytes, got {value!r}")
    if len(value) > 100:
        raise ValueError(f"{what}: cannot parse a {len(value)}-character string as a size")
    m = _PCT_RE.match(value)
    if m:
        pct = float(m.group(1))
        if total is None or total < 0:
            raise ValueError(
                f"{what}: a percentage ({value!r}) needs the device's total memory; "
                "give a size in bytes or units instead"
            )
        if pct > 100:
            raise ValueError(f"{what}: expected a percentage between 0% and 100%, got {value!r}")
        return int(total * pct / 100)
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(
            f"{what}: cannot parse {value!r} as a size; expected a number with an optional "
            "unit, e.g. '512MiB', '2 GiB', '1.5GB', '4096', or a percentage such as '80%'"
        )
    number, exponent, unit = m.group(1), m.group(2), m.group(3).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"{what}: unknown unit {m.group(3)!r} in {value!r}; expected one of "
            "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    if exponent is None and number.isdigit():
        nbytes = int(number) * _UNITS[unit]  # exact for large integers
    else:
        f = float(number + (exponent or "")) * _UNITS[unit]
        if not math.isfinite(f):
            raise ValueError(f"{what}: {value!r} is not a finite size")
        nbytes = int(f)
    if nbytes >= _MAX:
        raise ValueError(f"{what}: {value!r} does not fit in 64 bits (16 EiB and more: no device has that much)")
    return nbytes


def format_size(nbytes: int) -> str:
    """Format a byte count in IEC units with one decimal: ``812.0 MiB``, ``512 B``.

    Raises:
        TypeError: ``nbytes`` is not an int (``bool`` included: ``True`` is no size).
    """
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(f"nbytes: expected an int number of bytes, got {type(nbytes).__name__} {nbytes!r}")
    n = operator.index(nbytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024.0
        if n < 1024 or unit == "EiB":
            return f"{sign}{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``1 allocation``, ``3 allocations``.

    Raises:
        TypeError: ``n`` is not an int (``bool`` included) or ``noun`` not a str.
    """
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"n: expected an int count, got {type(n).__name__} {n!r}")
    if not isinstance(noun, str):
        raise TypeError(f"noun: expected a str, got {type(noun).__name__} {noun!r}")
    n = operator.index(n)
    return f"{n} {noun}" + ("" if n == 1 else "s")
