"""Warnings that name the user's line: the first frame outside cupy_memstrat
(however deep the call went through the strategies, the checking layer or a
finaliser CuPy ran)."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_at_user"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # .../cupy_memstrat/


def warn_at_user(message, category) -> None:
    """``warnings.warn(message, category)``, attributed to the first frame
    outside cupy_memstrat, counted from the caller of this function. (No
    fixed ``stacklevel``: the C hot path's free has no Python frame of its
    own, the Python one has one, the checking layer adds more.) Does nothing
    at interpreter shutdown (the warnings machinery may be half gone then)."""
    __tracebackhide__ = True  # under -W error, pytest's traceback ends at the user's line
    if sys.is_finalizing():
        return
    level, f = 2, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(PACKAGE_DIR):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
