"""One alert story, end to end: a fault matrix on two real agents (`gpu-agent run` on two simulated
H200 nodes, the shipped remediation rules, an sglang stand-in each), one real Prometheus with every
shipped rule file and one real Alertmanager with the shipped routes and inhibitions, its receivers
webhooks this test runs. The agents push their own alerts to the same Alertmanager.

Time is scaled: what the shipped files say in minutes runs in seconds here (their `for`, the windows
of their expressions, Alertmanager's group timings, the agents' `alerts.for_seconds`), rewritten in
copies of the shipped files, never in the files themselves.

Per fault it checks which alerts fire and with which severity, how many notifications each receiver
gets (one page per fault: the pager hears each critical fault once, never its consequences), and
how soon each alert resolves after the fix; the faults of each node run one after the other, the two
nodes side by side.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import DEFAULT_POLICY, RunningAgent, running_agent
from helpers import wait_until
from test_dashboard_prometheus import ALERTS, COMPAT_RULES, PROMETHEUS, RECORDING, Prometheus
from test_fleet_metrics_prometheus import host_tree

from agent.alerts.catalog import CATALOGUE
from agent.backend.sim import SimulatedBackend
from agent.demo.alertmanager_process import DemoAlertmanager, find_alertmanager
from agent.demo.standin_process import StandinServer, free_port
from agent.host.paths import HostPaths
from agent.watch.fake_kernel_log import append_kmsg

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = ROOT / "packaging/alertmanager/gpu-agent-alertmanager.yaml"
ALERTMANAGER = find_alertmanager()
#: A minute of the shipped files is a second here.
SCALE = 60
PROFILE = "h200x2"
SERVICE_GPU = 1  # each node's sglang runs on its GPU 1; GPU 0 takes the GPU faults
#: How soon after its fix an alert must be resolved at Alertmanager: the agent's next loop (0.5 s)
#: and its push, or a scrape and an evaluation of Prometheus (1 s each), with room for a busy host.
RESOLVE_SECONDS = 6.0
PAGER, TICKETS = "gpu-agent-pager", "gpu-agent-tickets"

pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs prometheus and prometheus-alertmanager (apt-get install prometheus prometheus-alertmanager)",
    ),
]


# -- the shipped files, time scaled --------------------------------------------------------------


def scaled_rules(source: Path, into: Path) -> Path:
    """`source` with every `for:` and every duration in its expressions a SCALE-th as long."""

    def shorter(match: re.Match[str]) -> str:
        seconds = int(match.group(2)) * {"m": 60, "h": 3600}[match.group(3)] // SCALE
        return f"{match.group(1)}{seconds}s"

    text = re.sub(r"(for: |\[|offset )(\d+)([mh])", shorter, source.read_text())
    target = into / source.name
    target.write_text(text)
    return target


def alertmanager_config(webhook: str) -> str:
    """The shipped snippet, its timings a SCALE-th (at least a second), each receiver a webhook."""
    config = yaml.safe_load(SNIPPET.read_text())
    config["route"].update(group_wait="1s", group_interval="2s", repeat_interval="1h")
    for receiver in config["receivers"]:
        receiver["webhook_configs"] = [{"url": f"{webhook}/{receiver['name']}", "send_resolved": True}]
    return yaml.safe_dump(config)


# -- the receiver: a webhook per Alertmanager receiver -------------------------------------------


@dataclass(frozen=True)
class Notification:
    at: float  # monotonic
    receiver: str
    status: str  # firing | resolved
    instance: str
    alerts: tuple[tuple[str, str], ...]  # (alertname, status)


class Webhooks:
    def __init__(self) -> None:
        self.received: list[Notification] = []
        self._lock = threading.Lock()
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with hooks._lock:
                    hooks.received.append(
                        Notification(
                            time.monotonic(),
                            self.path.strip("/"),
                            body["status"],
                            body["groupLabels"].get("instance", ""),
                            tuple((a["labels"]["alertname"], a["status"]) for a in body["alerts"]),
                        )
                    )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def announcing(self, receiver: str, instance: str, since: float, until: float) -> list[Notification]:
        """The notifications that told the receiver of an alert its last one did not list as firing:
        what a person is paged or ticketed for (a group's update that only resolves one of its alerts
        announces nothing)."""
        announced: list[Notification] = []
        before: set[str] = set()
        with self._lock:
            for n in self.received:
                if n.receiver != receiver or n.instance != instance:
                    continue
                firing = {name for name, status in n.alerts if status == "firing"}
                if firing - before and since <= n.at < until:
                    announced.append(n)
                before = firing
        return announced

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- a node --------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    directory: Path
    standin: StandinServer
    agent: RunningAgent
    instance: str = ""
    started: Callable[[RunningAgent], RunningAgent] | None = None  # its agent again: same config, port, state

    def cli(self, *args: str, codes: tuple[int, ...] = (0,)) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "agent.cli", *args, "--config", str(self.agent.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode in codes, result.stdout + result.stderr
        return result.stdout

    def gpu_states(self) -> list[tuple[str, str]]:
        return [(g["health"]["state"], g["health"]["reason"]) for g in self.agent.status()["gpus"]]


def agent_config(node: str, port: int, am: str) -> dict[str, Any]:
    """What differs from the harness's agent.yaml: where it pushes and how it labels, the shorter
    `for`s, and its one service on GPU 1."""
    return {
        "alerts": {
            "instance": "127.0.0.1:$PORT",
            "labels": {"cluster": "lab"},
            "for_seconds": {spec.name: spec.for_seconds / SCALE for spec in CATALOGUE if spec.for_seconds},
        },
        "services": [
            {
                "name": "sglang",
                "manager": "command",
                "start_command": ["/bin/true"],
                "stop_command": ["/bin/true"],
                "health_url": f"http://127.0.0.1:{port}/health",
                "gpus": [SERVICE_GPU],
                "probe_interval_seconds": 0.5,
                "scrape_interval_seconds": 0.5,
                "ready_timeout_seconds": 3,
                "slo": {"e2e_p95_seconds": 1.0, "window_seconds": 10},
            }
        ],
    }


@dataclass
class Story:
    prometheus: Prometheus
    alertmanager: DemoAlertmanager
    hooks: Webhooks
    nodes: dict[str, Node]
    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    def alerts(self, instance: str) -> dict[str, dict[str, Any]]:
        """Alertmanager's alerts of the node now (not resolved), by name with a distinguishing label."""
        query = urllib.parse.urlencode({"filter": f'instance="{instance}"'})
        with urllib.request.urlopen(f"{self.alertmanager.url}/api/v2/alerts?{query}", timeout=5) as response:
            found = json.load(response)
        return {_key(a["labels"]): a for a in found}

    def firing_in_prometheus(self, instance: str) -> set[str]:
        series = self.prometheus.query(f'ALERTS{{alertstate="firing",instance="{instance}"}}')
        return {_key(s["metric"]) for s in series}

    def wait_alerts(self, node: Node, wanted: set[str], timeout: float = 30.0) -> float:
        """Until every alert of `wanted` is at Alertmanager; how long that took."""
        began = time.monotonic()
        wait_until(
            lambda: wanted <= set(self.alerts(node.instance)),
            timeout,
            lambda: f"{wanted} at Alertmanager for {node.name}; it has {sorted(self.alerts(node.instance))}",
            poll_seconds=0.2,
        )
        return time.monotonic() - began

    def wait_clear(self, node: Node, names: set[str], timeout: float = RESOLVE_SECONDS) -> float:
        """Until none of `names` is at Alertmanager (resolved); how long that took."""
        began = time.monotonic()
        wait_until(
            lambda: not names & set(self.alerts(node.instance)),
            timeout,
            lambda: f"{names} resolved for {node.name}; Alertmanager has {sorted(self.alerts(node.instance))}",
            poll_seconds=0.2,
        )
        return time.monotonic() - began

    def note(self, fault: str, **figures: float) -> None:
        self.timings.setdefault(fault, {}).update(figures)


