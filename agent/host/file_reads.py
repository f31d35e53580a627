"""Reading host files that anyone may have put in the way: only regular files, only so much.

A path under `host_root` can name a FIFO (an open for reading waits for a writer, forever), a
device (`nvidia.ko` -> `/dev/zero` never ends) or a file far larger than what belongs there. So a
read here:

- opens with O_NONBLOCK (a FIFO opens at once instead of waiting for a writer) and, where the
  caller asks, O_NOFOLLOW;
- judges what it opened with `fstat` on that descriptor, before reading a byte: anything but a
  regular file is `NotRegularFile`;
- reads at most `limit_bytes`: more is `FileTooLarge`, never a partial answer taken as whole.

Both errors are `OSError`s, so every caller that already reports an unreadable file reports these
the same way. A file on a hung disk still blocks the thread that reads it: that is why slow reads
(the next-boot check) run on a worker of their own with a deadline.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

#: What a text file under host_root may hold when the caller names no bound (sysfs, procfs, configs).
DEFAULT_LIMIT_BYTES = 4 * 1024 * 1024
_READ_CHUNK_BYTES = 1 << 20


class NotRegularFile(OSError):
    """The path names a FIFO, a device or a socket: nothing was read from it."""

    def __init__(self, path: str, mode: int) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({file_kind(mode)}), refused", path)


class FileTooLarge(OSError):
    """The file holds more than the reader's bound."""

    def __init__(self, path: str, limit_bytes: int) -> None:
        super().__init__(errno.EFBIG, f"larger than {limit_bytes} bytes, refused", path)


def file_kind(mode: int) -> str:
    """What a file of `mode` is, for a refusal's text: "a FIFO", "a symlink", ..., else its mode."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def open_regular(path: str | os.PathLike[str], follow_links: bool = True) -> BinaryIO:
    """An unbuffered binary file object for `path`, which must be a regular file (NotRegularFile).

    `follow_links=False` refuses a symlink at the last component (ELOOP) as well."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise NotRegularFile(os.fspath(path), mode)
        # O_NONBLOCK means nothing for a regular file's reads; cleared so no reader ever sees EAGAIN.
        os.set_blocking(fd, True)
        return open(fd, "rb", buffering=0, closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_bytes(
    path: str | os.PathLike[str], limit_bytes: int = DEFAULT_LIMIT_BYTES, follow_links: bool = True
) -> bytes:
    """The whole content of a regular file of at most `limit_bytes` (FileTooLarge beyond)."""
    with open_regular(path, follow_links) as stream:
        chunks: list[bytes] = []
        total = 0
        # One byte past the bound tells "exactly at the bound" from "larger", whatever st_size claims
        # (procfs and sysfs files say 0).
        while chunk := stream.read(min(_READ_CHUNK_BYTES, limit_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit_bytes:
                raise FileTooLarge(os.fspath(path), limit_bytes)
        return b"".join(chunks)


def read_text(
    path: str | os.PathLike[str],
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
    errors: str = "strict",
    follow_links: bool = True,
) -> str:
    """`read_bytes` decoded as UTF-8 (`errors` as for `bytes.decode`)."""
    return read_bytes(path, limit_bytes, follow_links).decode("utf-8", errors)
