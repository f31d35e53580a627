"""Which files the agent may trust, checked so that the check cannot be raced.

The agent runs as root, and its config decides what it writes to the GPUs and the host, which
commands it runs and where it sends alerts; rules files and hooks decide what it runs on a fault.
A file is refused when someone other than root (or the agent's own user, when it runs
unprivileged) could change it or put another file in its place:

- the file itself is owned by another user, or writable by its group or by others;
- any directory on the way to it, from `/` down, is owned by another user or writable by its
  group or others — including the directory that holds each symlink followed on the way, and the
  directories of the link's target;
- sticky directories (mode +t, like /tmp) are the one exception: others may add their own entries
  there but cannot rename or delete ours, so they are passed when the entry we go through (the
  next directory, the symlink or the file) is owned by root or the agent's user. An entry owned
  by someone else in a sticky directory is refused: its owner can replace it.

The check is not a `stat` followed by an `open`: the path is resolved here one component at a
time from a descriptor of `/` (`openat` with O_NOFOLLOW, symlinks read and followed by hand, at
most 40), every directory is checked on the descriptor that the next step opens from, and the
file is checked (`fstat`) on the descriptor that is then read or executed. A link swapped after
the check changes nothing: what was checked is what is read or run.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping, Sequence

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from agent.host.processes import ProcessResult

MAX_SYMLINKS = 40  # as the kernel's own limit for one path lookup
DEFAULT_LIMIT_BYTES = 1024 * 1024
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedError(Exception):
    """A file or directory others could change; str() says which and why, for the operator."""


class TooLargeError(Exception):
    def __init__(self, path: str, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"{path} is {size_bytes} bytes, more than the {limit_bytes} bytes gpu-agent reads")
        self.size_bytes = size_bytes


def _trusted_owner(uid: int, agent_uid: int) -> bool:
    return uid in (0, agent_uid)


def _not_root(uid: int, agent_uid: int) -> str:
    return f"owned by uid {uid}, not root" + ("" if agent_uid == 0 else f" or uid {agent_uid}")


def _join(parts: list[str]) -> str:
    return "/" + "/".join(parts)


class _Walk:
    """One resolution of `given`, holding the descriptor of the directory reached so far."""

    def __init__(self, given: str, agent_uid: int) -> None:
        self.given = given
        self.agent_uid = agent_uid
        self.links = 0
        self.dir_fd = -1
        self.dir_info: os.stat_result | None = None
        self.real: list[str] = []
        self._enter(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), [])

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def _enter(self, fd: int, real: list[str]) -> None:
        """Make `fd` (a directory) the current one, after checking it."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISDIR(info.st_mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), _join(real))
            where = _join(real)
            if info.st_mode & _WRITABLE_BY_OTHERS and not info.st_mode & stat.S_ISVTX:
                raise UntrustedError(
                    f"directory {where} of {self.given} is writable by group or others"
                    f" (mode {stat.S_IMODE(info.st_mode):04o}): anyone who can write there can replace the file"
                )
            if not _trusted_owner(info.st_uid, self.agent_uid):
                raise UntrustedError(f"directory {where} of {self.given} is {_not_root(info.st_uid, self.agent_uid)}")
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self.dir_fd, self.dir_info, self.real = fd, info, real

    def check_entry(self, info: os.stat_result, name: str) -> None:
        """In a sticky directory, the owner of an entry may rename or delete it: it must be ours."""
        assert self.dir_info is not None  # nosec B101  # set by __init__
        shared = self.dir_info.st_mode & stat.S_ISVTX and self.dir_info.st_mode & _WRITABLE_BY_OTHERS
        if shared and not _trusted_owner(info.st_uid, self.agent_uid):
            raise UntrustedError(
                f"{_join([*self.real, name])} on the way to {self.given} is"
                f" {_not_root(info.st_uid, self.agent_uid)} in the shared directory {_join(self.real)}"
            )

    def follow(self, fd: int, name: str, pending: list[str]) -> None:
        """`fd` is a symlink (O_PATH): put its target's components in front of the rest."""
        try:
            self.check_entry(os.fstat(fd), name)
            target = os.readlink("", dir_fd=fd)
        finally:
            os.close(fd)
        self.links += 1
        if self.links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), self.given)
        pending[:0] = _components(target)
        if target.startswith("/"):
            self._enter(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), [])

    def up(self) -> None:
        self._enter(os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd), self.real[:-1])

    def down(self, fd: int, name: str) -> None:
        try:
            self.check_entry(os.fstat(fd), name)
        except BaseException:
            os.close(fd)
            raise
        self._enter(fd, [*self.real, name])


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _open_walked(path: str | Path, flags: int, agent_uid: int | None) -> tuple[int, str]:
    """(descriptor opened with `flags`, real path) of `path`, every directory on the way checked.

    Raises OSError when the path cannot be opened, UntrustedError when a directory (or an entry
    of a sticky directory) on the way could be changed by someone else. The file itself is not
    judged here: the caller does, on the descriptor.
    """
    given = os.path.abspath(path)
    walk = _Walk(given, os.geteuid() if agent_uid is None else agent_uid)
    try:
        pending = _components(given)
        if not pending:
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), given)
        while pending:
            name = pending.pop(0)
            if name == "..":
                walk.up()
                continue
            if pending:
                try:
                    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=walk.dir_fd)
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, _join([*walk.real, name])) from None
                if stat.S_ISLNK(os.fstat(fd).st_mode):
                    walk.follow(fd, name, pending)
                else:
                    walk.down(fd, name)
                continue
            try:
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=walk.dir_fd)
            except OSError as exc:
                # ELOOP (ENOTDIR with O_DIRECTORY): the last component may be a symlink; follow it
                # by hand, checking where it sits.
                link = -1
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    link = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=walk.dir_fd)
                    if stat.S_ISLNK(os.fstat(link).st_mode):
                        walk.follow(link, name, pending)
                        continue
                    os.close(link)
                if exc.errno != errno.ELOOP:
                    raise OSError(exc.errno, exc.strerror, _join([*walk.real, name])) from None
                # swapped back between the two opens: look again, within the link budget
                walk.links += 1
                if walk.links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), given) from None
                pending.insert(0, name)
                continue
            try:
                walk.check_entry(os.fstat(fd), name)
            except BaseException:
                os.close(fd)
                raise
            return fd, _join([*walk.real, name])
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), given)  # the path ended in `..`
    finally:
        walk.close()