def _key(labels: dict[str, str]) -> str:
    """`GpuLost/0`: an alert's name and what tells two of a kind apart on a node."""
    which = labels.get("gpu") or labels.get("service") or labels.get("rule") or labels.get("collector") or ""
    return f"{labels['alertname']}/{which}" if which else labels["alertname"]


def severities(story: Story, node: Node) -> dict[str, str]:
    return {key: alert["labels"]["severity"] for key, alert in story.alerts(node.instance).items()}


def pages_and_tickets(story: Story, node: Node, since: float) -> tuple[int, int]:
    """The notifications the pager and the ticket receivers got about new alerts of the node since `since`."""
    until = time.monotonic()
    return (
        len(story.hooks.announcing(PAGER, node.instance, since, until)),
        len(story.hooks.announcing(TICKETS, node.instance, since, until)),
    )


def settle(story: Story, node: Node, seconds: float = 3.0) -> None:
    """Past the last notification of the node's group, so the next fault's are its own."""
    wait_until(lambda: not story.alerts(node.instance), 30.0, f"{node.name} without alerts")
    time.sleep(seconds)


# -- the fixture -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    with contextlib.ExitStack() as stack:
        hooks = Webhooks()
        stack.callback(hooks.close)
        assert ALERTMANAGER is not None
        am_dir = tmp_path_factory.mktemp("alertmanager")
        alertmanager = DemoAlertmanager(ALERTMANAGER, am_dir, alertmanager_config(hooks.url)).start()
        stack.callback(alertmanager.stop)
        rules = tmp_path_factory.mktemp("rules.d")
        for shipped in sorted((ROOT / "rules").glob("*.yaml")):
            (rules / shipped.name).write_text(shipped.read_text())
        nodes: dict[str, Node] = {}
        for name in ("node-a", "node-b"):
            directory = tmp_path_factory.mktemp(name)
            host_tree(directory, name)
            append_kmsg(HostPaths.at(str(directory / "host")), "test: the kernel log is there", level=6)
            port = free_port()
            standin_args = ("--sim-state-dir", str(directory / "state"), "--sim-profile", PROFILE)
            standin = StandinServer(directory, port, (*standin_args, "--gpus", str(SERVICE_GPU)))
            stack.enter_context(standin)
            extra = yaml.safe_dump(agent_config(name, port, alertmanager.url))

            def start(
                again: RunningAgent | None = None, directory: Path = directory, extra: str = extra
            ) -> RunningAgent:
                return stack.enter_context(
                    running_agent(
                        directory,
                        watchdog_usec=None,
                        again=again,
                        profile=PROFILE,
                        interval=0.5,
                        mode="enforce",
                        policy=DEFAULT_POLICY,
                        rules_dir=rules,
                        alertmanager_url=[alertmanager.url],
                        extra=extra,
                    )
                )

            agent = start()
            nodes[name] = Node(name, directory, standin, agent, f"127.0.0.1:{agent.port}", start)
        for node in nodes.values():
            node.agent.notifications.wait_for("READY", "1")
        prom_dir = tmp_path_factory.mktemp("prometheus")
        scaled = [scaled_rules(path, prom_dir) for path in (ALERTS, RECORDING, COMPAT_RULES)]
        prometheus = Prometheus(
            prom_dir,
            [node.agent.port for node in nodes.values()],
            scaled,
            target_labels={"cluster": "lab"},
            alertmanagers=[alertmanager.url.removeprefix("http://")],
        )
        stack.callback(prometheus.stop)
        story = Story(prometheus, alertmanager, hooks, nodes)
        prometheus.wait_for(
            "both agents scraped a few times",
            lambda: len(prometheus.query("count_over_time(gpu_agent_up[5s]) >= 3")) == 2,
            timeout_seconds=30.0,
        )
        for node in nodes.values():  # a clean start: nothing fires anywhere
            assert story.alerts(node.instance) == {}, story.alerts(node.instance)
        yield story
        for fault, figures in story.timings.items():
            print(f"{fault}: " + ", ".join(f"{k} {v:.1f} s" for k, v in figures.items()))


