"""Host paths resolved under a root prefix (`host_root`).

The agent never opens an absolute host path directly: tests and the demo point `host_root`
at a temporary tree, the daemon at `/`. Like node_exporter's `--path.sysfs`, but one prefix
for everything.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from agent.host import file_reads, safe_fs

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class HostPaths:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> HostPaths:
        return cls(Path(root))

    def path(self, absolute: str) -> Path:
        """`/sys/kernel/mm/...` -> `<root>/sys/kernel/mm/...`."""
        if not absolute.startswith("/"):
            raise ValueError(f"host path must be absolute: {absolute!r}")
        return self.root / absolute.lstrip("/")

    def read_text(
        self, absolute: str, limit_bytes: int = file_reads.DEFAULT_LIMIT_BYTES, errors: str = "strict"
    ) -> str:
        """A regular file's text, at most `limit_bytes` (agent.host.file_reads: a FIFO, a device or a
        larger file is an OSError, never a hang or a partial answer)."""
        return file_reads.read_text(self.path(absolute), limit_bytes, errors)

    def read_bytes(self, absolute: str, limit_bytes: int = file_reads.DEFAULT_LIMIT_BYTES) -> bytes:
        return file_reads.read_bytes(self.path(absolute), limit_bytes)

    def exists(self, absolute: str) -> bool:
        return self.path(absolute).exists()

    def write_sysfs(self, absolute: str, value: str) -> None:
        """Write a kernel attribute: one write, no truncation games (sysfs files are not regular),
        through no symlink (agent.host.safe_fs)."""
        safe_fs.write_existing(self.root, absolute, value.encode("utf-8"))

    def write_file_atomic(self, absolute: str, content: str, mode: int = 0o644) -> None:
        """Replace a config file atomically (temp file in the same dir, fsync, rename), through no symlink."""
        safe_fs.write_file_atomic(self.root, absolute, content.encode("utf-8"), mode)

    def ensure_directory(self, absolute: str, uid: int, gid: int, mode: int) -> None:
        """The directory exists with this owner and mode; changed on its descriptor, through no symlink."""
        safe_fs.ensure_directory(self.root, absolute, uid, gid, mode)

    def lstat(self, absolute: str) -> os.stat_result:
        """The entry itself (a link shows as a link); UnsafePathError when a parent is a link."""
        return safe_fs.lstat(self.root, absolute)

    def remove_file(self, absolute: str) -> None:
        safe_fs.remove_file(self.root, absolute)

    def remove_empty_directory(self, absolute: str) -> bool:
        return safe_fs.remove_empty_directory(self.root, absolute)

    def boot_id(self) -> str:
        """This boot's id (`/proc/sys/kernel/random/boot_id`); "" when it cannot be read. What tells a
        restart of the agent (same id) from a reboot (a new one)."""
        try:
            return self.read_text(BOOT_ID_PATH).strip()
        except (OSError, UnicodeDecodeError):
            return ""

    def hostname(self) -> str:
        """The node's host name (`/proc/sys/kernel/hostname`, the kernel's, which `hostname` prints);
        the process's own when that cannot be read."""
        try:
            name = self.read_text("/proc/sys/kernel/hostname", 256).strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        return name or socket.gethostname()

    def os_release(self) -> dict[str, str]:
        """Parsed /etc/os-release ({} when absent)."""
        try:
            text = self.read_text("/etc/os-release")
        except OSError:
            return {}
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and not key.startswith("#"):
                fields[key.strip()] = value.strip().strip('"').strip("'")
        return fields
