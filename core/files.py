"""Files the tools are handed (tuned tables, benchmark CSVs, SQLite databases): only regular files are
read. A FIFO or a character device would block a reader forever, or feed it without end, so the check
happens on the opened descriptor, before the first read, and the open itself never blocks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

# O_NONBLOCK: opening a FIFO for reading waits for a writer without it; regular files ignore it.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class NotARegularFile(OSError):
    """The path names a folder, a FIFO, a device or a socket where a file was expected."""


class NotText(ValueError):
    """A regular file that is larger than its reader takes, or not UTF-8 text."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_text(path: str | Path, limit: int) -> str:
    """The UTF-8 text of the regular file at `path`: NotARegularFile for anything else, OSError when it
    cannot be opened, NotText when it holds more than `limit` bytes or is not UTF-8."""
    data = _read_bytes(path, limit)
    if len(data) > limit:
        raise NotText(f"larger than {limit >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotText(f"not UTF-8 text ({err})") from None


def _read_bytes(path: str | Path, limit: int) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path` (one more than `limit` says it is larger);
    NotARegularFile for anything else, OSError when it cannot be opened."""
    fd = os.open(path, _READ_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"expected a regular file, got {_kind(mode)}")
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def require_regular_if_present(path: str | Path) -> None:
    """NotARegularFile when `path` exists (links followed) and is not a regular file; nothing otherwise.
    For files another library opens (SQLite): checked just before it does."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a parent may be a file)
        return
    if not stat.S_ISREG(mode):
        raise NotARegularFile(f"expected a regular file, got {_kind(mode)}")