def _file_problem(info: os.stat_result, real: str, agent_uid: int) -> str | None:
    if info.st_mode & _WRITABLE_BY_OTHERS:
        return (
            f"{real} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}):"
            f" whoever can change it controls what gpu-agent does as root; run `chmod go-w {real}`"
        )
    if not _trusted_owner(info.st_uid, agent_uid):
        return f"{real} is {_not_root(info.st_uid, agent_uid)}: run `chown root: {real}`"
    return None


def open_trusted(path: str | Path, *, agent_uid: int | None = None) -> tuple[int, str]:
    """(read-only descriptor, real path) of a regular file only root or the agent could have changed.

    Raises OSError (cannot open; a directory, FIFO or device) or UntrustedError. The caller closes the fd.
    """
    uid = os.geteuid() if agent_uid is None else agent_uid
    # O_NONBLOCK: a FIFO put in the file's place must not hang the open; it is refused below.
    fd, real = _open_walked(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK, uid)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), real)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", real)
        problem = _file_problem(info, real, uid)
        if problem is not None:
            raise UntrustedError(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd, real


def read_at_most(fd: int, limit_bytes: int) -> bytes:
    """`fd` read to its end, but stopping once past `limit_bytes`: a result longer than
    `limit_bytes` means the file is larger (it may have grown after a size check)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(65536, limit_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit_bytes:
            break
    return b"".join(chunks)


def read_trusted(path: str | Path, *, limit_bytes: int = DEFAULT_LIMIT_BYTES, agent_uid: int | None = None) -> bytes:
    """The content of a config or rules file, read from the descriptor that passed the trust check.

    Raises OSError, UntrustedError, or TooLargeError (naming the size) for a file over
    `limit_bytes`: checked before reading, so a 50 MB file costs one fstat.
    """
    fd, real = open_trusted(path, agent_uid=agent_uid)
    try:
        size = os.fstat(fd).st_size
        if size > limit_bytes:
            raise TooLargeError(real, size, limit_bytes)
        data = read_at_most(fd, limit_bytes)
        if len(data) > limit_bytes:  # grew after the fstat
            raise TooLargeError(real, len(data), limit_bytes)
        return data
    finally:
        os.close(fd)


def directory_problem(path: str | Path, agent_uid: int | None = None) -> str | None:
    """Why directory `path` (a rules.d) must not be trusted: it, or a directory above it, could be
    changed by someone else, who could then add a file to it. None: trusted, or missing."""
    try:
        fd, _real = _open_walked(path, os.O_RDONLY | os.O_DIRECTORY, agent_uid)
    except UntrustedError as exc:
        return str(exc)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    uid = os.geteuid() if agent_uid is None else agent_uid
    if info.st_mode & _WRITABLE_BY_OTHERS:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if not _trusted_owner(info.st_uid, uid):
        return f"{path} is {_not_root(info.st_uid, uid)}"
    return None


def open_trusted_executable(path: str | Path, *, agent_uid: int | None = None) -> int:
    """A descriptor of the program at `path` (a hook), checked as `open_trusted` checks files and
    executable by someone. Run it through that descriptor (`run_trusted`), never through the path
    again: the path could point elsewhere by then. The caller closes the fd."""
    if not str(path).startswith("/"):
        raise UntrustedError(f"hook program must be an absolute path, not {str(path)!r}")
    fd, real = open_trusted(path, agent_uid=agent_uid)
    if not os.fstat(fd).st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH):
        os.close(fd)
        raise OSError(errno.EACCES, f"{real} is not executable", real)
    return fd


def executable_problem(path: str, agent_uid: int | None = None) -> str | None:
    """Why the program at `path` must not run (None: it may), for check-config."""
    try:
        fd = open_trusted_executable(path, agent_uid=agent_uid)
    except UntrustedError as exc:
        return str(exc)
    except OSError as exc:
        return f"hook {path}: {exc.strerror or exc}"
    os.close(fd)
    return None


def run_trusted(
    argv: Sequence[str],
    timeout_seconds: float,
    *,
    stdin: bytes = b"",
    extra_env: Mapping[str, str] | None = None,
    agent_uid: int | None = None,
) -> ProcessResult:
    """Run a hook: check argv[0] and execute exactly the file that was checked.

    The child keeps the descriptor checked here and executes `/proc/self/fd/N`, the magic link to
    it; a symlink or file swapped in after the check is never run. The program still gets argv[0]
    as given as its name, and the result names argv as given; a script's interpreter gets the
    /proc path as its script name and opens the same file. Raises UntrustedError (refuse the
    action), or OSError (it cannot run). The hook runner (agent.rules.actions.kinds.run_hook) calls it.
    """
    from agent.host.processes import run_process

    fd = open_trusted_executable(argv[0], agent_uid=agent_uid)
    try:
        return run_process(
            argv, timeout_seconds, stdin=stdin, extra_env=extra_env, executable=f"/proc/self/fd/{fd}", pass_fds=(fd,)
        )
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    # Only a refusal's text needs it: imported then, off the fast start (agent/cli/fast_start.py).
    from agent.host.file_reads import file_kind

    return file_kind(mode)


def _followed(path: str, link: os.stat_result) -> os.stat_result:
    """What the link at `path` points to; the link itself when that cannot be read. (Not
    contextlib.suppress: `status` reads through this module, and contextlib is a tenth of it.)"""
    try:
        return os.stat(path)
    except OSError:
        return link


def state_directory_problem(path: str | Path, what: str, agent_uid: int | None = None) -> str | None:
    """Why directory `path` must not hold the agent's state (state_dir) or its socket: it is not a
    directory, or it or a directory above it could be changed by someone else (who could then plant
    the file the agent reads back, or a FIFO that hangs it). A missing one is judged by the nearest
    directory above it that exists, the one it will be created in. `what` names it for the message
    (`state_dir`, `the api.socket directory`). None: trusted."""
    given = os.path.abspath(path)
    existing = given
    while True:
        try:
            info = os.lstat(existing)
            break
        except (FileNotFoundError, NotADirectoryError):
            if os.path.dirname(existing) == existing:
                return None
            existing = os.path.dirname(existing)
    if stat.S_ISLNK(info.st_mode):
        info = _followed(existing, info)
    if not stat.S_ISDIR(info.st_mode):
        return f"{what} {given}: {existing} is {_kind(info.st_mode)}, not a directory"
    problem = directory_problem(existing, agent_uid)
    if problem is None:
        return None
    return f"{what} {given} is not safe: {problem}; gpu-agent keeps its state and socket where only root can write"


def state_file_problem(path: str | Path, agent_uid: int | None = None) -> str | None:
    """Why a file of the agent's own state (the database and its -wal and -shm files) must not be
    opened: a FIFO or device in its place (an open would hang or never end), a symlink, or a file
    someone else owns or could write. Judged on a descriptor opened O_NONBLOCK | O_NOFOLLOW, before
    SQLite opens it. None: fine, or missing (it will be created)."""
    uid = os.geteuid() if agent_uid is None else agent_uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path} is a symlink: gpu-agent opens its own state only where it is"
        return f"{path}: {exc.strerror or exc}"
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is {_kind(info.st_mode)}, not a regular file: remove it"
    return _file_problem(info, str(path), uid)