# -- the faults -------------------------------------------------------------------------------------


def thermal_slowdown(story: Story, node: Node) -> None:
    """A thermal slowdown: a warning (a ticket, no page) while it lasts; the degraded GPU is not
    another notification; resolved once the clocks are free."""
    began = time.monotonic()
    node.cli("inject", "throttle", "--gpu", "0", "--reason", "hw_thermal_slowdown")
    story.note("thermal slowdown", fired_after=story.wait_alerts(node, {"GpuThermalSlowdown/0"}))
    assert severities(story, node)["GpuThermalSlowdown/0"] == "warning"
    wait_until(lambda: pages_and_tickets(story, node, began) == (0, 1), 10.0, "one ticket for the slowdown")
    time.sleep(2.0)  # long enough for GpuDegraded (15 minutes: 15 s scaled) not to matter: it is inhibited
    node.cli("inject", "throttle", "--gpu", "0", "--clear")
    story.note("thermal slowdown", resolved_after=story.wait_clear(node, {"GpuThermalSlowdown/0", "GpuDegraded/0"}))
    assert pages_and_tickets(story, node, began) == (0, 1)
    settle(story, node)


def xid_48_reset(story: Story, node: Node) -> None:
    """A reset-class Xid: a page while the agent's reset waits for the GPU to drain; resolved at once
    when the reset is done, and `status` says the GPU is healthy again."""
    began = time.monotonic()
    node.cli("inject", "processes", "--gpu", "0", "4242")  # a process the reset must wait for
    node.cli("inject", "xid", "48", "--gpu", "0", "--source", "both")
    story.note("Xid 48 reset", fired_after=story.wait_alerts(node, {"GpuXidCritical/0"}))
    assert severities(story, node)["GpuXidCritical/0"] == "critical"
    wait_until(lambda: pages_and_tickets(story, node, began)[0] == 1, 10.0, "the page for the Xid")
    node.cli("inject", "processes", "--gpu", "0")  # drained: the reset goes on
    fixed = time.monotonic()
    wait_until(lambda: node.gpu_states()[0][0] == "healthy", 20.0, "GPU 0 healthy after its reset")
    story.note("Xid 48 reset", reset_took=time.monotonic() - fixed)
    story.note("Xid 48 reset", resolved_after=story.wait_clear(node, {"GpuXidCritical/0", "GpuUnhealthy/0"}))
    assert "reset_gpu on GPU 0 -> success" in node.cli("events", "--since", "1h")
    assert pages_and_tickets(story, node, began) == (1, 0)
    settle(story, node)


