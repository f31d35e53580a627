"""The Grafana dashboard and the Prometheus alert rules, checked with real Prometheus parts.

- promtool checks the rules and runs the unit tests in tests/prometheus/ (one firing and one
  quiet case per alert, checked here).
- A real `prometheus` server scrapes the real metrics server, which serves snapshots that a
  stand-in for the daemon loop takes from the simulated backend (mixed node, throttling, an Xid,
  policy drift, a service down); every dashboard expression must return data there, and the
  alert rules must load, evaluate cleanly and reach the states the faults call for.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import wait_until
from prometheus_client import CollectorRegistry, generate_latest
from snapshots import inference_fields, node_snapshot, snapshot_from_backend, telemetry_gpus

from agent.backend.base import RecoveryAction
from agent.backend.errors import GpuErrorKind
from agent.backend.sim import SimulatedBackend
from agent.events import FaultCause, Health, HealthState
from agent.metrics.collector import SnapshotCollector
from agent.metrics.server import MetricsServer
from agent.names.metric_families import FamilySwitches
from agent.policy import power_limit
from agent.policy.base import GpuContext
from agent.policy.plan import ItemPlan, PlanStatus
from agent.state import (
    CollectorStatus,
    GpuSample,
    NodeSnapshot,
    RemediationCount,
    RemediationFailing,
    ServiceStatus,
    XidCount,
)
from agent.watch.clock_events import SLOWDOWN_REASONS, decode
from agent.watch.gpu_health import combine
from agent.watch.xid_catalog import all_codes, lookup

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "packaging/grafana/gpu-agent-dashboard.json"
ALERTS = ROOT / "packaging/prometheus/gpu-agent-alerts.yaml"
COMPAT_RULES = ROOT / "packaging/prometheus/gpu-agent-dcgm-compat.yaml"
RULE_TESTS = sorted((ROOT / "tests/prometheus").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus server not installed (apt-get install prometheus)"
)

#: What Grafana would put in for the template variables: every job and cluster, the node (one), every
#: GPU, 1m windows.
TEMPLATE_VALUES = {
    "job": ".*",
    "cluster": ".*",
    "instance": "gpu-node-1:9481",
    "gpu": ".*",
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
}
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")
#: A series the agent exports (not a recording rule's `level:gpu_agent_...:operation`).
METRIC_NAME = re.compile(r"(?<![:\w])gpu_agent_\w+(?![:\w])")


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) for every PromQL expression and variable query in the dashboard."""
    board = dashboard()
    queries = [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"])
        for panel in all_panels(board["panels"])
        for target in panel.get("targets", [])
    ]
    queries += [(f"annotation {a['name']!r}", a["expr"]) for a in board["annotations"]["list"] if "expr" in a]
    queries += [
        (f"variable {var['name']!r}", var["query"]["query"])
        for var in board["templating"]["list"]
        if var["type"] == "query"
    ]
    return queries


def substitute(expr: str, instance: str = TEMPLATE_VALUES["instance"]) -> str:
    """`expr` as Grafana sends it with `instance` chosen."""
    values = {**TEMPLATE_VALUES, "instance": instance}
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def node_of(prom: Prometheus) -> str:
    """The instance label of the one node `prom` scrapes."""
    (series,) = prom.query("gpu_agent_up")
    return str(series["metric"]["instance"])


