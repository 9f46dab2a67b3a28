"""The pytest plugin: ``--gpumem-strategy`` (ini key ``gpumem_strategy``).

Uses only cupy_memstrat's public API. Nothing happens unless asked for; a
session without a GPU runs normally and says so once in the header.
"""

from __future__ import annotations

import pytest

import cupy_memstrat

_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("gpumem", "GPU memory (cupy-memstrat)")
    group.addoption(
        "--gpumem-strategy",
        metavar="NAME[:KEY=VALUE,...]",
        default=None,
        help="run the session with this cupy_memstrat strategy as CuPy's allocator, "
        "e.g. 'device' (default: CuPy's own pool)",
    )
    parser.addini(
        "gpumem_strategy",
        "cupy_memstrat strategy for the session (as --gpumem-strategy)",
        default="",
    )


def _setting(config):
    value = config.getoption("gpumem_strategy")
    if value is not None:  # an empty value switches an ini setting off
        return (value or None), "--gpumem-strategy"
    value = config.getini("gpumem_strategy")
    if value:
        return value, "ini key gpumem_strategy"
    return None, None


def pytest_configure(config):
    spec, source = _setting(config)
    state = {"spec": spec, "source": source, "strategy": None, "why_off": None, "previous": None}
    config.stash[_KEY] = state
    if spec is None:
        return
    try:
        cupy_memstrat.validate(spec)
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(f"{source}={spec!r}: {exc}") from None
    try:
        import cupy

        previous = cupy.cuda.get_allocator()
        state["strategy"] = cupy_memstrat.use(spec)
        state["previous"] = previous
    except (ImportError, cupy_memstrat.NoDeviceError, cupy_memstrat.CuPyNotInstalledError) as exc:
        state["why_off"] = str(exc)


def pytest_unconfigure(config):
    state = config.stash.get(_KEY, None)
    if state and state["strategy"] is not None:
        import cupy

        cupy.cuda.set_allocator(state["previous"])  # what was there before the session


def pytest_report_header(config):
    state = config.stash.get(_KEY, None)
    if not state or state["spec"] is None:
        return None
    if state["strategy"] is not None:
        return f"gpumem: CuPy allocates with strategy {state['strategy'].name!r} ({state['source']}={state['spec']!r})"
    return f"gpumem: strategy {state['spec']!r} not installed, tests run with CuPy's own allocator: {state['why_off']}"