def uncorrectable_ecc(story: Story, node: Node) -> None:
    """Uncorrectable ECC errors: a page that keeps firing while the errors are there (no clock
    resolves it), resolved by the GPU reset that clears them (an operator's, here)."""
    began = time.monotonic()
    node.cli("inject", "ecc", "--gpu", "0", "--uncorrected", "1")
    story.note("uncorrectable ECC", fired_after=story.wait_alerts(node, {"GpuUncorrectableEcc/0"}))
    assert severities(story, node)["GpuUncorrectableEcc/0"] == "critical"
    time.sleep(8.0)  # past its `for`s and windows: still the fault, still firing
    assert "GpuUncorrectableEcc/0" in story.alerts(node.instance)
    assert "GpuUncorrectableEcc/0" in story.firing_in_prometheus(node.instance)
    backend = SimulatedBackend(PROFILE, node.directory / "state", writable_items={"gpu_reset"})
    backend.reset_gpu(0)  # nvidia-smi -r -i 0
    story.note("uncorrectable ECC", resolved_after=story.wait_clear(node, {"GpuUncorrectableEcc/0", "GpuUnhealthy/0"}))
    assert pages_and_tickets(story, node, began) == (1, 0)
    settle(story, node)


def board_xid(story: Story, node: Node) -> None:
    """Xid 79 in the kernel log (the board fell off the bus): one page, GpuXidCritical, while the
    reboot the agent recommends for it waits (inhibited: the recommendation raised the Xid's alert
    with it, so Alertmanager had the page first); the Xid acknowledged, the recommendation is a
    ticket until `gpu-agent ack reboot` withdraws it."""
    began = time.monotonic()
    node.cli("inject", "xid", "79", "--gpu", "0", "--source", "kmsg")
    story.note("Xid 79", fired_after=story.wait_alerts(node, {"GpuXidCritical/0", "GpuRebootRecommended"}))
    alerts = story.alerts(node.instance)
    assert alerts["GpuXidCritical/0"]["labels"]["severity"] == "critical"
    assert alerts["GpuRebootRecommended"]["status"]["state"] == "suppressed"  # inhibited by the Xid's page
    time.sleep(4.0)  # past group_wait and a group_interval: nothing else goes out
    assert pages_and_tickets(story, node, began) == (1, 0), story.hooks.received
    node.cli("ack", "xid:79@0")
    story.note("Xid 79", resolved_after=story.wait_clear(node, {"GpuXidCritical/0", "GpuUnhealthy/0"}))
    wait_until(lambda: pages_and_tickets(story, node, began) == (1, 1), 10.0, "the reboot recommendation's ticket")
    assert "reboot recommendation withdrawn" in node.cli("ack", "reboot")
    story.wait_clear(node, {"GpuRebootRecommended"})
    assert pages_and_tickets(story, node, began) == (1, 1)
    settle(story, node)


