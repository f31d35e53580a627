"""GPU processes to services: systemd units from a fake /proc tree under host_root, command services
through the real process listening on their port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.backend.base import GpuProcess
from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import StandinServer, free_port
from agent.host.paths import HostPaths
from agent.services.attribution import (
    Listeners,
    attribute_gpu_processes,
    command_service_pids,
    listening_pid,
    process_tree,
    service_of_pid,
    unit_of_pid,
)
from agent.state import GpuProcessInfo

GIB = 1024**3


def fake_proc(root: Path, pid: int, cgroup: str, comm: str) -> None:
    directory = root / "proc" / str(pid)
    directory.mkdir(parents=True)
    (directory / "cgroup").write_text(cgroup)
    (directory / "comm").write_text(comm + "\n")


def host_tree(tmp_path: Path) -> HostPaths:
    fake_proc(tmp_path, 100, "0::/system.slice/sglang.service\n", "python3")
    fake_proc(
        tmp_path,
        200,
        "12:pids:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n",
        "VLLM::EngineCor",
    )
    fake_proc(tmp_path, 300, "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n", "python")
    fake_proc(tmp_path, 500, "0::/system.slice/docker-4f1c.scope\n", "python")
    return HostPaths.at(tmp_path)


def test_unit_of_pid_reads_cgroup_v2_and_v1_under_host_root(tmp_path: Path) -> None:
    paths = host_tree(tmp_path)
    assert unit_of_pid(100, paths) == "sglang.service"
    assert unit_of_pid(200, paths) == "vllm.service"
    assert unit_of_pid(300, paths) == "jupyter.service"  # the innermost service, not user@1000.service
    assert unit_of_pid(500, paths) is None  # a container scope is no service
    assert unit_of_pid(999, paths) is None  # gone


def test_processes_map_to_systemd_services_and_the_rest_is_listed(tmp_path: Path) -> None:
    paths = host_tree(tmp_path)
    services = [
        ServiceConfig(name="sglang", unit="sglang.service"),
        ServiceConfig(name="vllm"),  # unit defaults to vllm.service
    ]
    processes = {
        0: [GpuProcess(100, 40 * GIB), GpuProcess(300, 1 * GIB)],
        1: [GpuProcess(100, 40 * GIB), GpuProcess(200, 30 * GIB), GpuProcess(400, None)],
    }
    found = attribute_gpu_processes(processes, {0: "GPU-a", 1: "GPU-b"}, services, paths)
    assert found.memory_bytes == {"sglang": {0: 40 * GIB, 1: 40 * GIB}, "vllm": {1: 30 * GIB}}
    assert found.pids == {"sglang": (100,), "vllm": (200,)}
    assert found.unattributed == (
        GpuProcessInfo(300, 0, "GPU-a", 1 * GIB, "jupyter.service", "python"),
        GpuProcessInfo(400, 1, "GPU-b", None, None, ""),
    )


def test_a_command_service_owns_the_tree_of_the_process_on_its_port(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        assert server.proc is not None
        service = ServiceConfig.model_validate(
            {
                "name": "standin",
                "manager": "command",
                "start_command": ["/bin/true"],
                "stop_command": ["/bin/true"],
                "health_url": server.health_url,
            }
        )
        assert listening_pid(server.port) == server.proc.pid
        command_pids = command_service_pids([service])
        assert command_pids == {"standin": {server.proc.pid}}
        processes = {2: [GpuProcess(server.proc.pid, 12 * GIB), GpuProcess(os.getpid(), 1 * GIB)]}
        found = attribute_gpu_processes(processes, {2: "GPU-c"}, [service], HostPaths.at(tmp_path), command_pids)
    assert found.memory_bytes == {"standin": {2: 12 * GIB}}
    assert [p.pid for p in found.unattributed] == [os.getpid()]
    assert listening_pid(free_port()) is None


def test_the_listener_of_a_port_is_looked_for_again_only_when_it_is_gone(tmp_path: Path) -> None:
    """Finding who listens on a port scans every process's sockets: done once while that process lives."""
    scans: list[int] = []

    def scan(port: int) -> int | None:
        scans.append(port)
        return listening_pid(port)

    listeners = Listeners(scan)
    with StandinServer(tmp_path) as server:
        assert server.proc is not None
        first = server.proc.pid
        assert [listeners(server.port) for _ in range(3)] == [first] * 3
        assert scans == [server.port]
        port = server.port
    # the server is gone: looked for again, and nobody listens
    assert listeners(port) is None
    assert scans == [port, port]
    assert listeners(port) is None
    assert scans == [port, port, port]  # nothing to remember


def test_process_tree_includes_descendants() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= process_tree(os.getpid())
        assert process_tree(child.pid) == {child.pid}
    finally:
        child.kill()
        child.wait()
    assert process_tree(child.pid) == set()


def test_a_process_that_exited_leaves_the_list_at_once(tmp_path: Path) -> None:
    """The mapping is refreshed every 30 s; a process that exits in between is off the GPU (NVML
    lists it no more) and leaves what status shows now, not at the next refresh."""
    from agent.backend.sim import SimulatedBackend
    from agent.config import AgentConfig
    from agent.services.monitor import GpuAttributor

    gpus = SimulatedBackend("h200x2", tmp_path / "sim")
    gpus.init()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gpus.set_processes(0, [child.pid, os.getpid()])
        attributor = GpuAttributor(AgentConfig(host_root=str(tmp_path)), lambda: gpus, interval_seconds=3600)
        found = attributor.attribute_once()
        assert found is not None and {p.pid for p in found.unattributed} == {child.pid, os.getpid()}
        child.kill()
        child.wait()
        latest = attributor.latest()
        assert latest is not None and [p.pid for p in latest.unattributed] == [os.getpid()]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        gpus.shutdown()


def test_service_of_pid_names_whose_process_faulted(tmp_path: Path) -> None:
    paths = host_tree(tmp_path)
    services = [ServiceConfig(name="sglang", unit="sglang.service"), ServiceConfig(name="vllm")]
    assert service_of_pid(100, services, paths, command_pids={}) == "sglang"
    assert service_of_pid(200, services, paths, command_pids={}) == "vllm"
    assert service_of_pid(300, services, paths, command_pids={}) is None  # someone's notebook
    assert service_of_pid(999, services, paths, command_pids={}) is None  # gone
    with StandinServer(tmp_path) as server:
        assert server.proc is not None
        command = ServiceConfig.model_validate(
            {
                "name": "standin",
                "manager": "command",
                "start_command": ["/bin/true"],
                "stop_command": ["/bin/true"],
                "health_url": server.health_url,
            }
        )
        assert service_of_pid(server.proc.pid, [command], paths) == "standin"
        assert service_of_pid(os.getpid(), [command], paths) is None
