"""The checking layer's options, declared once: the checks, the finding
policies, each option's name, parser, default and help, and the check each
option applies to. :class:`~cupy_memstrat.checks.CheckedStrategy` takes its
``options`` from here and :mod:`cupy_memstrat.api` takes the names it
separates from a strategy's own options (docs/checks.md describes them).
"""

from __future__ import annotations

from ..options import Option, as_int, as_size

__all__ = [
    "CHECKS",
    "POLICIES",
    "ALIGN",
    "OPTIONS",
    "OPTION_NAMES",
    "OPTION_CHECK",
    "parse_checks",
    "refuse_options_of_checks_off",
]

#: the checks, in the order they are reported
CHECKS = ("streams", "poison", "redzone")
#: what a finding does (``on_finding``); the first is the default
POLICIES = ("raise", "warn", "record")
#: CuPy expects blocks aligned to 256 bytes; the red zone keeps sizes multiples of it
ALIGN = 256

_OFF = ("off", "none", "no", "false")


def parse_checks(value) -> frozenset:
    """The set of checks named by ``value``.

    Accepts ``"streams,poison,redzone"`` (``+``, ``|`` or spaces also
    separate), ``"all"``, ``""`` / ``"off"`` / ``"none"`` / ``None`` (no
    checks), or an iterable of names.

    Raises:
        ValueError: an unknown check name (the message lists the valid ones).
        TypeError: ``value`` is neither a str nor an iterable of str.
    """
    if value is None or value is False:
        return frozenset()
    if isinstance(value, str):
        raw = value.replace("+", ",").replace("|", ",").replace(" ", ",")
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    else:
        if isinstance(value, dict) or not hasattr(value, "__iter__"):
            raise TypeError(
                f"check: expected a str such as 'streams,poison,redzone' or a list of names, "
                f"got {type(value).__name__} {value!r}"
            )
        try:
            names = list(value)
        except TypeError:
            raise TypeError(
                f"check: expected a str such as 'streams,poison,redzone' or a list of names, "
                f"got {type(value).__name__} {value!r}"
            ) from None
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"check: expected check names (str), got {value!r}")
        names = [n.strip().lower() for n in names]
    if names in (["off"], ["none"], ["no"], ["false"]):
        return frozenset()
    if "all" in names:
        names = [n for n in names if n != "all"] + list(CHECKS)
    if any(n in _OFF for n in names):
        raise ValueError(f"check: 'off' stands alone (no checks), not with others, got {value!r}")
    bad = [n for n in names if n not in CHECKS]
    if bad:
        raise ValueError(f"check: unknown check {bad[0]!r} in {value!r}; valid: {', '.join(CHECKS)}, all or off")
    return frozenset(names)


def _as_checks(value, what: str) -> frozenset:
    try:
        return parse_checks(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: {str(exc).removeprefix('check: ')}") from None


def _as_policy(value, what: str) -> str:
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in POLICIES:
        raise ValueError(f"{what}: expected 'raise', 'warn' or 'record', got {value!r}")
    return v


def _as_count(value, what: str) -> int:
    n = as_int(value, what)
    if n < 0:
        raise ValueError(f"{what}: expected a count >= 0, got {value!r}")
    return n


def _as_redzone(value, what: str) -> int:
    n = as_size(value, what)
    if isinstance(n, str):
        raise ValueError(f"{what}: expected bytes, not a percentage, got {value!r}")
    if n <= 0:
        raise ValueError(f"{what}: expected bytes > 0, got {value!r}")
    return -(-n // ALIGN) * ALIGN


def _as_quarantine_bytes(value, what: str) -> int:
    n = as_size(value, what)
    if isinstance(n, str):
        raise ValueError(f"{what}: expected bytes, not a percentage, got {value!r}")
    return n


#: the checking layer's options (accepted with every strategy, by name or in a spec)
OPTIONS = (
    Option("check", _as_checks, frozenset(CHECKS), "checks to run: streams, poison, redzone (or all)"),
    Option("on_finding", _as_policy, POLICIES[0], "what a finding does: raise, warn or record"),
    Option("quarantine_bytes", _as_quarantine_bytes, 256 << 20, "bytes of freed blocks held poisoned"),
    Option("quarantine_count", _as_count, 4096, "freed blocks held poisoned, at most"),
    Option("redzone_bytes", _as_redzone, 256, "guard bytes after each allocation (rounded up to 256)"),
)
#: their names, in that order
OPTION_NAMES = tuple(o.name for o in OPTIONS)
#: option -> the check it applies to (an option absent here applies to every check)
OPTION_CHECK = {"quarantine_bytes": "poison", "quarantine_count": "poison", "redzone_bytes": "redzone"}


def refuse_options_of_checks_off(checks, given) -> None:
    """Refuse options given for a check that is off.

    Raises:
        ValueError: e.g. ``redzone_bytes`` without the ``redzone`` check.
    """
    needs = OPTION_CHECK
    for opt in sorted(set(given) & set(needs)):
        if needs[opt] not in checks:
            shown = ",".join(c for c in CHECKS if c in checks)
            raise ValueError(
                f"option {opt!r} applies to the {needs[opt]} check, which is not on (check={shown}); "
                f"add {needs[opt]} to check= or leave {opt} out"
            )
