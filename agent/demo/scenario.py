"""`gpu-agent demo`: the daemon on a simulated node, with a scripted fault scenario.

Everything lives in one scratch directory: a fake host tree (THP sysfs files, /proc/modules
with nouveau loaded, an Ubuntu /etc/os-release, /etc/modprobe.d, /etc/systemd/system), the
simulated node's state (4x H200 SXM + 2x RTX PRO 6000), a stand-in inference server managed by
the `command` adapter, the shipped default rules, and a config in enforce mode. Nothing outside
that directory is read or changed. The scenario: the policy is enforced at start; a setting
drifts behind the agent's back and is put back; GPU 4 overheats and throttles; GPU 2, one of the
inference service's, overheats and the service's own p95 latency misses its SLO, which the agent
blames on GPU 2's thermal slowdown; an app-level Xid on GPU 1 gets the inference service restarted
by the default rule; and a short `gpu-agent tune power` sweep of GPU 0 (refused while GPU 1 is
degraded by that Xid, until it is acknowledged) measures what a lower power limit costs the service
and puts the limit back, then `tune apply` puts the recommendation in force for GPU 0 alone and
`tune undo` takes it back.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import api
from agent.demo import standin, standin_process
from agent.demo.alertmanager_process import DemoAlertmanager, find_alertmanager
from agent.host import safe_json
from agent.names.policy_items import POWER_LIMIT

SERVICE_PID_FILE = "sglang.pid"  # the stand-in inference server's, in the demo directory
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

DEMO_CONFIG = """\
# gpu-agent demo: a simulated node (4x H200 SXM, 2x RTX PRO 6000) and a fake host tree.
mode: enforce
backend: simulated
simulated: {{profile: mixed}}
host_root: {host_root}
state_dir: {state_dir}
interval_seconds: 1
policy_interval_seconds: 5
metrics: {{listen: "127.0.0.1:{metrics_port}"}}
api: {{socket: {socket}}}
remediation: {{rules_dirs: [{rules_dir}]{alertmanager}}}
policy:
  node:
    transparent_hugepages: {{enabled: never, defrag: never}}
    nouveau: blacklisted
    triton_cache: {{path: /var/cache/triton, owner: {user}, group: {group}, mode: "0755", services: [sglang]}}
  gpus:
    - match: {{model: "NVIDIA H200*"}}
      power_limit_watts: 600
      locked_clocks: {{gpu_mhz: [1980, 1980]}}
      persistence: enabled
      ecc: enabled
    - match: {{model: "NVIDIA RTX PRO 6000*"}}
      power_limit_watts: 450
      fan_curve: [[30, 30], [50, 60], [75, 100]]
      persistence: enabled
      ecc: enabled
services:
  - name: sglang
    manager: command
    health_url: "http://127.0.0.1:{service_port}/health"
    gpus: [0, 1, 2, 3]
    start_command: {start}
    stop_command: {stop}
    probe_interval_seconds: 1
    scrape_interval_seconds: 1
    ready_timeout_seconds: 30
    slo: {{e2e_p95_seconds: 1.5}}
