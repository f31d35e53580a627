"""One truth: for every fault the simulator can inject (and a host without the driver, a reboot
recommendation, a service down or over its latency objective, a next boot that is not ready, a
driver too old for a service's CUDA, and a daemon without rules), a real daemon's `status` (exit code and text), `status --json`, `/metrics` (the
verdict series), STATUS= (sd_notify), `/healthz` and the alert rules (evaluated by promtool on the
series scraped from that /metrics) all say the same thing about the node.

The status document is the reference: from it the test predicts every other view, and the alerts on
the verdicts that must fire (the rest of the verdict alerts must stay quiet).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import COUNTERS_INTERVAL_SECONDS, DEFAULT_POLICY, RunningAgent, free_port, running_agent
from helpers import wait_until
from host.test_boot_readiness import OLD, ubuntu_tree
from hosttree import make_host_tree
from prometheus_client.parser import text_string_to_metric_families

from agent.alerts.catalog import NODE_PROBLEMS
from agent.demo.standin_process import StandinServer

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "packaging/prometheus/gpu-agent-alerts.yaml"
PROMTOOL = shutil.which("promtool")
INSTANCE = {"instance": "node-1:9481", "job": "gpu-agent"}
EVAL_MINUTES = 30  # longer than every `for:` of the rules: a verdict held that long has fired
#: The alerts that restate a verdict; each is predicted from the status document below.
VERDICT_ALERTS = (
    "GpuLost",
    "GpuUnhealthy",
    "GpuDegraded",
    "GpuStale",
    "GpuNodeProblem",
    "GpuRebootRecommended",
    "GpuPolicyDrift",
    "GpuPolicyDriftObserved",
    "GpuPcieDegraded",
    "GpuThermalSlowdown",
    "GpuHwSlowdown",
    "GpuPowerBrake",
    "InferenceServiceDown",
    "InferenceLatencyAboveSlo",
    "GpuNextBootNotReady",
    "GpuNodeNotAsDeclared",
    "GpuAgentConfigNeedsAttention",
)
#: Attention causes STATUS= carries as lines of their own ("ATTENTION: ..."); the GPU ones it counts.
STATUS_LINE_CAUSES = {"service_down", "service_slo", "next_boot", "driver", "no_rules", "config"}

pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)"),
]

SEEN_WITHIN_SECONDS = COUNTERS_INTERVAL_SECONDS + 20.0


@dataclass(frozen=True)
class Fault:
    inject: tuple[str, ...]  # `gpu-agent inject ...` arguments; () for none
    attention: bool  # what `status` must conclude: 2 (attention needed) or 0 (all healthy)
    seen: Callable[[dict[str, Any]], bool]  # the daemon has taken the fault in
    backend: str = "simulated"
    profile: str = "h200x2"
    reboot_flag: bool = False
    config: str = ""  # more agent.yaml after the policy (services); {port}: the service's port
    standin: bool = False  # a stand-in inference server answers on {port}
    empty_rules: bool = False  # rules_dirs names an empty directory (else remediation is off)
    host: Callable[[Path], None] | None = None  # adds to the host tree before the daemon starts
    policy: str = DEFAULT_POLICY


def gpu(document: dict[str, Any], index: int) -> dict[str, Any]:
    return dict(next(g for g in document["gpus"] if g["index"] == index))


def health(document: dict[str, Any], index: int) -> str:
    return str((gpu(document, index).get("health") or {}).get("state"))


def not_healthy(index: int) -> Callable[[dict[str, Any]], bool]:
    return lambda d: health(d, index) != "healthy"


def service(**fields: str) -> str:
    """A command-managed service on GPU 0 whose health and metrics are on {port}."""
    extra = "".join(f"    {key}: {value}\n" for key, value in fields.items())
    return (
        "services:\n  - name: sglang\n    manager: command\n    start_command: [/bin/true]\n"
        '    stop_command: [/bin/true]\n    health_url: "http://127.0.0.1:{port}/health"\n    gpus: [0]\n'
        "    probe_interval_seconds: 0.2\n    scrape_interval_seconds: 0.2\n    unhealthy_after_probes: 2\n" + extra
    )


def next_kernel_without_module(root: Path) -> None:
    ubuntu_tree(root, module_for=OLD)  # DKMS built the module for the running kernel only


def service_state(document: dict[str, Any]) -> bool | None:
    return next((s["up"] for s in document["services"] if s["name"] == "sglang"), None)


def has_cause(cause: str) -> Callable[[dict[str, Any]], bool]:
    return lambda d: cause in d["verdict"]["causes"]


FAULTS: dict[str, Fault] = {
    "xid": Fault(("xid", "48", "--gpu", "1"), True, lambda d: bool(d["xids"]) and health(d, 1) != "healthy"),
    "throttle thermal": Fault(
        ("throttle", "--gpu", "1", "--reason", "hw_thermal_slowdown"), True, lambda d: bool(gpu(d, 1)["throttled"])
    ),
    # The power cap the agent holds: the reading says sw_power_cap, the verdict says healthy.
    "throttle power cap": Fault(
        ("throttle", "--gpu", "1", "--reason", "sw_power_cap"),
        False,
        lambda d: "sw_power_cap" in (gpu(d, 1)["clock_event_reasons_active"] or []),
    ),
    "temperature": Fault(("temperature", "--gpu", "1", "--celsius", "95"), True, not_healthy(1)),
    "lost": Fault(("lost", "--gpu", "1"), True, lambda d: not gpu(d, 1)["up"]),
    "reset-required": Fault(("reset-required", "--gpu", "1"), True, not_healthy(1)),
    "ecc": Fault(("ecc", "--gpu", "1", "--uncorrected", "1"), True, not_healthy(1)),
    "remap": Fault(("remap", "--gpu", "1", "--pending"), True, not_healthy(1)),
    "pcie width": Fault(("pcie", "--gpu", "1", "--width", "8"), True, lambda d: gpu(d, 1)["pcie_degraded"]),
    # An idle GPU (the RTX PRO idles in P8) trains its link down to save power: not degradation. (An
    # H200 idles in P0, where a lower generation is degradation: the "pcie width" case covers that.)
    "pcie idle downshift": Fault(
        ("pcie", "--gpu", "4", "--generation", "1"),
        False,
        lambda d: gpu(d, 4)["pcie_generation"] == 1,
        profile="mixed",
    ),
    # Observe mode: the drift is reported (an info alert), not an attention item.
    "drift": Fault(
        ("drift", "--gpu", "1", "--power-limit-watts", "650"),
        False,
        # (the policy loop re-plans on its own, slower tier: the reading shows the change first)
        lambda d: (
            gpu(d, 1)["power_limit_watts"] == 650.0 and {"item": "power_limit", "gpu": 1} in d["verdict"]["drift"]
        ),
    ),
    "hang": Fault(
        ("hang", "--gpu", "1", "--call", "temperature_celsius", "--seconds", "30"), True, lambda d: gpu(d, 1)["stale"]
    ),
    "fail": Fault(
        ("fail", "--gpu", "1", "--call", "temperature_celsius", "--kind", "unknown"),
        False,
        lambda d: "temperature_celsius" in gpu(d, 1)["read_errors"],
    ),
    "processes": Fault(("processes", "--gpu", "1", "4242"), False, lambda d: bool(d["gpus"])),
    "recovery-action": Fault(("recovery-action", "--gpu", "1", "gpu_reset"), True, not_healthy(1)),
    "reboot": Fault(("reboot",), False, lambda d: bool(d["gpus"])),
    "no driver": Fault((), True, lambda d: d["verdict"]["problem"] is not None, backend="nvml"),
    "reboot recommended": Fault((), True, lambda d: d["verdict"]["reboot_recommended"] is not None, reboot_flag=True),
    # Nothing answers on the service's port: the probes fail, the service is declared down.
    "service down": Fault((), True, lambda d: service_state(d) is False, config=service(metrics_url="false")),
    # The stand-in answers, but slower than an objective of 1 ms: over its objective, with a cause.
    "service over its objective": Fault(
        (),
        True,
        has_cause("service_slo"),
        config=service(slo="{{e2e_p95_seconds: 0.001, min_requests: 5}}"),
        standin=True,
    ),
    "next boot not ready": Fault(
        (),
        True,
        has_cause("next_boot"),
        host=next_kernel_without_module,
        policy=DEFAULT_POLICY.replace(
            "{transparent_hugepages: never}", "{transparent_hugepages: never, next_boot: ready}"
        ),
    ),
    # The simulated driver supports CUDA 13.0; the service's image wants 99.0.
    "driver too old": Fault(
        (), True, has_cause("driver"), config=service(metrics_url="false", cuda_version='"99.0"'), standin=True
    ),
    "no rules": Fault((), True, has_cause("no_rules"), empty_rules=True),
}


def cli(agent: RunningAgent, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def status_json(agent: RunningAgent) -> dict[str, Any]:
    result = cli(agent, "status", "--json")
    assert result.returncode in (0, 2), result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    assert document["verdict"]["exit_code"] == result.returncode
    return document


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def healthz(agent: RunningAgent) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def last_status_line(agent: RunningAgent) -> str:
    agent.notifications.poll(0.5)
    lines = [fields["STATUS"] for _, fields in agent.notifications.received if "STATUS" in fields]
    assert lines, "the daemon sent no STATUS="
    return lines[-1]


def verdict_view(document: dict[str, Any]) -> Any:
    """What must not change while the views are captured (a latency figure may: its cause may not)."""
    verdict = {k: v for k, v in document["verdict"].items() if k not in ("attention", "slo_breaches")}
    return (
        verdict,
        [(b["service"], b["objective"], b["cause"]) for b in document["verdict"]["slo_breaches"]],
        [
            (g["index"], g["up"], g["stale"], (g["health"] or {}).get("state"), g["pcie_degraded"], g["throttled"])
            for g in document["gpus"]
        ],
    )


# -- predictions from the status document ---------------------------------------------------------


def expected_alerts(document: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Per verdict alert, the label sets (beyond instance/job/severity) that must fire."""
    fired: dict[str, list[dict[str, str]]] = {name: [] for name in VERDICT_ALERTS}
    for g in document["gpus"]:
        ids = {"gpu": str(g["index"]), "uuid": g["uuid"]}
        state = (g["health"] or {}).get("state")
        if not g["up"]:
            fired["GpuLost"].append(ids)
        if state == "unhealthy":
            fired["GpuUnhealthy"].append(ids)
        if state == "degraded":
            fired["GpuDegraded"].append(ids)
        if g["stale"]:
            fired["GpuStale"].append(ids)
        if g["pcie_degraded"]:
            fired["GpuPcieDegraded"].append(ids)
        throttled = set(g["throttled"])
        if throttled & {"sw_thermal_slowdown", "hw_thermal_slowdown"}:
            fired["GpuThermalSlowdown"].append(ids)
        if "hw_slowdown" in throttled:
            fired["GpuHwSlowdown"].append(ids)
        if "hw_power_brake_slowdown" in throttled:
            fired["GpuPowerBrake"].append(ids)
    verdict = document["verdict"]
    for service_doc in document["services"]:
        if service_doc["up"] is False:
            fired["InferenceServiceDown"].append({"service": service_doc["name"]})
    for breach in verdict["slo_breaches"]:
        fired["InferenceLatencyAboveSlo"].append(
            {"service": breach["service"], "kind": breach["objective"].removesuffix("_p95")}
        )
    for item in document["policy"]["items"]:
        facts = item["facts"]
        if item["item"] == "next_boot" and item["status"] == "drift":
            fired["GpuNextBootNotReady"].append({"cause": facts["cause"]})
        if item["item"] in ("driver", "vbios") and item["status"] == "drift":
            fired["GpuNodeNotAsDeclared"].append(
                {"item": item["item"], "gpu": "", "uuid": ""}
                if item["gpu"] is None
                else {"item": item["item"], "gpu": str(item["gpu"])}
            )
    for cause in sorted({c for c in verdict["causes"] if c in ("no_rules", "config")}):
        fired["GpuAgentConfigNeedsAttention"].append({"cause": cause})
    if verdict["problem"] and verdict["problem"]["cause"] in NODE_PROBLEMS:  # GPUs missing one by one: GpuLost
        fired["GpuNodeProblem"].append({"cause": verdict["problem"]["cause"]})
    if verdict["reboot_recommended"]:
        fired["GpuRebootRecommended"].append({"cause": verdict["reboot_recommended_cause"]})
    modes = {i["item"]: i["mode"] for i in document["policy"]["items"]}
    uuids = {g["index"]: g["uuid"] for g in document["gpus"]}
    for drift in verdict["drift"]:
        if drift["item"] in ("driver", "vbios", "next_boot"):
            continue  # report-only items: GpuNodeNotAsDeclared and GpuNextBootNotReady say it
        labels = {"item": drift["item"], "gpu": "" if drift["gpu"] is None else str(drift["gpu"])}
        labels["uuid"] = "" if drift["gpu"] is None else uuids[drift["gpu"]]
        name = "GpuPolicyDrift" if modes[drift["item"]] == "enforce" else "GpuPolicyDriftObserved"
        fired[name].append(labels)
    return fired