def exported_metric_names() -> set[str]:
    """Sample names the collector exports for the fully featured test snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    snapshot = node_snapshot(gpus=telemetry_gpus(), **inference_fields())
    registry.register(SnapshotCollector(lambda: snapshot, switches=FamilySwitches.everything()))
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


# -- static checks (no Prometheus needed) -------------------------------------------------------


def test_dashboard_structure() -> None:
    board = dashboard()
    assert board["uid"] == "gpu-agent"
    assert 36 <= board["schemaVersion"] <= 41
    variables = {var["name"]: var for var in board["templating"]["list"]}
    assert list(variables) == ["DS_PROMETHEUS", "job", "cluster", "instance", "gpu"]
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("job", "cluster", "instance", "gpu"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for name in ("job", "cluster", "gpu"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    # the rows under the Fleet row are one node's: its GPUs, never 8,000 lines of a fleet's
    assert not variables["instance"]["includeAll"] and not variables["instance"]["multi"]
    first = board["panels"][0]
    assert first["type"] == "row" and first["title"].startswith("Fleet") and first["gridPos"]["y"] == 0
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].strip()
        assert panel.get("description"), f"panel {panel['title']!r} needs a description"


def test_dashboard_covers_what_the_brief_asks_for() -> None:
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for name in (
        "gpu_agent_gpu_temperature_celsius",
        "gpu_agent_gpu_power_usage_watts",
        "gpu_agent_gpu_power_limit_watts",
        "gpu_agent_gpu_clock_hertz",
        "gpu_agent_gpu_throttled",
        "gpu_agent_gpu_clock_event_seconds_total",
        "gpu_agent_gpu_health_info",
        "gpu_agent_gpu_pcie_degraded",
        "gpu_agent_policy_drift",
        "gpu_agent_reboot_recommended",
        "gpu_agent_node_problem",
        "gpu_agent_remediation_outcomes_total",
        "gpu_agent_gpu_xid_errors_total",
        "gpu_agent_xid_errors_total",
        "gpu_agent_gpu_ecc_errors_total",
        "gpu_agent_gpu_remapped_rows",
        "gpu_agent_policy_targets",
        "gpu_agent_service_up",
        "gpu_agent_remediations_total",
        "gpu_agent_collector_success",
        "gpu_agent_service_request_duration_seconds_bucket",
        "gpu_agent_service_latency_slo_seconds",
        "gpu_agent_service_requests_running",
        "gpu_agent_service_requests_waiting",
        "gpu_agent_service_kv_cache_usage_ratio",
        "gpu_agent_service_generated_tokens_total",
        "gpu_agent_service_gpu_energy_joules_total",
        "gpu_agent_service_gpu_memory_bytes",
    ):
        assert name in exprs


def test_every_metric_name_used_is_exported() -> None:
    """A typo in a dashboard or alert expression would silently show nothing: every name must exist."""
    exported = exported_metric_names()
    used = set(METRIC_NAME.findall(" ".join(expr for _, expr in dashboard_queries())))
    used |= set(METRIC_NAME.findall(" ".join(rule["expr"] for rule in alert_rules())))
    assert used - exported == set()


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert "{{ $labels.instance }}" in rule["annotations"]["summary"], rule["alert"]
    assert {
        "GpuAgentDown",
        "GpuLost",
        "GpuXidCritical",
        "GpuThermalSlowdown",
        "GpuPowerBrake",
        "GpuUncorrectableEcc",
        "GpuRowRemapFailed",
        "GpuRowRemapPending",
        "GpuPcieDegraded",
        "GpuPolicyDrift",
        "InferenceServiceDown",
        "GpuAgentCollectorFailing",
        "GpuAgentRemediationFailing",
        "GpuStale",
        "InferenceLatencyAboveSlo",
        "InferenceMetricsUnreadable",
        "InferenceKvCacheNearFull",
    } <= set(names)


def test_xid_alerts_follow_the_catalog_by_reference() -> None:
    """The alerts select codes by the catalog classification the agent exports, so no code list is
    copied into them; the exported classification is the catalog's for every code."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for name, severities in (("GpuXidCritical", '=~"critical|fatal"'), ("GpuXidError", '=~"warning"')):
        expr = rules[name]["expr"]
        assert f"gpu_agent_xid_catalog_info{{severity{severities}}}" in expr, name
        assert not re.search(r"xid\s*[=!]", expr), f"{name} still lists Xid codes: {expr}"
    unknown_code = 999
    assert lookup(unknown_code) is None
    codes = [*all_codes(), unknown_code]
    snapshot = replace(node_snapshot(), xids=tuple(XidCount(0, "GPU-0", code, 1, 1.0) for code in codes))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    exported = {
        sample.labels["xid"]: (sample.labels["severity"], sample.labels["action"])
        for family in registry.collect()
        if family.name == "gpu_agent_xid_catalog_info"
        for sample in family.samples
    }
    expected = {}
    for code in all_codes():
        info = lookup(code)
        assert info is not None
        expected[str(code)] = (info.severity, info.action.value)
    expected[str(unknown_code)] = ("warning", "alert")  # what the catalog says of a code it lacks
    assert exported == expected


