"""The error every page-fault counter source raises when it cannot open."""

from __future__ import annotations

from ..errors import FaultCountersUnavailable


def unavailable(source: str, reason: str) -> FaultCountersUnavailable:
    """The :class:`~cupy_memstrat.errors.FaultCountersUnavailable` for one
    source: the message names the source and the reason; ``reasons`` is
    ``{source: reason}``."""
    return FaultCountersUnavailable(
        f"page-fault counter source {source!r} is unavailable: {reason}", {source: reason}
    )