def promtool_case(
    samples: list[tuple[str, dict[str, str], float]], fired: dict[str, list[dict[str, str]]]
) -> dict[str, Any]:
    rules = {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}

    def alert(name: str, labels: dict[str, str]) -> dict[str, Any]:
        full = {k: v for k, v in {**INSTANCE, **labels, **rules[name]["labels"]}.items() if v != ""}
        annotations = {
            key: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: full.get(m.group(1), ""), text).strip()
            for key, text in rules[name]["annotations"].items()
        }
        return {"exp_labels": full, "exp_annotations": annotations}

    def series(name: str, labels: dict[str, str]) -> str:
        inner = ",".join(f"{k}={json.dumps(v)}" for k, v in {**INSTANCE, **labels}.items())
        return f"{name}{{{inner}}}"

    return {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                # the scraped values, held: the verdict as the daemon gives it now
                "input_series": [
                    {"series": series(name, labels), "values": f"{value:g}x{EVAL_MINUTES}"}
                    for name, labels, value in samples
                ],
                "alert_rule_test": [
                    {
                        "eval_time": f"{EVAL_MINUTES}m",
                        "alertname": name,
                        "exp_alerts": [alert(name, labels) for labels in fired[name]],
                    }
                    for name in VERDICT_ALERTS
                ],
            }
        ],
    }