@needs_promtool
def test_promtool_check_rules() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout
    assert "WARNING" not in proc.stdout + proc.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    assert PROMTOOL is not None
    assert RULE_TESTS
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", *map(str, RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(RULE_TESTS)


# -- a real Prometheus scraping the real metrics server ------------------------------------------

LOOP_PERIOD_SECONDS = 0.25


class StandInLoop:
    """What the daemon does, reduced to what metrics need: sample the simulated node every period,
    account throttle time and Xids, publish a new frozen snapshot by swapping one reference."""

    def __init__(self, backend: SimulatedBackend, policy: tuple[ItemPlan, ...], faulty: bool = True) -> None:
        self.backend = backend
        self.policy = policy
        self.faulty = faulty  # False: a clean node (services up, no failed remediation, collectors fine)
        self.started_seconds = time.time()
        self.clock_event_seconds: dict[tuple[int, str], float] = {}
        self.xids: dict[tuple[int, int], XidCount] = {}
        self.snapshot: NodeSnapshot | None = None
        # sglang's server within its SLO (the inference alerts stay quiet), its GPU memory, a stray process
        self.inference = inference_fields(self.started_seconds)
        self.inference["service_figures"] = {"sglang": self.inference["service_figures"]["sglang"]}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-loop", daemon=True)

    def start(self) -> None:
        self.step()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(LOOP_PERIOD_SECONDS):
            self.step()

    def count_xid(self, gpu: int, xid: int) -> None:
        with self._lock:
            old = self.xids.get((gpu, xid))
            uuid = self.backend.identity(gpu).uuid
            self.xids[(gpu, xid)] = XidCount(gpu, uuid, xid, (old.count if old else 0) + 1, time.time())

    def step(self) -> None:
        started = time.monotonic()
        self.backend.advance(LOOP_PERIOD_SECONDS)
        snapshot = snapshot_from_backend(self.backend, started_seconds=self.started_seconds)
        for sample in snapshot.gpus:
            for reason in decode(sample.clock_event_reasons or 0):
                key = (sample.index, reason)
                self.clock_event_seconds[key] = self.clock_event_seconds.get(key, 0.0) + LOOP_PERIOD_SECONDS
        with self._lock:
            xids = tuple(self.xids.values())
        duration = time.monotonic() - started
        self.snapshot = replace(
            snapshot,
            # the daemon's verdicts, as its watchers would give them for these readings
            throttle_active_since={
                (sample.index, reason): self.started_seconds
                for sample in snapshot.gpus
                for reason in decode(sample.clock_event_reasons or 0)
                if reason in SLOWDOWN_REASONS
            },
            pcie_degraded=frozenset(
                sample.index
                for sample in snapshot.gpus
                if sample.pcie_width is not None
                and sample.pcie_max_width is not None
                and sample.pcie_generation is not None
                and sample.pcie_max_generation is not None
                and (sample.pcie_width < sample.pcie_max_width or sample.pcie_generation < sample.pcie_max_generation)
                and bool(sample.gpu_utilization_percent)
            ),
            health={sample.index: stand_in_health(sample) for sample in snapshot.gpus},
            open_xids=frozenset((xid.gpu, xid.xid) for xid in xids if xid.gpu is not None),
            policy=self.policy,
            item_modes={"power_limit": "observe", "transparent_hugepages": "enforce"},
            clock_event_seconds=dict(self.clock_event_seconds),
            xids=xids,
            services=(
                ServiceStatus("sglang", "sglang.service", up=True, last_latency_seconds=0.004),
                ServiceStatus("embeddings", "embeddings.service", up=False, consecutive_failures=4, detail="HTTP 503"),
            )
            if self.faulty
            else (ServiceStatus("sglang", "sglang.service", up=True, last_latency_seconds=0.004),),
            remediations=(
                RemediationCount("service-unhealthy", "restart_service", "success", 1),
                RemediationCount("service-unhealthy", "restart_service", "failed", 1),
            )
            if self.faulty
            else (),
            remediation_failing=(RemediationFailing("service-unhealthy", "failed"),) if self.faulty else (),
            collectors=(
                CollectorStatus("gpu", True, duration),
                CollectorStatus("kmsg", not self.faulty, 0.0, last_error="open /dev/kmsg: permission denied"),
            ),
            collect_duration_seconds=duration,
            **self.inference,
        )


