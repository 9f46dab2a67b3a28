"""Checks on file paths the library writes to, made before anything is written."""

from __future__ import annotations

import os

__all__ = ["check_writable_file"]


def check_writable_file(path, what: str = "path") -> None:
    """Refuse, before anything is written, a path that is no file to write:
    empty, a directory, a FIFO (opening it would wait for a reader), a socket
    or a device, or one in a folder that does not exist."""
    import stat

    p = os.fspath(path)
    if not p:
        raise ValueError(f"{what}: expected a file path, got an empty one")
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{what}: cannot write {p!r}: the folder {folder!r} does not exist") from None
        return
    except OSError:
        return  # open() says why
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ValueError(f"{what}: {p!r} is {kind}, not a file to write")
