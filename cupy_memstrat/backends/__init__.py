"""The one seam between cupy_memstrat and CUDA.

Strategies, the checking layer and the fault counters never call CUDA
themselves: they call a *backend* object. This package holds the seam whole:

* :mod:`~cupy_memstrat.backends.protocols`: what a backend is, one
  :class:`typing.Protocol` per capability (units, errors, the CUDA call behind
  each method);
* :mod:`~cupy_memstrat.backends.codes`: CUDA's error codes and enum values;
* :mod:`~cupy_memstrat.backends.cuda`: :class:`RealBackend`, CUDA through CuPy
  and ``cuda.bindings``;
* :mod:`~cupy_memstrat.backends.sim`: the simulated GPU,
  :class:`cupy_memstrat.testing.FakeBackend`, for machines without one;
* this module: :func:`get_backend`, the process's backend, chosen here and
  nowhere else from the environment variable ``CUPY_MEMSTRAT_BACKEND``
  (:func:`from_env`).

Its modules import one another downwards only (``codes`` and ``protocols`` at
the bottom, ``cuda`` and ``sim`` on them, this module on top); nothing in the
package imports the rest of cupy_memstrat beyond its errors and sizes.
"""

from __future__ import annotations

import os
import threading

from .codes import *  # noqa: F403 - CUDA's numbers, one name each, as cupy_memstrat.backends.ERROR_*
from .codes import __all__ as _codes_all
from .cuda import CheckKernels, RealBackend, kernel_source
from .protocols import (
    BACKEND_ENV,
    ENV_VALUES,
    PROTOCOLS,
    Backend,
    CheckBackend,
    CoreBackend,
    DeviceBackend,
    ManagedBackend,
    PoolBackend,
    StreamBackend,
    VerifyKernels,
    VmmBackend,
    members,
    missing,
    require,
)

__all__ = [
    *_codes_all,
    "BACKEND_ENV",
    "ENV_VALUES",
    "Backend",
    "CheckBackend",
    "CheckKernels",
    "CoreBackend",
    "DeviceBackend",
    "ManagedBackend",
    "PROTOCOLS",
    "PoolBackend",
    "RealBackend",
    "StreamBackend",
    "VerifyKernels",
    "VmmBackend",
    "from_env",
    "get_backend",
    "kernel_source",
    "members",
    "missing",
    "require",
]

def from_env():
    """The backend ``CUPY_MEMSTRAT_BACKEND`` asks for, or None for the real
    one (unset, empty, ``cuda`` or ``real``). ``fake[:options]`` is a
    :class:`cupy_memstrat.testing.FakeBackend`, its options parsed by
    :func:`cupy_memstrat.testing.backend_from_env`.

    Raises:
        ValueError: another value, or bad options (the message names the
            variable and the valid values).
    """
    raw = os.environ.get(BACKEND_ENV, "")
    value = raw.strip()
    if value.lower() in ("", "cuda", "real"):
        return None
    if value.partition(":")[0].strip().lower() != "fake":
        raise ValueError(f"environment variable {BACKEND_ENV}={raw!r}: unknown backend; expected {ENV_VALUES}")
    from .sim import backend_from_env  # the simulator parses its own options

    return backend_from_env(raw)


_backend = None
_backend_lock = threading.Lock()


def get_backend():
    """The process's backend, created on first call: the :class:`RealBackend`,
    or a :class:`cupy_memstrat.testing.FakeBackend` when the environment
    variable ``CUPY_MEMSTRAT_BACKEND`` says so.

    ``CUPY_MEMSTRAT_BACKEND``:

    * unset, empty or ``cuda``: the real backend;
    * ``fake``: one process-wide simulated device (the fake's defaults);
    * ``fake:devices=2,memory=1GiB``: with options (``devices`` from 1 to
      64, ASCII digits); ``memory`` is one size for
      every device or ``memory=1GiB/2GiB`` one per device, and ``name`` sets
      the device name. For running code, and the pytest plugin, on a machine
      without a GPU (CI); arrays can be made but kernels cannot run.

    Raises:
        CuPyNotInstalledError, NoDeviceError: as :class:`RealBackend`. A failed
        attempt is not cached: a later call tries again.
        ValueError: ``CUPY_MEMSTRAT_BACKEND`` has a value not described above
            (the message names the variable and the valid values).

    The variable is read by :func:`from_env`, a fake's
    options by :func:`cupy_memstrat.testing.backend_from_env`.
    """
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = from_env() or RealBackend()
    return _backend