def stand_in_health(sample: GpuSample) -> Health:
    """What the watchers would judge of these readings, with their causes: uncorrected ECC errors, a
    pending remap, a thermal slowdown, within 5 C of the slowdown threshold."""
    parts = []
    if sample.ecc_uncorrected_volatile:
        parts.append(Health(HealthState.UNHEALTHY, "uncorrected ECC", causes=(FaultCause.ECC_UNCORRECTED,)))
    if sample.remap_pending:
        parts.append(Health(HealthState.UNHEALTHY, "row remap pending", causes=(FaultCause.ROW_REMAP_PENDING,)))
    if sample.clock_event_reasons and sample.clock_event_reasons & 0x60:
        near = (sample.temperature_celsius or 0) >= (sample.slowdown_temperature_celsius or 999) - 5
        causes = (FaultCause.CLOCKS_SLOWED, FaultCause.TEMPERATURE_MARGIN) if near else (FaultCause.CLOCKS_SLOWED,)
        parts.append(Health(HealthState.DEGRADED, "throttled", causes=causes))
    return combine(parts)


def simulated_node(state_dir: Path) -> tuple[SimulatedBackend, tuple[ItemPlan, ...]]:
    """Mixed node (GPUs 0-3 H200, 4-5 RTX PRO 6000) with a fault or two on most GPUs."""
    backend = SimulatedBackend("mixed", state_dir)
    backend.init()
    for gpu in (0, 1, 4):
        backend.set_processes(gpu, [4000 + gpu])
    backend.set_clock_event_reasons(1, 0x20 | 0x40)  # sw + hw thermal slowdown
    backend.set_temperature(1, 90)
    backend.set_remapped_rows(2, correctable=1, pending=True)
    backend.set_recovery_action(2, RecoveryAction.GPU_RESET)
    backend.fail_call(3, "performance_state", GpuErrorKind.UNKNOWN)
    backend.set_pcie_link(4, 4, 16)
    backend.add_ecc_errors(0, corrected=2)
    contexts = {gpu: GpuContext(backend, gpu, backend.identity(gpu)) for gpu in (0, 1)}
    policy = (
        power_limit.ITEM.plan(contexts[0], 600.0).plan,  # the board runs at 700 W: drift
        power_limit.ITEM.plan(contexts[1], 700.0).plan,
        ItemPlan("transparent_hugepages", None, PlanStatus.IN_SYNC, "never", "never"),
    )
    assert [plan.status for plan in policy] == [PlanStatus.DRIFT, PlanStatus.IN_SYNC, PlanStatus.IN_SYNC]
    return backend, policy


