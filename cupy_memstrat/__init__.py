"""cupy_memstrat: drop-in GPU memory strategies for CuPy::

    import cupy_memstrat
    cupy_memstrat.use("device")          # CuPy now allocates with cudaMalloc/cudaFree
    cupy_memstrat.use("async")           # or: a stream-ordered pool of its own
    cupy_memstrat.use("managed")         # or: managed memory in 2 MiB chunks
    cupy_memstrat.prefetch(x)            # move a managed array to the GPU ahead of use
    cupy_memstrat.record_stream(x, s)    # stream s also uses x: its block waits for s when freed
    with cupy_memstrat.faults.count() as c:   # exact page-fault counters
        ...
    cupy_memstrat.use("pool", check="all")   # catch stream races, writes after free, overruns
    print(cupy_memstrat.stats())          # bytes in use, peak, reserved, counts
    for a in cupy_memstrat.live_allocations():
        print(a)

Importing this package does not import CuPy or touch the GPU.
"""

from . import checks, faults
from .api import (
    advise,
    available,
    Install,
    create,
    current,
    install_mark,
    installs,
    live_allocations,
    prefetch,
    record_stream,
    reset_peak,
    stats,
    trim,
    use,
    use_from_env,
    using,
    validate,
)
from .errors import (
    CuPyNotInstalledError,
    FaultCountersUnavailable,
    InvalidFreeWarning,
    ManagedMemoryWarning,
    MemstratError,
    NoDeviceError,
    NoStrategyError,
)
from .history import record_history, snapshot
from .hookspecs import hookimpl
from .options import parse_spec
from .sizes import format_size, parse_size
from .stats import Allocation, Origin, Stats
from .strategies.base import hot_path_status
from .strategies import (AsyncPoolStrategy, CuPyPoolStrategy, DeviceStrategy, ManagedStats, ManagedStrategy, PoolStats,
                         Strategy)

__version__ = "0.1.0"

__all__ = [
    "use",
    "use_from_env",
    "using",
    "create",
    "validate",
    "current",
    "installs",
    "install_mark",
    "Install",
    "available",
    "stats",
    "reset_peak",
    "live_allocations",
    "trim",
    "prefetch",
    "advise",
    "record_stream",
    "Strategy",
    "DeviceStrategy",
    "CuPyPoolStrategy",
    "AsyncPoolStrategy",
    "PoolStats",
    "ManagedStrategy",
    "ManagedStats",
    "Stats",
    "Allocation",
    "Origin",
    "parse_size",
    "format_size",
    "parse_spec",
    "hot_path_status",
    "record_history",
    "snapshot",
    "checks",
    "hookimpl",
    "MemstratError",
    "NoDeviceError",
    "NoStrategyError",
    "CuPyNotInstalledError",
    "InvalidFreeWarning",
    "FaultCountersUnavailable",
    "faults",
    "ManagedMemoryWarning",
    "OutOfMemoryError",
]


def __getattr__(name):
    if name == "OutOfMemoryError":  # subclass of CuPy's; built on first use
        from .errors import out_of_memory_class

        return out_of_memory_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
