"""Host paths resolved under a root prefix (`host_root`).

The agent never opens an absolute host path directly: tests and the demo point `host_root`
at a temporary tree, the daemon at `/`. Like node_exporter's `--path.sysfs`, but one prefix
for everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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

    def read_text(self, absolute: str) -> str:
        return self.path(absolute).read_text(encoding="utf-8")

    def exists(self, absolute: str) -> bool:
        return self.path(absolute).exists()

    def write_sysfs(self, absolute: str, value: str) -> None:
        """Write a kernel attribute: one write, no truncation games (sysfs files are not regular)."""
        with open(self.path(absolute), "w", encoding="utf-8") as f:
            f.write(value)

    def write_file_atomic(self, absolute: str, content: str, mode: int = 0o644) -> None:
        """Replace a config file atomically: temp file in the same dir, fsync, rename."""
        target = self.path(absolute)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.gpu-agent.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

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