def clean_node(state_dir: Path) -> tuple[SimulatedBackend, tuple[ItemPlan, ...]]:
    """The same mixed node with nothing wrong: busy GPUs, the policy in sync."""
    backend = SimulatedBackend("mixed", state_dir)
    backend.init()
    for gpu in (0, 1, 4):
        backend.set_processes(gpu, [4000 + gpu])
    context = GpuContext(backend, 0, backend.identity(0))
    policy = (
        power_limit.ITEM.plan(context, 700.0).plan,
        ItemPlan("transparent_hugepages", None, PlanStatus.IN_SYNC, "never", "never"),
    )
    assert [plan.status for plan in policy] == [PlanStatus.IN_SYNC, PlanStatus.IN_SYNC]
    return backend, policy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


RECORDING = ROOT / "packaging/prometheus/gpu-agent-recording.yaml"


class Prometheus:
    """A real Prometheus on loopback scraping the agents on `target_ports` with the shipped rules."""

    def __init__(
        self,
        workdir: Path,
        target_ports: Sequence[int],
        rule_files: Sequence[Path] = (ALERTS, RECORDING),
        other_jobs: Mapping[str, Sequence[int]] | None = None,
        target_labels: Mapping[str, str] | None = None,
        alertmanagers: Sequence[str] = (),
    ) -> None:
        """`other_jobs`: more scrape jobs (name -> ports), e.g. the inference servers themselves;
        `target_labels`: what the fleet puts on the agents' targets (cluster, rack...);
        `alertmanagers`: host:port of the Alertmanagers its alerts go to."""
        assert PROMETHEUS is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = {"gpu-agent": target_ports, **(other_jobs or {})}
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{p}" for p in ports],
                            "labels": dict(target_labels or {}) if job == "gpu-agent" else {},
                        }
                    ],
                }
                for job, ports in jobs.items()
            ],
        }
        if alertmanagers:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            reply = json.loads(response.read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for(
        self,
        what: str,
        condition: Callable[[], bool],
        timeout_seconds: float = 15.0,
        detail: Callable[[], str] = lambda: "",
    ) -> None:
        last_error: Exception | None = None

        def met() -> bool:
            nonlocal last_error
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                return condition()
            except (OSError, AssertionError, KeyError) as exc:  # not up yet, or not there yet
                last_error = exc
                return False

        wait_until(
            met,
            timeout_seconds,
            lambda: f"{what} {detail()} (last error: {last_error!r})\n{self.log_tail()}",
            poll_seconds=0.2,
        )

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self._log.close()


@contextlib.contextmanager
def scraped_by_prometheus(workdir: Path, loop: StandInLoop) -> Iterator[Prometheus]:
    """`loop` running with its /metrics served, and a real Prometheus scraping it; all three
    stopped on the way out."""
    with contextlib.ExitStack() as stack:
        loop.start()
        stack.callback(loop.stop)
        server = MetricsServer("127.0.0.1:0", lambda: loop.snapshot)
        stack.callback(server.close)
        prometheus = Prometheus(workdir, [server.port], target_labels={"cluster": "lab"})
        stack.callback(prometheus.stop)
        yield prometheus


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, StandInLoop]]:
    if PROMETHEUS is None:
        pytest.skip("prometheus server not installed (apt-get install prometheus)")
    workdir = tmp_path_factory.mktemp("prometheus")
    backend, policy = simulated_node(workdir / "sim")
    loop = StandInLoop(backend, policy)
    loop.count_xid(1, 48)
    with scraped_by_prometheus(workdir, loop) as prom:

        def target_up() -> bool:
            targets = prom.api("targets")["activeTargets"]
            return len(targets) == 1 and targets[0]["health"] == "up"

        prom.wait_for("the gpu-agent target to be up", target_up)
        prom.wait_for("two scrapes", lambda: bool(prom.query("count_over_time(gpu_agent_up[1m]) >= 2")))
        # New faults after Prometheus has seen the node without them: Xid 48 again, an uncorrected ECC error.
        loop.count_xid(1, 48)
        backend.add_ecc_errors(1, uncorrected=1)
        prom.wait_for(
            "the new Xid and ECC error to be scraped",
            lambda: (
                bool(prom.query('gpu_agent_xid_errors_total{xid="48"} == 2'))
                and bool(prom.query('gpu_agent_gpu_ecc_errors_total{type="uncorrected"} == 1'))
            ),
        )
        yield prom, loop


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus scraping a node with nothing wrong."""
    if PROMETHEUS is None:
        pytest.skip("prometheus server not installed (apt-get install prometheus)")
    workdir = tmp_path_factory.mktemp("prometheus-clean")
    with scraped_by_prometheus(workdir, StandInLoop(*clean_node(workdir / "sim"), faulty=False)) as prom:
        # increase() over a panel's window needs two samples of it
        prom.wait_for("three scrapes", lambda: bool(prom.query("count_over_time(gpu_agent_up[1m]) >= 3")), 20)
        yield prom


def panel_queries() -> list[tuple[str, list[str]]]:
    """(panel title, its expressions) for every panel that shows data."""
    return [
        (panel["title"], [target["expr"] for target in panel["targets"]])
        for panel in all_panels(dashboard()["panels"])
        if panel["type"] != "row"
    ]


@needs_prometheus
def test_no_panel_shows_no_data_on_a_clean_node(clean: Prometheus) -> None:
    """A clean node is what an operator looks at most: no panel may be empty there. Stat panels and
    the verdict series give 0, not "no data"; every panel has at least one query with data (a table of
    Xid codes has no row per code before the first Xid, and its per-GPU total says 0)."""
    empty = []
    for title, exprs in panel_queries():
        if not any(clean.query(substitute(expr, node_of(clean))) for expr in exprs):
            empty.append(title)
    assert empty == []


@needs_prometheus
def test_verdict_queries_return_data_on_a_clean_node(clean: Prometheus) -> None:
    """Every stat panel and every query on a verdict series answers on a clean node, with the value of
    a clean node."""
    verdicts = re.compile(
        r"gpu_agent_(gpu_health|gpu_pcie_degraded|gpu_throttled|policy_drift|reboot_recommended|node_problem"
        r"|backend_up|remediation_outcomes_total|gpu_xid_errors_total)\b"
    )
    board = dashboard()
    stats = {panel["title"] for panel in all_panels(board["panels"]) if panel["type"] == "stat"}
    # The Fleet row (ids 200-299) counts GPUs and nodes by state: a clean node has healthy GPUs there.
    fleet = {panel["title"] for panel in all_panels(board["panels"]) if 200 <= panel["id"] < 300}
    failures = []
    for title, exprs in panel_queries():
        for expr in exprs:
            if title in stats or verdicts.search(expr):
                result = clean.query(substitute(expr, node_of(clean)))
                if not result:
                    failures.append(f"{title}: no data for {expr}")
                elif title in stats - fleet and [float(series["value"][1]) for series in result] != [0.0]:
                    failures.append(f"{title}: {result} on a clean node")
    assert failures == []
    assert [float(s["value"][1]) for s in clean.query("gpu_agent_backend_up")] == [1.0]
    assert {s["metric"]["cause"]: float(s["value"][1]) for s in clean.query("gpu_agent_node_problem")} == {
        "backend_unreadable": 0.0,
        "no_gpus": 0.0,
        "gpus_missing": 0.0,
    }


@needs_prometheus
def test_no_alert_fires_on_a_clean_node(clean: Prometheus) -> None:
    def evaluated() -> bool:
        groups = clean.api("rules", type="alert")["groups"]
        return all(rule["health"] == "ok" for group in groups for rule in group["rules"])

    clean.wait_for("every alert rule to be evaluated", evaluated)
    assert clean.api("alerts")["alerts"] == []


def test_the_xid_queries_are_unit_tested_as_written() -> None:
    """tests/prometheus/dashboard.yaml checks that the dashboard's Xid annotation and its Xid errors
    panel show a code's first Xid; that is only worth something while it tests the expressions the
    dashboard has."""
    (raw,) = [a["expr"] for a in dashboard()["annotations"]["list"] if a.get("name") == "Xid errors"]
    (panel,) = [p for p in all_panels(dashboard()["panels"]) if p["title"] == "Xid errors"]
    document = yaml.safe_load((ROOT / "tests/prometheus/dashboard.yaml").read_text())
    tested = {case["expr"] for test in document["tests"] for case in test.get("promql_expr_test", [])}
    assert substitute(raw) in tested
    assert substitute(panel["targets"][0]["expr"]) in tested


@needs_prometheus
def test_every_dashboard_query_returns_data(live: tuple[Prometheus, StandInLoop]) -> None:
    prom, _ = live
    failures = []
    for where, raw in dashboard_queries():
        expr = substitute(raw, node_of(prom))
        label_values = LABEL_VALUES.fullmatch(expr)
        if label_values:  # a Grafana variable query: the selector must find series carrying the label
            result = prom.query(label_values["selector"])
            if not any(label_values["label"] in series["metric"] for series in result):
                failures.append(f"{where}: no {label_values['label']} values from {label_values['selector']}")
            continue
        try:
            if not prom.query(expr):
                failures.append(f"{where}: no data for {expr}")
        except urllib.error.HTTPError as exc:
            failures.append(f"{where}: {exc.code} {exc.read().decode()} for {expr}")
    assert failures == []


@needs_prometheus
def test_template_variables_list_the_node(live: tuple[Prometheus, StandInLoop]) -> None:
    prom, loop = live
    assert loop.snapshot is not None
    gpus = {series["metric"]["gpu"] for series in prom.query("gpu_agent_gpu_info")}
    assert gpus == {str(sample.index) for sample in loop.snapshot.gpus} == {"0", "1", "2", "3", "4", "5"}


@needs_prometheus
def test_alert_rules_load_and_evaluate_cleanly(live: tuple[Prometheus, StandInLoop]) -> None:
    prom, _ = live

    def all_evaluated() -> bool:
        groups = prom.api("rules", type="alert")["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert {rule["name"] for rule in rules} == {rule["alert"] for rule in alert_rules()}
        return all(rule["health"] == "ok" for rule in rules)

    prom.wait_for("every alert rule to be evaluated", all_evaluated)
    groups = prom.api("rules", type="alert")["groups"]
    errors = {
        rule["name"]: rule.get("lastError") for group in groups for rule in group["rules"] if rule.get("lastError")
    }
    assert errors == {}


@needs_prometheus
def test_alerts_follow_the_simulated_faults(live: tuple[Prometheus, StandInLoop]) -> None:
    prom, _ = live
    expected = {
        ("GpuXidCritical", "1", "firing"),
        ("GpuUncorrectableEcc", "1", "firing"),
        ("GpuAgentRemediationFailing", "", "firing"),  # its series appeared less than 30 minutes ago
        ("GpuThermalSlowdown", "1", "pending"),
        ("GpuTemperatureHigh", "1", "pending"),  # 90 C, slowdown at 89 C
        ("GpuRowRemapPending", "2", "pending"),
        ("GpuRecoveryActionRequired", "2", "pending"),
        ("GpuPcieDegraded", "4", "pending"),
        ("GpuPolicyDriftObserved", "0", "pending"),  # power_limit drifted; the item is in observe mode
        ("GpuUnhealthy", "1", "pending"),  # the uncorrected ECC error; slowed and hot besides
        ("InferenceServiceDown", "", "pending"),
        ("GpuAgentCollectorFailing", "", "pending"),
        ("GpuUnhealthy", "2", "pending"),
    }
    seen: set[tuple[str, str, str]] = set()

    def reached() -> bool:
        seen.clear()
        for alert in prom.api("alerts")["alerts"]:
            seen.add((alert["labels"]["alertname"], alert["labels"].get("gpu", ""), alert["state"]))
        return seen == expected

    prom.wait_for(
        "the alerts the faults call for",
        reached,
        timeout_seconds=10,
        detail=lambda: f"missing: {sorted(expected - seen)}, unexpected: {sorted(seen - expected)}",
    )
