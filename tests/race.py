"""A symlink race harness: another process swaps two directory entries as fast as it can.

`swapping(a, b)` runs a child that exchanges `a` and `b` with renameat2(RENAME_EXCHANGE) in a
tight loop: an attacker's best tool, since each swap is atomic (the name is never missing, it is
always one of the two objects). Put a real directory (or file) at one name and a symlink to a
victim at the other, call the primitive under test many times inside the `with`, then check the
victim. The child is started and seen swapping before the block runs, and must still be swapping
when it ends, so a harness that silently stopped cannot pass a test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_SWAP_LOOP = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
RENAME_EXCHANGE = 2
AT_FDCWD = -100
while True:
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        sys.exit(f"renameat2 failed: errno {ctypes.get_errno()}")
"""


def attempts(attempt: Callable[[], str], wanted: set[str], rounds: int, limit_seconds: float = 20.0) -> dict[str, int]:
    """Call `attempt` (which names its outcome) at least `rounds` times and until every outcome in
    `wanted` was seen or the time limit passed: on a loaded machine the swapper can sit descheduled
    through a whole burst of fast attempts, and a fixed count would see one side of the race only.
    Returns how often each outcome came."""
    counts: dict[str, int] = {}
    deadline = time.monotonic() + limit_seconds
    done = 0
    while done < rounds or (not wanted <= counts.keys() and time.monotonic() < deadline):
        outcome = attempt()
        counts[outcome] = counts.get(outcome, 0) + 1
        done += 1
        if done % 50 == 0:
            time.sleep(0.001)  # let the swapper run even when it shares a core with us
    return counts


def _identity(path: Path) -> tuple[int, int]:
    info = path.lstat()
    return info.st_ino, info.st_mode


@contextlib.contextmanager
def swapping(a: Path, b: Path) -> Iterator[None]:
    before = _identity(a)
    child = subprocess.Popen([sys.executable, "-c", _SWAP_LOOP, str(a), str(b)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while _identity(a) == before:
            assert child.poll() is None, f"swapper died: {child.stderr.read() if child.stderr else ''!r}"
            assert time.monotonic() < deadline, "the swapper never swapped"
            time.sleep(0.001)
        yield
        assert child.poll() is None, f"swapper stopped during the race: {child.stderr.read() if child.stderr else ''!r}"
    finally:
        child.kill()
        child.wait()
        if child.stderr:
            child.stderr.close()


def fingerprint(path: Path) -> tuple[int, int, int, bytes | list[str]]:
    """(mode, uid, gid, content or sorted entries) of a victim, compared before and after a race."""
    info = path.lstat()
    content: bytes | list[str] = sorted(os.listdir(path)) if path.is_dir() else path.read_bytes()
    return info.st_mode, info.st_uid, info.st_gid, content
