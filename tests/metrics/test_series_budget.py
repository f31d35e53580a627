"""What a node costs a fleet in series, on a real daemon: the simulated 8x H200 HGX node (18 NVLink
links a GPU) with one service stays within the series budget by default, a reload switches families,
and a run of faults, service and agent restarts and acks does not make labels churn.

The bound on labels, stated: over two identical cycles of faults, restarts and acks, every series
seen has the label names and identity values (GPU, uuid, link, service, bucket, process name, ...)
the first cycle showed; the labels that say a state (state, cause, status, action, reason) take
their values from the agent's bounded vocabularies; no label is a pid or free text. A GPU
acknowledged gone leaves no series, a service removed by a reload leaves none.

One daemon session per module (restarted once per cycle), a short loop, one stand-in server.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon_harness import RunningAgent, command_service, running_agent
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from agent.backend.base import CLOCK_EVENT_REASONS, VIOLATION_REASONS
from agent.demo.standin_process import StandinServer, free_port
from agent.events import EventKind, FaultCause, HealthState
from agent.policy.plan import PlanStatus
from agent.rules.actions.registry import KINDS
from agent.verdict import AttentionCause, NodeProblem
from bench.metrics_series import SERIES_BUDGET

pytestmark = pytest.mark.real_daemon

GPUS = 8
POLICY = """\
  node: {transparent_hugepages: never}
  gpus:
    - match: {model: "NVIDIA H200*"}
      power_limit_watts: 600
      persistence: enabled
"""
#: Labels that say a state: their values come from the agent's own vocabularies, never from outside.
STATE_LABELS = frozenset({"state", "cause", "status", "action", "reason"})
BOOT_CAUSES = {"none", "no_kernel", "module_missing", "module_version", "module_unsigned", "no_initramfs"}
VOCABULARY: dict[str, frozenset[str]] = {
    "state": frozenset(s.value for s in HealthState)
    | frozenset(("not_supported", "not_started", "in_progress", "completed")),
    "cause": frozenset(c.value for c in FaultCause)
    | frozenset(c.value for c in AttentionCause)
    | frozenset(p.value for p in NodeProblem)
    | frozenset(k.value for k in EventKind)
    | frozenset(BOOT_CAUSES | {"none", "unknown", "unreadable", "correctable", "uncorrectable", "initramfs_nouveau"}),
    "status": frozenset(s.value for s in PlanStatus),
    "action": frozenset(KINDS) | frozenset(("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")),
    "reason": frozenset(CLOCK_EVENT_REASONS.values()) | frozenset(VIOLATION_REASONS) | frozenset(("power", "thermal")),
}

Series = tuple[str, frozenset[tuple[str, str]]]


def series_of(text: str) -> set[Series]:
    return {
        (sample.name, frozenset(sample.labels.items()))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def identity(found: Series) -> Series:
    """A series without its state labels: what must not change between cycles."""
    name, labels = found
    return name, frozenset((key, value) for key, value in labels if key not in STATE_LABELS)


@dataclass
class Node:
    directory: Path
    service_port: int
    standin: StandinServer
    agent: RunningAgent | None = None
    seen: list[set[Series]] = field(default_factory=list)  # per cycle
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def start_agent(self, extra: str = "") -> RunningAgent:
        agent = self.stack.enter_context(
            running_agent(
                self.directory,
                watchdog_usec=None,
                profile="h200x8",
                interval=0.5,
                policy=POLICY + command_service(self.service_port),
                extra=extra,
            )
        )
        agent.notifications.wait_for("READY", "1", timeout_seconds=60)
        self.agent = agent
        return agent

    def stop_agent(self) -> None:
        assert self.agent is not None
        self.agent.signal(signal.SIGTERM)
        self.agent.process.wait(timeout=30)

    def metrics(self) -> str:
        assert self.agent is not None
        return self.agent.metrics()

    def record(self) -> set[Series]:
        found = series_of(self.metrics())
        self.seen[-1] |= found
        return found

    def inject(self, *args: str) -> None:
        assert self.agent is not None
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli", *args, "--config", str(self.agent.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr

    def watch(self, seconds: float) -> None:
        """Scrape as Prometheus would, every half second, for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.record()
            time.sleep(0.5)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    directory = tmp_path_factory.mktemp("hgx")
    port = free_port()
    standin_args = ("--flavor", "sglang", "--sim-state-dir", str(directory / "state"), "--sim-profile", "h200x8")
    standin_args += ("--gpus", ",".join(str(gpu) for gpu in range(GPUS)))
    standin = StandinServer(directory, port=port, extra_args=standin_args)
    found = Node(directory, port, standin)
    with found.stack:
        found.stack.enter_context(standin)
        found.start_agent()
        wait_until(
            lambda: all(
                name in found.metrics()
                for name in (
                    "gpu_agent_service_request_duration_seconds_bucket",
                    "gpu_agent_service_gpu_energy_joules_total",
                    "gpu_agent_service_gpu_memory_bytes",
                )
            ),
            60.0,
            "the service's histograms, energy and GPU memory in the scrape",
            poll_seconds=0.5,
        )
        yield found


