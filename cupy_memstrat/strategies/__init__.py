"""The built-in strategies. This module is the ``builtin`` plugin of the
``cupy_memstrat`` entry-point group: it registers them through the same hook a
third-party package implements."""

from ..hookspecs import hookimpl
from .async_pool import AsyncPoolStrategy, PoolStats
from .base import Strategy
from .cupy_pool import CuPyPoolStrategy
from .device import DeviceStrategy
from .expandable import ExpandableStrategy
from .managed import ManagedStats, ManagedStrategy
from .rmm_adapter import RMMStrategy
from .torch_adapter import TorchStrategy

__all__ = ["Strategy", "CuPyPoolStrategy", "DeviceStrategy", "AsyncPoolStrategy", "PoolStats", "ManagedStrategy",
           "ManagedStats", "ExpandableStrategy", "RMMStrategy", "TorchStrategy"]


@hookimpl
def memstrat_register_strategies(registry):
    registry.add(DeviceStrategy)
    registry.add(AsyncPoolStrategy)
    registry.add(ManagedStrategy)
    registry.add(CuPyPoolStrategy)
    registry.add(ExpandableStrategy)
    registry.add(RMMStrategy)
    registry.add(TorchStrategy)
