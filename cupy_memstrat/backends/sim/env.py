"""``CUPY_MEMSTRAT_BACKEND=fake[:options]``: the fake that the variable asks for."""

from __future__ import annotations

import os

from ..protocols import BACKEND_ENV, ENV_VALUES
from .fake import FakeBackend


def backend_from_env(value: str | None = None) -> FakeBackend:
    """The :class:`FakeBackend` that a ``CUPY_MEMSTRAT_BACKEND`` value asks
    for (``value`` None: the variable's): ``fake``, the fake's defaults, or
    ``fake:devices=2,memory=1GiB,name=NAME,nvml=off`` (``devices`` from 1 to 64, ASCII
    digits; ``memory`` one size for every device or ``memory=1GiB/2GiB`` one
    per device, which also sets ``devices``; ``nvml`` ``on`` (the default) or ``off``:
    whether NVML counts this process's memory, :meth:`FakeBackend.process_used`). Case and spaces around the parts
    do not matter. :func:`cupy_memstrat.backends.get_backend` makes the process's
    backend with it.

    Raises:
        ValueError: a value that is not ``fake[:options]``, or a bad option;
            the message names the variable and the valid values.
    """
    raw = os.environ.get(BACKEND_ENV, "") if value is None else value
    if not isinstance(raw, str):
        raise TypeError(f"value: expected a str such as 'fake:devices=2', got {type(raw).__name__} {raw!r}")
    kind, _, opts = raw.strip().partition(":")
    if kind.strip().lower() != "fake":
        raise ValueError(f"environment variable {BACKEND_ENV}={raw!r}: not the simulated GPU; expected 'fake' or "
                         "'fake:devices=N,memory=SIZE[/SIZE...],name=NAME,nvml=on|off'")
    kwargs = {}
    for part in filter(None, (p.strip() for p in opts.split(","))):
        key, eq, val = (x.strip() for x in part.partition("="))
        key = key.lower()
        if not eq or not val:
            raise ValueError(
                f"environment variable {BACKEND_ENV}={raw!r}: expected key=value, got {part!r}; {ENV_VALUES}"
            )
        if key in kwargs:
            raise ValueError(f"environment variable {BACKEND_ENV}={raw!r}: option {key!r} is given twice")
        if key == "devices":
            if not (val.isascii() and val.isdigit()):  # int() would also take "٣" or "1_0"
                raise ValueError(
                    f"environment variable {BACKEND_ENV}={raw!r}: devices: expected an int from 1 to 64, got {val!r}"
                )
            kwargs["devices"] = int(val)
        elif key == "memory":
            kwargs["memory"] = val.split("/") if "/" in val else val
        elif key == "name":
            kwargs["name"] = val
        elif key == "nvml":
            if val.lower() not in ("on", "off"):
                raise ValueError(
                    f"environment variable {BACKEND_ENV}={raw!r}: nvml: expected 'on' or 'off', got {val!r}"
                )
            kwargs["nvml"] = val.lower() == "on"
        else:
            raise ValueError(
                f"environment variable {BACKEND_ENV}={raw!r}: unknown option {key!r}; "
                "valid options: devices, memory, name, nvml"
            )
    if isinstance(kwargs.get("memory"), list):
        kwargs.setdefault("devices", len(kwargs["memory"]))
    try:
        return FakeBackend(**kwargs)
    except ValueError as exc:
        raise ValueError(f"environment variable {BACKEND_ENV}={raw!r}: {exc}") from None
