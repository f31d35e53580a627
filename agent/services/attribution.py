"""Which service holds which GPU memory: NVML's compute processes mapped to configured services.

Two ways to tell a process's service, tried in this order:

1. systemd: `/proc/PID/cgroup` (under `host_root`) names the unit the process runs in; the
   innermost `*.service` of the path (`0::/system.slice/sglang.service` -> `sglang.service`, also
   for a unit inside a user manager) is matched against each service's `unit`.
2. `manager: command`: a start command hands its server to some supervisor and exits, so the
   agent cannot keep the started process itself; the server is found as the process listening on
   the port of its health (or metrics) URL, and every GPU process in that process's tree (itself
   and its descendants: sglang's tensor-parallel workers, vLLM's engine core) is the service's.

What matches no service is listed as unattributed, with its unit and command name, so `status`
and the reset sequence's "processes remain" check can say who holds a GPU. `service_of_pid` answers
the same question for one process: whose process an app-level Xid's faulting pid is.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping, Sequence

import psutil

from agent.backend.base import GpuProcess
from agent.config.service_entry import ServiceConfig
from agent.host.paths import HostPaths
from agent.printable import printable
from agent.state import GpuAttribution, GpuProcessInfo

# /proc/PID/comm is 16 bytes, a cgroup line a path; far more is not what /proc gives.
_PROC_LIMIT_BYTES = 64 * 1024


def unit_of_pid(pid: int, paths: HostPaths) -> str | None:
    """The innermost systemd service unit in the process's cgroup path; None outside any."""
    try:
        text = paths.read_text(f"/proc/{pid}/cgroup", _PROC_LIMIT_BYTES)
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        hierarchy, _, path = line.partition(":")[2].partition(":")
        # cgroup v2 ("0::/...") or v1's systemd hierarchy ("1:name=systemd:/...")
        if not (line.startswith("0::") or hierarchy == "name=systemd"):
            continue
        for part in reversed(path.split("/")):
            if part.endswith(".service"):
                return printable(part)
    return None


def command_of_pid(pid: int, paths: HostPaths) -> str:
    try:
        # A process names itself: escaped where it enters.
        return printable(paths.read_text(f"/proc/{pid}/comm", _PROC_LIMIT_BYTES).strip())
    except (OSError, UnicodeDecodeError):
        return ""


def _port(url: str | None) -> int | None:
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def listening_pid(port: int) -> int | None:
    """The process listening on a TCP port on this host (psutil; needs root for other users' sockets)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            return connection.pid
    return None


class Listeners:
    """Who listens on each port, remembered while that process lives: finding it scans every
    process's sockets (tens of ms of CPU on a busy host, per service, every attribution), while a
    service's listener lives as long as the service. A process that is gone (or a pid reused by
    another: its start time differs) is looked for again."""

    def __init__(self, scan: Callable[[int], int | None] = listening_pid) -> None:
        self._scan = scan
        self._known: dict[int, tuple[int, float]] = {}  # port -> (pid, its start time)

    def __call__(self, port: int) -> int | None:
        known = self._known.get(port)
        if known is not None and _start_time(known[0]) == known[1]:
            return known[0]
        pid = self._scan(port)
        started = None if pid is None else _start_time(pid)
        if pid is None or started is None:
            self._known.pop(port, None)
        else:
            self._known[port] = (pid, started)
        return pid


def _start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def process_tree(pid: int) -> set[int]:
    """The process and all its descendants; empty when it is gone."""
    try:
        root = psutil.Process(pid)
        return {pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.Error:
        return set()


def command_service_pids(
    services: Sequence[ServiceConfig],
    find_listener: Callable[[int], int | None] = listening_pid,
    tree: Callable[[int], set[int]] = process_tree,
) -> dict[str, set[int]]:
    """For each `manager: command` service, the process tree of whatever listens on its URL's port."""
    found: dict[str, set[int]] = {}
    for service in services:
        if service.manager != "command":
            continue
        port = _port(service.health_url) or _port(service.effective_metrics_url)
        root = find_listener(port) if port is not None else None
        if root is not None:
            found[service.name] = tree(root)
    return found


def _owner(pid: int, unit: str | None, by_unit: Mapping[str, str], command_pids: Mapping[str, set[int]]) -> str | None:
    owner = by_unit.get(unit) if unit is not None else None
    if owner is None:
        owner = next((name for name, tree in command_pids.items() if pid in tree), None)
    return owner


def service_of_pid(
    pid: int,
    services: Sequence[ServiceConfig],
    paths: HostPaths,
    command_pids: Mapping[str, set[int]] | None = None,
) -> str | None:
    """The configured service process `pid` belongs to (its systemd unit, or the process tree of a
    `manager: command` service); None for anyone else's process or one that is gone."""
    by_unit = {s.unit_name: s.name for s in services if s.manager == "systemd"}
    unit = unit_of_pid(pid, paths)
    if unit is not None and unit in by_unit:
        return by_unit[unit]
    return _owner(pid, None, {}, command_service_pids(services) if command_pids is None else command_pids)


def attribute_gpu_processes(
    gpu_processes: Mapping[int, Sequence[GpuProcess]],
    uuids: Mapping[int, str],
    services: Sequence[ServiceConfig],
    paths: HostPaths,
    command_pids: Mapping[str, set[int]] | None = None,
) -> GpuAttribution:
    """Map each GPU's processes (`backend.compute_processes`) to services.

    `command_pids`: the PIDs of `manager: command` services (`command_service_pids`), computed by
    the caller so tests and the daemon choose how often to walk the process table.
    """
    by_unit = {s.unit_name: s.name for s in services if s.manager == "systemd"}
    memory: dict[str, dict[int, int]] = {}
    pids: dict[str, set[int]] = {}
    unattributed: list[GpuProcessInfo] = []
    for gpu, processes in sorted(gpu_processes.items()):
        for process in processes:
            unit = unit_of_pid(process.pid, paths)
            owner = _owner(process.pid, unit, by_unit, command_pids or {})
            if owner is None:
                info = GpuProcessInfo(
                    process.pid,
                    gpu,
                    uuids.get(gpu, ""),
                    process.used_memory_bytes,
                    unit,
                    command_of_pid(process.pid, paths),
                )
                unattributed.append(info)
                continue
            per_gpu = memory.setdefault(owner, {})
            per_gpu[gpu] = per_gpu.get(gpu, 0) + (process.used_memory_bytes or 0)
            pids.setdefault(owner, set()).add(process.pid)
    return GpuAttribution(
        memory_bytes=memory,
        pids={name: tuple(sorted(found)) for name, found in pids.items()},
        unattributed=tuple(unattributed),
    )