def slo_breach(story: Story, node: Node) -> None:
    """The service's p95 over its objective, the cause a thermal slowdown of its GPU: warnings
    only, no page; resolved once the slow requests have left the window (10 s here)."""
    began = time.monotonic()
    node.cli("inject", "throttle", "--gpu", str(SERVICE_GPU), "--reason", "hw_thermal_slowdown")
    wanted = {"InferenceLatencyAboveSlo/sglang", f"GpuThermalSlowdown/{SERVICE_GPU}"}
    story.note("SLO breach", fired_after=story.wait_alerts(node, wanted, timeout=40.0))
    alerts = story.alerts(node.instance)
    assert {key: alerts[key]["labels"]["severity"] for key in wanted} == dict.fromkeys(wanted, "warning")
    # the cause is the agent's: in its verdict, and in its push's `event` (Prometheus' copy has the rule's text)
    attention = " ".join(node.agent.status()["verdict"]["attention"])
    assert f"likely cause: GPU {SERVICE_GPU} thermal slowdown" in attention, attention
    node.cli("inject", "throttle", "--gpu", str(SERVICE_GPU), "--clear")
    story.note("SLO breach", resolved_after=story.wait_clear(node, wanted, timeout=25.0))
    pages, tickets = pages_and_tickets(story, node, began)
    # the two warnings start apart: two tickets at most (one with Alertmanager's 5 min group_interval)
    assert pages == 0 and 1 <= tickets <= 2, story.hooks.received


def app_xid(story: Story, node: Node) -> None:
    """An app-level Xid whose service the agent restarted: no page, and nothing left open (not a
    degraded GPU for an hour) a loop or two after the restart."""
    began = time.monotonic()
    pid = node.standin.proc.pid if node.standin.proc is not None else 0
    node.cli("inject", "xid", "13", "--gpu", str(SERVICE_GPU), "--source", "kmsg", "--pid", str(pid))
    wait_until(
        lambda: "xid-restart-service: restart_service on sglang -> success" in node.cli("events", "--since", "1h"),
        20.0,
        "the service restarted",
    )
    restarted = time.monotonic()
    wait_until(lambda: node.gpu_states()[SERVICE_GPU][0] == "healthy", 5.0, "the GPU healthy after the restart")
    story.note("app Xid remediated", healthy_after_restart=time.monotonic() - restarted)
    time.sleep(3.0)
    assert story.alerts(node.instance) == {}
    degraded = story.prometheus.query(
        f'max_over_time(ALERTS{{alertname="GpuDegraded",alertstate="firing",instance="{node.instance}"}}[30s])'
    )
    assert degraded == []
    assert pages_and_tickets(story, node, began)[0] == 0
    settle(story, node)


def lost_gpu(story: Story, node: Node) -> None:
    """A GPU fell off the bus: one page (GpuLost), its unhealthy state and the reboot it needs
    inhibited; back on the bus, GpuLost resolves and the reboot recommendation is a ticket until
    `gpu-agent ack reboot` withdraws it."""
    began = time.monotonic()
    node.cli("inject", "lost", "--gpu", "0")
    story.note("lost GPU", fired_after=story.wait_alerts(node, {"GpuLost/0", "GpuRebootRecommended"}))
    alerts = story.alerts(node.instance)
    assert alerts["GpuLost/0"]["labels"]["severity"] == "critical"
    assert alerts["GpuRebootRecommended"]["status"]["state"] == "suppressed"  # inhibited by GpuLost
    time.sleep(6.0)  # GpuUnhealthy's `for` (5 s) passes: inhibited too
    assert pages_and_tickets(story, node, began) == (1, 0)
    node.cli("inject", "lost", "--gpu", "0", "--clear")
    story.note("lost GPU", resolved_after=story.wait_clear(node, {"GpuLost/0", "GpuUnhealthy/0"}))
    wait_until(lambda: pages_and_tickets(story, node, began) == (1, 1), 10.0, "the reboot recommendation's ticket")
    assert "`gpu-agent ack reboot`" in node.cli("status", codes=(2,))  # attention: how it clears
    acked = time.monotonic()
    assert "reboot recommendation withdrawn" in node.cli("ack", "reboot")
    story.note("lost GPU", reboot_ack_resolved_after=story.wait_clear(node, {"GpuRebootRecommended"}))
    assert time.monotonic() - acked < RESOLVE_SECONDS
    assert pages_and_tickets(story, node, began) == (1, 1)
    settle(story, node)


