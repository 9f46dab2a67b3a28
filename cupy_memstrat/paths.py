"""Files the library writes: checked before anything is written, and written
whole or not at all."""

from __future__ import annotations

import errno
import os
import stat
import tempfile

__all__ = ["check_writable_file", "write_file_atomically"]

_UMASK = os.umask(0)
os.umask(_UMASK)


def check_writable_file(path, what: str = "path") -> None:
    """Refuse, before anything is written, a path that is no file to write:
    empty, with a NUL character, too long for the file system, a directory, a
    FIFO (opening it would wait for a reader), a socket or a device, or one in
    a folder that does not exist.

    Raises:
        ValueError: one of the above but the missing folder.
        FileNotFoundError: the folder does not exist.
    """
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not p:
        raise ValueError(f"{what}: expected a file path, got an empty one")
    if "\0" in p:
        raise ValueError(f"{what}: {p!r} contains a NUL character; expected a file path")
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{what}: cannot write {p!r}: the folder {folder!r} does not exist") from None
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{what}: {p!r} is a symbolic link in a loop, not a file to write") from None
        if exc.errno == errno.ENAMETOOLONG:
            shown = p if len(p) <= 80 else p[:60] + "..." + p[-12:]
            raise ValueError(f"{what}: cannot write {shown!r} ({len(p)} characters): the name is too long for "
                             "the file system") from None
        return  # open() says why
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ValueError(f"{what}: {p!r} is {kind}, not a file to write")


def write_file_atomically(path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a new temporary
    file beside it (unique per call, so concurrent writers never mix), then
    renamed over it. A symbolic link stays, and its target gets the file. An
    existing file keeps its permissions; a new one gets what a plain
    ``open()`` would give it. Where the folder takes no new file but the
    file itself is writable, the file is written in place (not atomically).

    Raises:
        OSError: the file cannot be written, or ``path`` is a symbolic link
            in a loop; the message names ``path``.
    """
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    if os.path.islink(real):  # realpath stops inside a loop of links
        raise OSError(errno.ELOOP, f"cannot write {shown!r}: a symbolic link in a loop")
    try:
        mode = stat.S_IMODE(os.stat(real).st_mode)
    except OSError:
        mode = 0o666 & ~_UMASK
    tmp = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".cupy_memstrat-", suffix=".tmp", dir=os.path.dirname(real))
        except PermissionError:
            if not (os.path.isfile(real) and os.access(real, os.W_OK)):
                raise
            with open(real, "wb") as f:  # a read-only folder, a writable file: in place
                f.write(data)
            return
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, real)
        tmp = None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {shown!r}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