def test_the_default_scrape_of_an_hgx_node_with_a_service_fits_the_budget(node: Node) -> None:
    scraped = series_of(node.metrics())
    assert len(scraped) <= SERIES_BUDGET, len(scraped)
    names = {name for name, _ in scraped}
    # nothing of what matters is missing: the verdicts, the readings dcgm-exporter shows, the service
    for expected in (
        "gpu_agent_gpu_health",
        "gpu_agent_gpu_temperature_celsius",
        "gpu_agent_gpu_graphics_active_ratio",
        "gpu_agent_gpu_memory_free_bytes",
        "gpu_agent_gpu_xid_errors_total",
        "gpu_agent_node_info",
        "gpu_agent_service_request_duration_seconds_bucket",
        "gpu_agent_service_generated_tokens_total",
    ):
        assert expected in names, expected
    # 18 links on each of 8 GPUs, all up and clean: no per-link series, no counter that counted nothing
    assert names & {"gpu_agent_gpu_nvlink_up", "gpu_agent_gpu_nvlink_link_errors_total"} == set()
    assert "gpu_agent_gpu_nvlink_errors_total" not in names


def cycle(node: Node) -> None:
    """One round of faults, restarts and acks. Two processes of no service hold GPU 4, new ones (new
    pids) each round, as a notebook started again would."""
    node.seen.append(set())
    node.record()
    strays = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    node.stack.callback(lambda: [stray.kill() for stray in strays])
    proc = node.directory / "host" / "proc"
    for stray in strays:
        (proc / str(stray.pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(stray.pid) / "comm").write_text("python3\n")
    node.inject("inject", "processes", "--gpu", "4", *(str(stray.pid) for stray in strays))
    node.inject("inject", "temperature", "--gpu", "2", "--celsius", "93")
    node.inject("inject", "throttle", "--gpu", "2", "--reason", "hw_thermal_slowdown")
    node.inject("inject", "xid", "48", "--gpu", "3", "--source", "nvml")
    node.inject("inject", "ecc", "--gpu", "5", "--uncorrected", "1")
    node.watch(4.0)
    node.inject("inject", "temperature", "--gpu", "2", "--clear")
    node.inject("inject", "throttle", "--gpu", "2", "--clear")
    # the service restarts (its counters start again from 0) and so does the agent
    node.standin.stop()
    node.standin.start()
    node.stop_agent()
    node.start_agent()
    node.watch(3.0)
    node.inject("inject", "lost", "--gpu", "6")
    node.watch(3.0)
    node.inject("ack", "gpu:6")
    wait_until(
        lambda: 'gpu="6"' not in node.metrics(), 20.0, "GPU 6 gone from /metrics after its ack", poll_seconds=0.5
    )
    gone = node.metrics()
    uuid6 = next(
        dict(labels)["uuid"]
        for name, labels in node.seen[-1]
        if name == "gpu_agent_gpu_info" and dict(labels)["gpu"] == "6"
    )
    assert uuid6 not in gone, "a series of the GPU acknowledged gone lingers"
    node.inject("ack", "gpu:3")
    node.inject("inject", "lost", "--gpu", "6", "--clear")
    wait_until(lambda: 'gpu_agent_gpu_up{gpu="6"' in node.metrics(), 30.0, "GPU 6 back", poll_seconds=0.5)
    node.watch(3.0)
    for stray in strays:
        stray.kill()
        stray.wait()


def test_labels_never_churn_over_faults_restarts_and_acks(node: Node) -> None:
    cycle(node)
    cycle(node)
    first, second = node.seen
    every = first | second
    for name, labels in every:
        keys = {key for key, _ in labels}
        assert "pid" not in keys and "kernel" not in keys, (name, labels)
        for key, value in labels:
            if key in STATE_LABELS:
                assert value in VOCABULARY[key], (name, key, value)
            if key == "gpu":
                assert value in {"", *map(str, range(GPUS))}, (name, value)
    new = {identity(found) for found in second} - {identity(found) for found in first}
    assert new == set(), f"the second cycle added label sets: {sorted(new)[:10]}"
    # the processes of no service: by command name, however many pids came and went
    processes = {
        dict(labels).get("process") for name, labels in every if name == "gpu_agent_gpu_unattributed_memory_bytes"
    }
    assert processes == {"python3"}


def test_a_reload_switches_families_and_removing_a_service_leaves_no_series(node: Node) -> None:
    assert node.agent is not None
    config = node.agent.config_path
    text = config.read_text()
    listen = next(line for line in text.splitlines() if line.startswith("metrics:"))
    config.write_text(text.replace(listen, listen.rstrip("}") + ", families: {nvlink_links: true}}"))
    node.agent.signal(signal.SIGHUP)
    wait_until(
        lambda: sum(1 for name, _ in series_of(node.metrics()) if name == "gpu_agent_gpu_nvlink_up") == GPUS * 18,
        20.0,
        "every link of every GPU listed once nvlink_links is on",
        poll_seconds=0.5,
    )
    head, _, _ = config.read_text().partition("services:")
    config.write_text(head)  # the service removed
    node.agent.signal(signal.SIGHUP)
    wait_until(
        lambda: 'service="sglang"' not in node.metrics(), 20.0, "no series of the removed service", poll_seconds=0.5
    )