def service_down(story: Story, node: Node) -> None:
    """The service stops answering and the agent's restart does not help: one page for the service,
    one ticket for the failing rule (its latency and metrics alerts inhibited); the service back, its
    alert resolves; the rule's stays until the next success or an ack."""
    began = time.monotonic()
    node.standin.set_mode("503")
    wanted = {"InferenceServiceDown/sglang", "GpuAgentRemediationFailing/service-unhealthy-restart"}
    story.note("service down", fired_after=story.wait_alerts(node, wanted))
    assert {k: v for k, v in severities(story, node).items() if k in wanted} == {
        "InferenceServiceDown/sglang": "critical",
        "GpuAgentRemediationFailing/service-unhealthy-restart": "warning",
    }
    wait_until(lambda: pages_and_tickets(story, node, began) == (1, 1), 10.0, "a page and a ticket")
    node.standin.set_mode("ok")
    story.note("service down", resolved_after=story.wait_clear(node, {"InferenceServiceDown/sglang"}))
    time.sleep(3.0)
    assert "GpuAgentRemediationFailing/service-unhealthy-restart" in story.alerts(node.instance)
    node.cli("ack", "service-unhealthy-restart")
    story.note("service down", ack_resolved_after=story.wait_clear(node, wanted))
    assert pages_and_tickets(story, node, began) == (1, 1)
    settle(story, node)


def agent_killed(story: Story, node: Node) -> None:
    """The agent dies with a fault open on its node: GpuAgentDown pages within seconds (minutes at
    scale), the open alert keeps firing meanwhile (inhibited), the fleet counts the node's GPUs as
    missing from its last inventory; started again, nothing pages twice and the rule the operator
    acknowledged before does not fire again."""
    opened = time.monotonic()
    node.cli("inject", "throttle", "--gpu", "0", "--reason", "hw_thermal_slowdown")
    story.wait_alerts(node, {"GpuThermalSlowdown/0"})
    wait_until(lambda: pages_and_tickets(story, node, opened) == (0, 1), 10.0, "the slowdown's ticket")
    began = time.monotonic()
    node.agent.process.send_signal(signal.SIGKILL)
    node.agent.process.wait(timeout=10)
    story.note("agent killed", paged_after=story.wait_alerts(node, {"GpuAgentDown"}, timeout=15.0))
    assert severities(story, node)["GpuAgentDown"] == "critical"
    wait_until(lambda: pages_and_tickets(story, node, began)[0] == 1, 10.0, "the page for the dead agent")
    assert "GpuThermalSlowdown/0" in story.firing_in_prometheus(node.instance)  # kept firing a while
    assert story.alerts(node.instance)["GpuThermalSlowdown/0"]["status"]["state"] == "suppressed"
    fleet = story.prometheus
    assert fleet.query("sum(fleet:gpu_agent_gpus_expected:missing)")[0]["value"][1] == "2"
    assert fleet.query("sum(fleet:gpu_agent_nodes:not_reporting)")[0]["value"][1] == "1"
    assert fleet.query('sum(fleet:gpu_agent_gpus:by_state{state="missing"})')[0]["value"][1] == "2"
    assert node.started is not None
    node.agent = node.started(node.agent)
    node.agent.notifications.wait_for("READY", "1")
    story.note("agent killed", resolved_after_restart=story.wait_clear(node, {"GpuAgentDown"}, timeout=15.0))
    time.sleep(4.0)
    assert "GpuAgentRemediationFailing/service-unhealthy-restart" not in story.firing_in_prometheus(node.instance)
    assert "GpuThermalSlowdown/0" in story.alerts(node.instance)  # the same alert, still open
    node.cli("inject", "throttle", "--gpu", "0", "--clear")
    story.wait_clear(node, {"GpuThermalSlowdown/0"})
    assert pages_and_tickets(story, node, began) == (1, 0)  # nothing new about the slowdown: the same alert


def test_the_fault_matrix(story: Story) -> None:
    began = time.monotonic()
    a, b = story.nodes["node-a"], story.nodes["node-b"]

    def run(node: Node, faults: list[Callable[[Story, Node], None]]) -> None:
        for fault in faults:
            fault(story, node)

    with ThreadPoolExecutor(2) as pool:
        done = [
            pool.submit(run, a, [thermal_slowdown, xid_48_reset, uncorrectable_ecc, board_xid, slo_breach]),
            pool.submit(run, b, [app_xid, lost_gpu, service_down, agent_killed]),
        ]
        for future in done:
            future.result()
    story.note("the matrix", took=time.monotonic() - began)
