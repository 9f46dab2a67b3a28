"""What the strategies' own hot paths share, written once: the hot-path
choice (C or Python), the accounting rule, and the size check of the
allocation entry points (:func:`check_size`, public as
``cupy_memstrat.strategies.base.check_size``).

This is an internal module of :mod:`cupy_memstrat.strategies` (and of the
checking layer, which wraps a strategy's hot path). A third-party strategy
needs none of it: it provides the public hooks :meth:`Strategy.allocate`
and :meth:`Strategy.deallocate` (and calls :meth:`Strategy.record_reserved`
if it caches), and the base class builds the hot path
(docs/strategies.md, "Writing a strategy").

The accounting rule
-------------------
Every hot path, the base class's and the ones that ``async``, ``managed``
and the checking layer inline for speed, keeps the counts the same way, so
that ``peak_bytes_in_use`` is the exact peak of the sequence of allocations
and frees, with many threads and no lock:

* an allocation appends ``+size`` to ``events[device]`` *before* it inserts
  the pointer into ``live[device]`` (so that the matching ``-size`` can only
  follow it), and folds the device's events once more than :data:`FOLD_AT`
  are queued;
* a free pops the pointer from ``live[device]`` *then* appends ``-size``;
* in C, an ``Accounting`` made by ``Strategy._new_accounting`` does the same
  with C integers, drained by ``Accounts.fold`` (``strategies/accounts.py``).

Each inlined copy says so where it appends; this is the one place the rule
is written.

Why the copies are inlined, and where they are
----------------------------------------------
A Python function call per allocation and per free would cost more than the
rule itself (the hot path is timed against CuPy's pool in docs/benchmarks.md),
so each copy writes the rule out inside its own closures: the base class's
Python hot path (``strategies/base.py``), ``async`` and ``managed``
(``strategies/async_pool.py``, ``strategies/managed/strategy.py``), the checking layer
(``checks/layer.py``), and the C hot path (``csrc/hotpath.c``), whose modes
share its type slots and clean-up code. A duplicate finder lists these
``malloc``/``free`` closures as repeats of each other: they are these copies,
kept on purpose. A change to the rule changes every copy;
``tests/test_strategy_contract.py`` runs the same tests on every strategy of
``cupy_memstrat.available()``, and ``tests/test_checks.py`` checks the
layer's counts.
"""

from __future__ import annotations

import importlib
import operator
import os

__all__ = ["FOLD_AT", "SIZE_T_LIMIT", "HOT_PATH_ENV", "C_MISSING", "c_hotpath", "c_accounting", "check_size",
           "hot_path_status"]

try:
    c_hotpath = importlib.import_module("cupy_memstrat._hotpath")
    C_MISSING = ""
except ImportError as _exc:  # installed without a C compiler, or run from a source tree
    c_hotpath = None
    C_MISSING = (
        f"the C hot path (cupy_memstrat._hotpath) is not built ({_exc}); reinstall cupy-memstrat "
        "on a machine with a C compiler and the Python headers"
    )

#: the environment variable that chooses the hot path: auto (default), c, python
HOT_PATH_ENV = "CUPY_MEMSTRAT_HOT_PATH"
_HOT_PATH_CHOICES = ("auto", "c", "python")
#: events queued per device before an allocation folds them into the counters
FOLD_AT = 1 << 16
#: sizes and pointers are ``size_t``: below 2**64
SIZE_T_LIMIT = 1 << 64


def check_size(size) -> int:
    """Validate an allocation size: an int (or ``__index__`` object) >= 0.

    Raises:
        TypeError: ``size`` is not an integer (``bool`` and ``float`` included).
        ValueError: ``size`` is negative or does not fit in ``size_t``.
    """
    if type(size) is not int:
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise TypeError(
                f"size: expected an int number of bytes, got {type(size).__name__} {size!r}"
            )
        size = int(operator.index(size))  # a plain int: an int subclass could redefine arithmetic
    if size < 0:
        raise ValueError(f"size: expected a number of bytes >= 0, got {size}")
    if size >= SIZE_T_LIMIT:
        raise ValueError(f"size: {size} bytes does not fit in size_t (at most 2**64 - 1)")
    return size


def hot_path_status() -> dict:
    """Which allocation hot path new strategies get: ``{"setting": ...,
    "hot_path": "c" | "python", "reason": str}``.

    ``setting`` is the environment variable ``CUPY_MEMSTRAT_HOT_PATH``
    (``auto``, the default: C where it was built; ``c``; ``python``).

    Raises:
        ValueError: the variable has another value (the message names it).
    """
    raw = os.environ.get(HOT_PATH_ENV, "")
    setting = raw.strip().lower() or "auto"
    if setting not in _HOT_PATH_CHOICES:
        raise ValueError(f"{HOT_PATH_ENV}={raw!r}: expected one of {', '.join(_HOT_PATH_CHOICES)}")
    if setting == "python":
        return {"setting": setting, "hot_path": "python", "reason": f"{HOT_PATH_ENV}=python"}
    if c_hotpath is None:
        if setting == "c":
            raise ValueError(f"{HOT_PATH_ENV}=c: {C_MISSING}")
        return {"setting": setting, "hot_path": "python", "reason": C_MISSING}
    return {"setting": setting, "hot_path": "c", "reason": "compiled from csrc/hotpath.c"}


def c_accounting(track=None):
    """The C ``Accounting`` type for a hot path being built, or None for the
    Python reference model (``CUPY_MEMSTRAT_HOT_PATH=python``, or no C
    extension). ``track`` (the strategy's ``track_origins``) makes no
    difference: the C hot path records origins too."""
    return c_hotpath.Accounting if hot_path_status()["hot_path"] == "c" else None