"""


def build_demo_host(root: Path) -> None:
    """A small fake host: what the node policy items read and write, nothing else."""
    thp = root / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True, exist_ok=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    (thp / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    (root / "sys/module/nouveau").mkdir(parents=True, exist_ok=True)
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "modules").write_text(
        "nvidia_uvm 1794048 0 - Live 0x0000000000000000 (POE)\n"
        "nouveau 3096576 0 - Live 0x0000000000000000\n"
        "nvidia 14381056 1 nvidia_uvm, Live 0x0000000000000000 (POE)\n"
    )
    etc = root / "etc"
    (etc / "modprobe.d").mkdir(parents=True, exist_ok=True)
    (etc / "systemd/system").mkdir(parents=True, exist_ok=True)
    (etc / "os-release").write_text('NAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\nID_LIKE=debian\n')
    (root / "dev").mkdir(exist_ok=True)
    # The kernel log every host has (empty): the daemon follows it from its start, so an Xid NVML
    # reports waits for its kernel line and is told once, with the faulting process.
    (root / "dev/kmsg").touch()


def default_rules_dir() -> Path:
    """The shipped default rules: next to the package in a checkout, /usr/share/gpu-agent/rules.d when installed."""
    for candidate in (Path(__file__).resolve().parents[2] / "rules", Path("/usr/share/gpu-agent/rules.d")):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError("default rules not found (rules/ in the checkout or /usr/share/gpu-agent/rules.d)")


#: What a demo leaves in its directory; a new demo there starts from none of it.
DEMO_ENTRIES = (
    *("host", "state", "rules.d", "alertmanager", "agent.yaml", "agent.d", "agent.log", "agent.sock"),
    SERVICE_PID_FILE,
)


def clear_previous_demo(directory: Path) -> None:
    """A demo run again into the same directory starts from a fresh node: what an earlier one left
    (the simulated GPUs' state, the node memory, the host tree, its stand-in server) goes; nothing
    else there is touched. A demo still running there is not interfered with: an error."""
    socket = directory / "agent.sock"
    if socket.exists():
        try:
            api.call(socket, "ping", timeout_seconds=2.0)
        except (OSError, ValueError, api.ApiError):
            pass  # a socket an earlier demo left behind
        else:
            raise RuntimeError(f"a gpu-agent demo still runs in {directory}: stop it, or give another --dir")
    standin.stop_server(directory / SERVICE_PID_FILE)
    for name in DEMO_ENTRIES:
        entry = directory / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def write_demo_config(directory: Path, alertmanager_url: str | None = None) -> Path:
    host_root, state_dir = directory / "host", directory / "state"
    build_demo_host(host_root)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    rules_dir = directory / "rules.d"
    rules_dir.mkdir(mode=0o755, exist_ok=True)
    for rule_file in sorted(default_rules_dir().glob("*.yaml")):
        target = rules_dir / rule_file.name
        shutil.copyfile(rule_file, target)
        os.chmod(target, 0o644)  # the loader refuses rules others can write
    service_port = standin_process.free_port()
    pid_file = directory / SERVICE_PID_FILE
    server = [
        *(sys.executable, "-m", "agent.demo.standin", "--flavor", "sglang"),
        *("--port", str(service_port), "--pid-file", str(pid_file)),
    ]
    start = [*server, "--daemon", "--sim-state-dir", str(state_dir), "--sim-profile", "mixed", "--gpus", "0,1,2,3"]
    stop = [sys.executable, "-m", "agent.demo.standin", "--stop", "--pid-file", str(pid_file)]
    config = directory / "agent.yaml"
    config.write_text(
        DEMO_CONFIG.format(
            host_root=host_root,
            state_dir=state_dir,
            metrics_port=standin_process.free_port(),
            socket=directory / "agent.sock",
            rules_dir=rules_dir,
            alertmanager=f", alertmanager_url: {json.dumps(alertmanager_url)}" if alertmanager_url else "",
            user=pwd.getpwuid(os.getuid()).pw_name,
            group=grp.getgrgid(os.getgid()).gr_name,
            service_port=service_port,
            start=json.dumps(start),
            stop=json.dumps(stop),
        )
    )
    subprocess.run(start, check=True, timeout=60)  # the service is up before the agent
    return config


class Demo:
    def __init__(self, directory: Path, alertmanager: DemoAlertmanager | None = None) -> None:
        self.directory = directory
        self.alertmanager = alertmanager
        self.config = write_demo_config(directory, alertmanager.url if alertmanager is not None else None)
        self.socket = directory / "agent.sock"
        self.log_path = directory / "agent.log"
        self.agent: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str, ok_codes: tuple[int, ...] = (0,)) -> str:
        result = self.run_cli(*args)
        if result.returncode not in ok_codes:
            raise RuntimeError(f"gpu-agent {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def run_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", *args, "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def status(self) -> dict[str, Any]:
        try:
            document = api.call(self.socket, "status", timeout_seconds=5)
        except (OSError, ValueError, api.ApiError):
            return {}
        return dict(document) if isinstance(document, dict) and not document.get("starting") else {}

    def wait(self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout_seconds: float = 60) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.agent is not None and self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited ({self.agent.returncode}); see {self.log_path}")
            status = self.status()
            if status and predicate(status):
                return
            time.sleep(0.25)
        raise RuntimeError(f"timed out waiting for {what}; see {self.log_path}")

    def start_agent(self) -> None:
        with open(self.log_path, "wb") as log:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--log-format", "json", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()


class Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP asked the demo to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def _gpu(status: dict[str, Any], index: int) -> dict[str, Any]:
    return dict(next(g for g in status["gpus"] if g["index"] == index))


def _events(status: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in status["recent_events"] if e["kind"] == kind]


def _power_drift(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        e
        for e in _events(status, "policy_drift")
        if e["gpu"] == 0 and e["data"]["item"] == POWER_LIMIT and e["data"]["reappeared"] >= 1
    ]


def _thermal_events(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in _events(status, "throttle_started") if e["gpu"] == 4 and "thermal" in e["data"]["reason"]]


def _latency_regressions(status: dict[str, Any], gpu: int) -> list[dict[str, Any]]:
    return [e for e in _events(status, "service_latency_regression") if e["gpu"] == gpu]


def _remediated(status: dict[str, Any], rule: str) -> bool:
    return any(r["rule"] == rule and r["outcome"] == "success" for r in status["remediations"])


def say(text: str) -> None:
    print(text, flush=True)


def run_demo(directory: Path | None = None, keep_running: bool = True) -> int:
    """The scenario; whatever stops it (the end, an error, SIGINT, SIGTERM, SIGHUP) stops the agent
    and the stand-in server too: `timeout` or `kill` must not leave them holding their ports."""
    directory = directory or Path(tempfile.mkdtemp(prefix="gpu-agent-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}
    demo: Demo | None = None
    alertmanager: DemoAlertmanager | None = None
    scenario_done = False
    try:
        say(f"gpu-agent demo: a simulated node (4x H200 SXM, 2x RTX PRO 6000) under {directory}")
        say("nothing outside that directory is read or changed")
        clear_previous_demo(directory)
        program = find_alertmanager()
        if program is not None:
            alertmanager = DemoAlertmanager(program, directory / "alertmanager").start()
            say(f"a real Alertmanager ({program}) receives the agent's alerts at {alertmanager.url}")
        else:
            say("no Alertmanager installed (prometheus-alertmanager): the alert actions have nowhere to go")
        say("")
        demo = Demo(directory, alertmanager)
        _play(demo)
        scenario_done = True
        if keep_running:
            say("\nthe agent keeps running; Ctrl-C stops it (fans go back to automatic)")
            assert demo.agent is not None
            demo.agent.wait()
        return 0
    except Stopped as stopped:
        say(f"\nstopping ({stopped})")
        return 0 if scenario_done else 128 + stopped.signum
    except (RuntimeError, FileNotFoundError) as exc:
        say(f"\ndemo failed: {exc}")
        return 1
    finally:
        # A second signal must not cut the clean-up short.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if demo is not None:
            demo.stop()
        if alertmanager is not None:
            alertmanager.stop()
        standin.stop_server(directory / SERVICE_PID_FILE)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _play(demo: Demo) -> None:
    config = demo.config
    say("== 0. before the agent starts: gpu-agent plan")
    say(_plan_summary(demo))
    demo.start_agent()
    demo.wait("the first loop", lambda s: bool(s.get("gpus")))
    say("\n== 1. the daemon enforces the policy on its first loop")
    demo.wait("power limits", lambda s: _gpu(s, 0)["power_limit_watts"] == 600.0, 30)
    say("   GPU 0-3 power limit 700 W -> 600 W, clocks locked at 1980 MHz; GPU 4-5 450 W, fans on the curve")
    say("   THP off, nouveau blacklisted (reboot pending), Triton cache dir made (sglang gets TRITON_CACHE_DIR")
    say("   in its start command's environment: a command service has no unit for a drop-in)")

    say("\n== 2. someone sets GPU 0 to 650 W behind the agent's back")
    say("   " + demo.cli("inject", "drift", "--gpu", "0", "--power-limit-watts", "650"))
    demo.wait("drift corrected", lambda s: bool(_power_drift(s)), 60)
    say("   " + _power_drift(demo.status())[-1]["message"])

    say("\n== 3. GPU 4 overheats: 92 C, thermal slowdown")
    # The reasons first: a loop seeing 92 C without them would read the simulator's own hw slowdown.
    say("   " + demo.cli("inject", "throttle", "--gpu", "4", "--reason", "sw_thermal_slowdown"))
    say("   " + demo.cli("inject", "temperature", "--gpu", "4", "--celsius", "92"))
    demo.wait("throttling seen", lambda s: _gpu(s, 4)["health"]["state"] != "healthy", 30)
    say("   " + _thermal_events(demo.status())[-1]["message"])
    health = _gpu(demo.status(), 4)["health"]
    say(f"   GPU 4 is {health['state']}: {health['reason']} (suggested: {health['suggested_action']})")
    say("   (rule clock-slowdown-held alerts if it lasts 60 s; cooling it down now)")
    demo.cli("inject", "throttle", "--gpu", "4", "--clear")
    demo.cli("inject", "temperature", "--gpu", "4", "--clear")

    # Before the Xid: an Xid in the latency window would be named as the cause instead.
    say("\n== 4. GPU 2, one of sglang's GPUs, overheats: 92 C, its clock halves")
    say("   " + demo.cli("inject", "temperature", "--gpu", "2", "--celsius", "92"))
    say("   sglang serves slower; the agent reads its p95 from the server's /metrics (SLO: e2e p95 1.5 s)")
    demo.wait("the latency regression", lambda s: bool(_latency_regressions(s, gpu=2)), 120)
    say("   " + _latency_regressions(demo.status(), gpu=2)[-1]["message"])
    say("   (rule service-latency-regression-alert alerts with that cause; never a restart)")
    say("   " + _alert_arrival(demo, "service-latency-regression-alert", "InferenceLatencyAboveSlo"))
    demo.cli("inject", "temperature", "--gpu", "2", "--clear")

    say("\n== 5. an app-level Xid 13 on GPU 1 (NVML event and kernel log)")
    # The kernel log names the faulting process: the stand-in server's own, so it is sglang's fault.
    server_pid = (demo.directory / SERVICE_PID_FILE).read_text().strip()
    say("   " + demo.cli("inject", "xid", "13", "--gpu", "1", "--pid", server_pid, "--process", "python3"))
    demo.wait("the service restart", lambda s: _remediated(s, "xid-restart-service"), 90)
    say("   rule xid-restart-service restarted sglang (stop, start, health check): success")
    counted = [f"Xid {x['xid']} x{x['count']}" for x in demo.status()["xids"] if x["gpu"] == 1]
    say(f"   GPU 1 Xids counted: {', '.join(counted) or 'none'}")

    say("\n== 6. is GPU 0's 600 W limit worth its power? a short sweep, measured on sglang's own numbers")
    demo.wait("sglang serving again", lambda s: all(v["up"] for v in s["services"]), 60)
    sweep_args = (
        *("tune", "power", "--service", "sglang", "--gpus", "0"),
        *("--from", "600", "--to", "450", "--step", "150", "--dwell", "3"),
    )
    refused = demo.run_cli(*sweep_args)
    if refused.returncode == 1:  # GPU 1 is still degraded by its Xid: a sick subject is not swept
        say("   " + refused.stderr.strip().removeprefix("gpu-agent tune: "))
        say("   the restart dealt with the Xid: " + demo.cli("ack", "xid:13@1"))
        demo.wait("GPU 1 healthy again", lambda s: _gpu(s, 1)["health"]["state"] == "healthy", 60)
    sweep = demo.cli(*sweep_args, ok_codes=(0, 2))
    say("\n".join("   " + line for line in sweep.splitlines()))
    say("   (the sweep held GPU 0's limit off the policy loop, as `held`, not drift, and put 600 W back)")
    applied = demo.run_cli("tune", "apply")
    say("\n== 7. the recommendation in force for GPU 0 alone, and taken back")
    say("\n".join("   " + line for line in (applied.stdout or applied.stderr).strip().splitlines()))
    if applied.returncode == 0:
        say("   " + _plan_source(demo, 0))
        say("   " + demo.cli("tune", "undo"))
        say("   " + _plan_source(demo, 0))

    port = config.read_text().split('listen: "127.0.0.1:', 1)[1].split('"', 1)[0]
    wrapper = Path(__file__).resolve().parents[2] / "scripts" / "gpu-agent"
    cli = "scripts/gpu-agent" if wrapper.exists() else "gpu-agent"
    say("\nscenario done. Look around (in another terminal, from the checkout):")
    say(f"   {cli} status --config {config}")
    say(f"   {cli} events --config {config}")
    say(f"   {cli} inject --help   (then e.g. {cli} inject lost --gpu 2 --config {config})")
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    if shutil.which("curl"):
        say(f"   curl -s {metrics_url} | grep gpu_agent_")
    else:
        fetch = f"import urllib.request; print(urllib.request.urlopen('{metrics_url}').read().decode())"
        say(f'   python3 -c "{fetch}" | grep gpu_agent_')
    if demo.alertmanager is not None:
        if shutil.which("curl"):
            say(f"   curl -s {demo.alertmanager.url}/api/v2/alerts   (the alerts it received)")
        else:
            say(f"   the alerts it received: {demo.alertmanager.url}/api/v2/alerts")
    say(f"   agent log: {demo.log_path}")


def _alert_arrival(demo: Demo, rule: str, alertname: str) -> str:
    """The alert `rule` raised (`alertname`), as the demo's Alertmanager received it from the agent;
    without one, the action's outcome (not configured: there is nowhere to send it)."""
    alertmanager = demo.alertmanager
    if alertmanager is None:
        demo.wait(
            f"the {rule} decision",
            lambda s: any(r["rule"] == rule for r in s["recent_remediations"]),
            60,
        )
        decided = [r for r in demo.status()["recent_remediations"] if r["rule"] == rule][-1]
        return f"the alert: {decided['outcome'].replace('_', ' ')} ({decided['detail']})"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        arrived = [a for a in alertmanager.alerts() if (a.get("labels") or {}).get("alertname") == alertname]
        if arrived:
            labels, annotations = arrived[-1]["labels"], arrived[-1].get("annotations") or {}
            said = annotations.get("event") or annotations.get("summary") or ""
            return f"Alertmanager received {alertname} ({labels.get('severity')}): {said}"
        time.sleep(0.25)
    raise RuntimeError(f"the {rule} alert never reached Alertmanager at {alertmanager.url}; see {demo.log_path}")


def _plan_source(demo: Demo, gpu: int) -> str:
    """Where `plan` says GPU `gpu`'s power limit comes from, and what it is."""
    document = safe_json.loads(demo.cli("plan", "--json", ok_codes=(0, 2)))
    source = document["profile_sources"][str(gpu)]["settings"].get("power_limit_watts", "nowhere")
    item = next(i for i in document["items"] if (i["item"], i["gpu"]) == ("power_limit", gpu))
    return f"plan: GPU {gpu} power limit {item['desired']} from {source}"


def _plan_summary(demo: Demo) -> str:
    document = safe_json.loads(demo.cli("plan", "--json", ok_codes=(0, 2)))
    drifting = [i for i in document["items"] if i["status"] != "in_sync" and i["status"] != "not_applicable"]
    lines = [f"   {len(drifting)} of {len(document['items'])} items differ from the policy, for example:"]
    lines += [
        f"   {i['item']} GPU {i['gpu']}: {i['actual']} (want {i['desired']})"
        for i in drifting[:4]
        if i["gpu"] is not None
    ]
    return "\n".join(lines)
