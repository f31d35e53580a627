"""Host writes that never follow a symlink.

The agent writes as root into directories that other users may own a part of (a service user
owns its cache directory's parent; a unit's drop-in directory can be anyone's): a write that
follows links there lets that user point it at any file on the host. So every write here:

- starts from a descriptor of the trusted root (`host_root`: `/` on a real host, a temporary tree
  in tests; the root itself is the operator's choice and is opened as given);
- walks down one component at a time with `openat(O_DIRECTORY | O_NOFOLLOW)`: a symlink (or any
  non-directory) where a directory is expected raises `UnsafePathError`, never followed, not
  even one that points somewhere harmless — no symlink is resolved under any rule;
- creates missing directories with `mkdirat` in the directory already opened, then opens what it
  created with O_NOFOLLOW (a link swapped in between is refused like any other);
- changes owner and mode with `fchown`/`fchmod` on the opened descriptor, after `fstat` on it;
- replaces files atomically: a temporary file created O_EXCL | O_NOFOLLOW in the opened parent,
  written, fsynced, then `renameat` in that same parent (a rename replaces a link itself, never
  what it points to), and the parent fsynced.

Paths are host paths (`/etc/...`); `..` is refused, so nothing escapes the root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator


class UnsafePathError(OSError):
    """A symlink or a non-directory where a directory was expected; nothing was written through it."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.ELOOP, f"{path} is {what}, refused: gpu-agent never writes through links", path)


def _parts(absolute: str) -> list[str]:
    if not absolute.startswith("/"):
        raise ValueError(f"host path must be absolute: {absolute!r}")
    parts = [part for part in absolute.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"host path must not contain '..': {absolute!r}")
    return parts


def _open_entry_dir(parent_fd: int, name: str, shown: str) -> int:
    """Open directory `name` of `parent_fd`; a symlink there is UnsafePathError.

    The entry is opened once, O_PATH | O_NOFOLLOW, and judged on that descriptor; the readable
    descriptor is then opened as "." relative to it, so both are the same directory even if the
    name is swapped in between.
    """
    entry = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        mode = os.fstat(entry).st_mode
        if stat.S_ISLNK(mode):
            raise UnsafePathError(shown, "a symlink")
        if not stat.S_ISDIR(mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown)
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=entry)
    finally:
        os.close(entry)


def _open_child_dir(parent_fd: int, name: str, shown: str, create_mode: int | None = None) -> int:
    try:
        return _open_entry_dir(parent_fd, name, shown)
    except FileNotFoundError:
        if create_mode is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), shown) from None
    try:
        os.mkdir(name, create_mode, dir_fd=parent_fd)
    except FileExistsError:  # made by someone else meanwhile: judged like any other
        return _open_entry_dir(parent_fd, name, shown)
    fd = _open_entry_dir(parent_fd, name, shown)
    os.fchmod(fd, create_mode)  # exactly the mode asked for, whatever the umask
    return fd


@contextlib.contextmanager
def open_directory(root: str | os.PathLike[str], absolute: str, *, create_mode: int | None = None) -> Iterator[int]:
    """A descriptor of host directory `absolute` under `root`, reached without following links.

    `create_mode`: create missing directories with that mode (owned by this process); None: a
    missing directory is FileNotFoundError.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        shown = ""
        for name in _parts(absolute):
            shown += "/" + name
            child = _open_child_dir(fd, name, shown, create_mode)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _split(absolute: str) -> tuple[str, str]:
    parts = _parts(absolute)
    if not parts:
        raise ValueError(f"host path names no file: {absolute!r}")
    return "/" + "/".join(parts[:-1]), parts[-1]


def lstat(root: str | os.PathLike[str], absolute: str) -> os.stat_result:
    """The entry at `absolute` itself (a link is reported as a link), its parents reached without links."""
    parent, name = _split(absolute)
    with open_directory(root, parent) as parent_fd:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)


def write_file_atomic(
    root: str | os.PathLike[str], absolute: str, data: bytes, mode: int = 0o644, *, parents_mode: int = 0o755
) -> None:
    """Replace host file `absolute` with `data` (mode `mode`, owned by this process), atomically."""
    parent, name = _split(absolute)
    with open_directory(root, parent, create_mode=parents_mode) as parent_fd:
        tmp = f".{name}.gpu-agent.tmp"
        # A temp file left by a crash (or anything else put there): unlink removes the entry
        # itself, a link included, and then O_EXCL makes sure the file written is a new one.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=parent_fd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent_fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent_fd)
            raise
        os.fsync(parent_fd)


def write_existing(root: str | os.PathLike[str], absolute: str, data: bytes) -> None:
    """One write to an existing file (a sysfs attribute: no temporary file, no rename), opened
    O_NOFOLLOW under parents reached without links; a link or a non-regular file is refused."""
    parent, name = _split(absolute)
    with open_directory(root, parent) as parent_fd:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(absolute, "a symlink") from None
            raise OSError(exc.errno, exc.strerror, absolute) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePathError(absolute, "not a regular file")
            os.write(fd, data)
        finally:
            os.close(fd)


def ensure_directory(
    root: str | os.PathLike[str], absolute: str, uid: int, gid: int, mode: int, *, parents_mode: int = 0o755
) -> None:
    """Host directory `absolute` exists, owned by uid:gid with mode `mode`; each change made on the
    opened descriptor. A new directory starts 0700 (nobody else can use it before it is given away)."""
    parent, name = _split(absolute)
    with open_directory(root, parent, create_mode=parents_mode) as parent_fd:
        fd = _open_child_dir(parent_fd, name, absolute, create_mode=0o700)
        try:
            info = os.fstat(fd)
            if (info.st_uid, info.st_gid) != (uid, gid):
                os.fchown(fd, uid, gid)
            # After chown, which may clear the setgid bit.
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def remove_file(root: str | os.PathLike[str], absolute: str) -> None:
    """Unlink host file `absolute` if present (a link is removed itself, never its target)."""
    parent, name = _split(absolute)
    try:
        with open_directory(root, parent) as parent_fd:
            os.unlink(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return


def remove_empty_directory(root: str | os.PathLike[str], absolute: str) -> bool:
    """Remove host directory `absolute` if it is empty; True when removed. Not empty, missing or
    not a directory (a link is never followed): left alone."""
    parent, name = _split(absolute)
    try:
        with open_directory(root, parent) as parent_fd:
            os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
            return False
        raise
    return True
