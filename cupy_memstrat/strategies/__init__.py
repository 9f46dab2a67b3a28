"""The built-in strategies. This module is the ``builtin`` plugin of the
``cupy_memstrat`` entry-point group: it registers them through the same hook a
third-party package implements."""

from ..hookspecs import hookimpl
from .base import Strategy
from .device import DeviceStrategy

__all__ = ["Strategy", "DeviceStrategy"]


@hookimpl
def memstrat_register_strategies(registry):
    registry.add(DeviceStrategy)