# -- the test -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAULTS)
def test_every_view_agrees_on_the_fault(tmp_path: Path, name: str) -> None:
    fault = FAULTS[name]
    if fault.host is not None:
        make_host_tree(tmp_path / "host", kernel_sysfs=False)
        fault.host(tmp_path / "host")
    rules = tmp_path / "rules.d" if fault.empty_rules else None
    if rules is not None:
        rules.mkdir()
    port = free_port()
    policy = fault.policy + fault.config.format(port=port)
    with contextlib.ExitStack() as stack:
        if fault.standin:
            stack.enter_context(StandinServer(tmp_path, port=port, extra_args=("--flavor", "sglang")))
        agent = stack.enter_context(
            running_agent(
                tmp_path, mode="observe", backend=fault.backend, profile=fault.profile, policy=policy, rules_dir=rules
            )
        )
        agent.notifications.wait_for("READY", "1")
        if fault.reboot_flag:
            (agent.state_dir / "reboot-recommended").write_text(json.dumps({"reason": "Xid 79: GPU fell off the bus"}))
        if fault.inject:
            injected = cli(agent, "inject", *fault.inject)
            assert injected.returncode == 0, injected.stderr
        # A fault in a slow-tier reading (PCIe link, ECC counters, remapping) shows at the next slow
        # read, up to counters_interval_seconds after the injection, then a loop or two.
        wait_until(
            lambda: fault.seen(status_json(agent)), SEEN_WITHIN_SECONDS, lambda: f"the daemon never took in {name}"
        )
        time.sleep(1.0)  # settle: watchers that need a few loops (PCIe, throttle) have had them
        document = status_json(agent)
        text = cli(agent, "status")
        metrics = metric_samples(agent.metrics())
        status_line = last_status_line(agent)
        health_code, health_body = healthz(agent)
        assert verdict_view(status_json(agent)) == verdict_view(document), "the verdict moved while captured"

    verdict = document["verdict"]
    # status: the exit code, and the text says what the document says
    assert verdict["exit_code"] == (2 if fault.attention else 0), verdict
    assert text.returncode == verdict["exit_code"], text.stdout + text.stderr
    assert ("all healthy" in text.stdout.splitlines()) == (not fault.attention), text.stdout
    problem = verdict["problem"]
    problem_lines = [line for line in text.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert len(problem_lines) == (1 if problem else 0), text.stdout
    if problem:  # the one line naming the cause, whole: piped output is never cut
        assert problem_lines[0] == f"PROBLEM: {problem['detail']}", text.stdout
    reboot_lines = [line for line in text.stdout.splitlines() if line.startswith("REBOOT RECOMMENDED: ")]
    assert bool(reboot_lines) == bool(verdict["reboot_recommended"])
    for g in document["gpus"]:
        row = next(line for line in text.stdout.splitlines() if line.startswith(f"{g['index']}  "))
        shown = "LOST" if not g["up"] else (g["health"] or {}).get("state")
        assert f" {shown} " in f"{row} ", row

    # every attention line of the verdict, whole; a live figure in it (a service's p95, read by two
    # processes a moment apart) may have moved between the two captures, so seconds are compared as such
    def steady(line: str) -> str:
        return re.sub(r"\b\d+(?:\.\d+)? s\b", "<seconds> s", line)

    shown_lines = {steady(line) for line in text.stdout.splitlines()}
    assert all(steady(f"  - {line}") in shown_lines for line in verdict["attention"]), text.stdout

    # /metrics: the verdict series are the document's
    def values(metric: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(labels.items())): value for name_, labels, value in metrics if name_ == metric}

    for g in document["gpus"]:
        ids = (("gpu", str(g["index"])), ("uuid", g["uuid"]))
        state = (g["health"] or {}).get("state")
        health_series = {dict(k)["state"]: v for k, v in values("gpu_agent_gpu_health").items() if set(ids) <= set(k)}
        assert health_series == {s: float(s == state) for s in ("healthy", "degraded", "unhealthy")}
        # a verdict of the faults family is listed while it holds (0: not listed)
        assert values("gpu_agent_gpu_pcie_degraded").get(tuple(sorted(ids)), 0.0) == float(g["pcie_degraded"])
        throttled = {
            dict(k)["reason"] for k, v in values("gpu_agent_gpu_throttled").items() if set(ids) <= set(k) and v
        }
        assert throttled == set(g["throttled"])
        assert values("gpu_agent_gpu_up")[tuple(sorted(ids))] == float(g["up"])
    drift = {(dict(k)["item"], dict(k)["gpu"]) for k, v in values("gpu_agent_policy_drift").items() if v}
    assert drift == {(d["item"], "" if d["gpu"] is None else str(d["gpu"])) for d in verdict["drift"]}
    problems = {dict(k)["cause"] for k, v in values("gpu_agent_node_problem").items() if v}
    assert problems == ({problem["cause"]} if problem else set())
    assert values("gpu_agent_backend_up")[()] == float(not (problem and problem["cause"] == "backend_unreadable"))
    reboot = {dict(k)["cause"]: v for k, v in values("gpu_agent_reboot_recommended").items()}
    cause = verdict["reboot_recommended_cause"]
    assert reboot == ({cause: 1.0} if verdict["reboot_recommended"] else {"none": 0.0})

    causes = verdict["causes"]
    assert len(causes) == len(verdict["attention"])
    # every attention line in the text, and gpu_agent_attention counts them by cause
    shown = [line.removeprefix("  - ") for line in text.stdout.splitlines() if line.startswith("  - ")]
    assert len(shown) == len(verdict["attention"]), text.stdout
    for on_screen, line in zip(shown, verdict["attention"]):  # (a latency figure may have moved)
        assert line.split(":")[0].startswith(on_screen.removesuffix("~").split(":")[0]), (on_screen, line)
    attention_series = {dict(k)["cause"]: v for k, v in values("gpu_agent_attention").items()}
    assert {c: v for c, v in attention_series.items() if v} == {c: float(causes.count(c)) for c in set(causes)}

    # STATUS= and /healthz
    assert status_line.startswith("PROBLEM: ") == bool(problem), status_line
    assert ("all healthy" in status_line) == (not causes), status_line
    assert ("REBOOT RECOMMENDED" in status_line) == bool(verdict["reboot_recommended"]), status_line
    assert status_line.count("; ATTENTION: ") == sum(1 for c in causes if c in STATUS_LINE_CAUSES), status_line
    assert health_code == (503 if problem else 200), health_body
    assert health_body["causes"] == causes, health_body
    if problem:
        assert health_body["cause"] == problem["cause"] and health_body["detail"] == problem["detail"]

    # the alert rules, evaluated on the scraped series, fire exactly the verdict alerts predicted
    fired = expected_alerts(document)
    severities = {
        rule["alert"]: rule["labels"]["severity"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
    }
    paging = any(fired[name] for name in VERDICT_ALERTS if severities[name] in ("warning", "critical"))
    assert paging == fault.attention, fired
    case = tmp_path / "agreement.yaml"
    case.write_text(yaml.safe_dump(promtool_case(metrics, fired), sort_keys=False))
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "test", "rules", str(case)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr


# -- one fault, two reporters ---------------------------------------------------------------------

RULES = ROOT / "rules"


@dataclass(frozen=True)
class XidReport:
    code: str
    mode: str
    kernel_log_at_start: bool  # the daemon follows a kernel log before the fault (NVML's report waits)
    nvml_after_the_reset: bool = False  # the kernel line first; NVML's event of it after the reset ended
    pid: bool = False  # the kernel line names the faulting process


XID_REPORTS = {
    # Reset-class: the reset runs; a late second report of the fault it dealt with is not a new fault.
    "reset-class, both reporters at once": XidReport("48", "enforce", kernel_log_at_start=True),
    "reset-class, no kernel log followed until the line": XidReport("48", "enforce", kernel_log_at_start=False),
    "reset-class, NVML's report after the reset": XidReport(
        "48", "enforce", kernel_log_at_start=True, nvml_after_the_reset=True
    ),
    # App-level, the process named by the kernel line only: one event that names it, one decision.
    "app-level, both reporters at once": XidReport("13", "observe", kernel_log_at_start=True, pid=True),
}


def both_reports_in(events: list[dict[str, Any]]) -> bool:
    return len(events) > 1 or any(sorted(e["data"]["sources"]) == ["kmsg", "nvml"] for e in events)


def xid_events(agent: RunningAgent, code: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stored events about Xid `code`, and the remediation rows decided on them."""
    result = cli(agent, "events", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    events = [e for e in document["events"] if e["kind"] == "xid" and e["data"]["xid"] == code]
    keys = {e["key"] for e in events}
    return events, [r for r in document["remediations"] if r["event_key"] in keys]


@pytest.mark.parametrize("name", XID_REPORTS)
def test_one_xid_both_reporters_saw_is_one_fault_in_every_view(tmp_path: Path, name: str) -> None:
    """NVML's event and the kernel-log line of one Xid: one event (`gpu-agent events`), one count
    (`status`, its JSON, /metrics) and one remediation row, whichever reporter came first and however
    quickly the remediation ended."""
    report = XID_REPORTS[name]
    code = int(report.code)
    with running_agent(tmp_path, mode=report.mode, rules_dir=RULES) as agent:
        agent.notifications.wait_for("READY", "1")
        if report.kernel_log_at_start:
            kmsg = agent.host_root / "dev/kmsg"
            kmsg.parent.mkdir(parents=True, exist_ok=True)
            kmsg.touch()
            wait_until(
                lambda: any(c["name"] == "kmsg" and c["success"] for c in status_json(agent)["collectors"]),
                10,
                "the kernel log followed",
            )
        pid = ("--pid", "4242", "--process", "python3") if report.pid else ()
        first = "kmsg" if report.nvml_after_the_reset else "both"
        injected = cli(agent, "inject", "xid", report.code, "--gpu", "1", "--source", first, *pid)
        assert injected.returncode == 0, injected.stderr
        wait_until(
            lambda: any(r["outcome"] != "running" for r in xid_events(agent, code)[1]),
            SEEN_WITHIN_SECONDS,
            "the fault's remediation decided and ended",
        )
        if report.nvml_after_the_reset:
            injected = cli(agent, "inject", "xid", report.code, "--gpu", "1", "--source", "nvml")
            assert injected.returncode == 0, injected.stderr
        # Both reports in: the fault's event (as the daemon holds it) lists both reporters, or the
        # second report was taken for a fault of its own.
        wait_until(
            lambda: both_reports_in([e for e in status_json(agent)["recent_events"] if e["kind"] == "xid"]),
            SEEN_WITHIN_SECONDS,
            "both reports taken in",
        )
        time.sleep(1.5)  # past the wait for a kernel line and a loop or two: nothing more may come
        events, rows = xid_events(agent, code)
        document = status_json(agent)
        text = cli(agent, "status").stdout
        metrics = metric_samples(agent.metrics())

    assert len(events) == 1, [e["message"] for e in events]
    (event,) = events
    if report.pid:
        assert (event["data"]["pid"], event["data"]["process"]) == (4242, "python3")
    assert len(rows) == 1, [(r["rule"], r["outcome"], r["reason"]) for r in rows]
    assert [(x["gpu"], x["xid"], x["count"]) for x in document["xids"]] == [(1, code, 1)]
    assert f"GPU 1 Xid {code} x1," in text, text
    uuid = gpu(document, 1)["uuid"]
    xid_total = {
        (labels["gpu"], labels["xid"]): value for n, labels, value in metrics if n == "gpu_agent_xid_errors_total"
    }
    assert xid_total == {("1", report.code): 1.0}
    per_gpu = {labels["gpu"]: value for n, labels, value in metrics if n == "gpu_agent_gpu_xid_errors_total"}
    assert per_gpu == {"0": 0.0, "1": 1.0}
    decided = sum(
        value
        for n, labels, value in metrics
        if n == "gpu_agent_remediations_total" and labels["rule"] == rows[0]["rule"]
    )
    assert decided == 1.0
    assert uuid == event["uuid"]
