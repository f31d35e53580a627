"""Which files the agent may trust: it runs as root, and its config decides what it writes to the GPUs
and the host, which commands it runs (service managers, the reboot command) and where it sends alerts.

A file is refused when someone other than root could change it: writable by its group or by others
(always), owned by another user (when the agent runs as root; a developer running it unprivileged
may use their own files), or inside a directory such a person could write to, since they could put
another file in its place. A world-writable directory with the sticky bit (/tmp) only lets others add
their own files, not replace ours, so it is allowed, as it is for hooks (agent.rules.actions).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _owner_problem(info: os.stat_result, as_root: bool) -> str | None:
    if as_root and info.st_uid != 0:
        return f"owned by uid {info.st_uid}, not root"
    return None


def file_problem(path: str | Path, running_as_root: bool | None = None) -> str | None:
    """Why `path` must not be trusted, naming it (None: trusted). A missing file is not a trust problem."""
    as_root = os.geteuid() == 0 if running_as_root is None else running_as_root
    try:
        real = Path(path).resolve(strict=True)
        info = real.stat()
    except OSError:
        return None
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{real} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}):"
            f" whoever can change it controls what gpu-agent does as root; run `chmod go-w {real}`"
        )
    owner = _owner_problem(info, as_root)
    if owner is not None:
        return f"{real} is {owner}: run `chown root: {real}`"
    for directory in real.parents:
        dir_info = directory.stat()
        if dir_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dir_info.st_mode & stat.S_ISVTX:
            return (
                f"directory {directory} of {real} is writable by group or others"
                f" (mode {stat.S_IMODE(dir_info.st_mode):04o}): anyone who can write there can replace the file"
            )
        owner = _owner_problem(dir_info, as_root)
        if owner is not None:
            return f"directory {directory} of {real} is {owner}"
    return None
