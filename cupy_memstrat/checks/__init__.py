"""Catching stream misuse and use-after-free: a checking layer over any strategy.

``cupy_memstrat.use("async", check="streams,poison,redzone")`` (any subset;
``"all"`` for the three) wraps the strategy in a :class:`CheckedStrategy`:

``streams``
    Each allocation remembers its stream and thread. When a block is freed,
    every other stream of its device that the allocating or the freeing
    thread used while the block was alive (CuPy's current stream at an
    allocation or a free), and the stream current at the free, is asked
    whether it still has work queued (``cudaStreamQuery``). Such a stream may still be using the block,
    which goes back to the allocating stream for reuse. If nothing orders the
    two (the allocating stream has no work left that could wait for it, or,
    when both are busy, it finishes first: seen with events), that is a
    *cross-stream reuse* finding. The legacy default stream's implicit
    synchronisation with blocking streams counts as ordering. Within
    :func:`expect_stream` (the pytest plugin's ``--gpumem-stream-policy=fresh``),
    an allocation made while the legacy default stream is current is a
    *legacy stream* finding: code that hard-codes that stream is not ordered
    with the test's stream.
``poison``
    A freed block is filled with the byte ``0xFF`` on its stream (NaN in
    every floating-point format, -1 in signed integers) and held in a
    quarantine (``quarantine_bytes``, ``quarantine_count``) before it goes
    back to the strategy. When it leaves, a kernel checks that the poison is
    intact; if not, a *write after free* finding names where the block was
    allocated and freed.
``redzone``
    Each allocation gets ``redzone_bytes`` (rounded up to 256, which keeps
    CuPy's 256-byte alignment of the block) of guard bytes after it, filled
    with the canary byte ``0xCB`` and checked by a kernel when the block is
    freed: damage is an *out-of-bounds write* finding.

The kernels (csrc/checks.cu) are compiled at run time through CuPy (NVRTC) and
never allocate through the allocator they check. Their results arrive
asynchronously: a finding from a kernel is noticed at the next allocation
(through a host-mapped flag) or at :func:`collect`.

What happens with a finding is the strategy's ``on_finding`` option:
``"raise"`` (default) raises :class:`CheckError` at the next allocation
through that strategy or from :func:`collect` (a free runs inside CuPy's
finalisers, where raising is impossible); ``"warn"`` warns
:class:`CheckWarning` where it is found; ``"record"`` only records. Every
finding is also kept for :func:`findings`.

Limits, by design: the allocator sees allocations and frees, not kernel
launches. ``streams`` therefore cannot know which of a stream's queued
kernels touch a block: a stream that keeps working on other data after a
correct hand-off can be reported (synchronise it, or make the allocating
stream wait for it, before dropping the array). A stream used only through
explicit ``stream=`` arguments, with no allocation while it is current, is
invisible to it. See docs/checks.md.

The package's modules: ``options`` (the checks and their options, declared
once), ``findings`` (findings and the process's record of them),
``stream_order`` (the ``streams`` check, :func:`expect_stream`,
:func:`fresh_stream`), ``quarantine`` (the ``poison`` and ``redzone``
checks) and ``layer`` (:class:`CheckedStrategy`: the allocation and free path,
composed of the checks' parts). This module only re-exports their public names.
"""

from __future__ import annotations

import importlib

from .findings import KINDS, CheckError, CheckWarning, Finding, clear, collect, findings, mark
from .options import CHECKS, OPTION_NAMES, parse_checks
from .quarantine import CANARY_BYTE, POISON_BYTE
from .stream_order import _expected, expect_stream, fresh_stream  # noqa: F401 - _expected: read by tests

__all__ = [
    "CHECKS",
    "OPTION_NAMES",
    "POISON_BYTE",
    "CANARY_BYTE",
    "KINDS",
    "Finding",
    "CheckError",
    "CheckWarning",
    "CheckedStrategy",
    "parse_checks",
    "checked",
    "findings",
    "clear",
    "collect",
    "expect_stream",
    "fresh_stream",
    "mark",
]


_LAZY = ("CheckedStrategy", "checked")  # from .layer, imported on first use (with the strategy base)


def __getattr__(name):
    # looked up in sys.modules at every access, not kept here: a pytest run in the same process
    # (pytester's runpytest_inprocess) drops the modules it imported, and a class kept from an
    # earlier run would no longer be the one use(..., check=...) makes (isinstance would fail)
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.layer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
