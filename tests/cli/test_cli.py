"""The CLI end to end, as an operator runs it: real processes, a simulated node, a fake host tree."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import live_processes
from hosttree import make_host_tree

from agent.backend.base import ClockDomain
from agent.backend.errors import GpuErrorKind
from agent.backend.sim import SimulatedBackend
from agent.cli.commands import XID_PARSE_MAX_LINE_BYTES, bounded_lines
from agent.defaults import DEFAULT_RULES_DIR
from agent.demo import standin

pytestmark = pytest.mark.real_daemon

H200_POLICY = """\
mode: {mode}
backend: simulated
simulated: {{profile: {profile}}}
host_root: {root}
state_dir: {state}
policy:
  node: {{transparent_hugepages: never, nouveau: blacklisted}}
  gpus:
    - match: {{model: "NVIDIA H200*"}}
      power_limit_watts: {watts}
      locked_clocks: {{gpu_mhz: [1980, 1980]}}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
      persistence: enabled
      ecc: enabled
    - match: {{model: "NVIDIA RTX PRO 6000*"}}
      power_limit_watts: 260
      locked_clocks: {{gpu_mhz: [1500, 1500]}}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
      persistence: enabled
      ecc: enabled
"""


def gpu_agent(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, input=stdin, env=env, timeout=60
    )


def write_config(tmp_path: Path, *, mode: str = "enforce", profile: str = "h200", watts: float = 600) -> Path:
    root, state = tmp_path / "host", tmp_path / "state"
    make_host_tree(root, kernel_sysfs=False)
    config = tmp_path / "agent.yaml"
    config.write_text(H200_POLICY.format(mode=mode, profile=profile, root=root, state=state, watts=watts))
    return config


def sim(tmp_path: Path, profile: str = "h200") -> SimulatedBackend:
    backend = SimulatedBackend(profile, tmp_path / "state")
    backend.init()
    return backend


def plan_json(config: Path) -> tuple[int, dict[str, object]]:
    result = gpu_agent("plan", "--json", "--config", str(config))
    return result.returncode, json.loads(result.stdout)


def by_item(document: dict[str, object], gpu: int | None = 0) -> dict[str, dict[str, object]]:
    items = document["items"]
    assert isinstance(items, list)
    return {i["item"]: i for i in items if i["gpu"] == gpu}


def test_plan_on_the_simulated_h200_shows_the_right_drift(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    code, doc = plan_json(config)
    assert code == 2
    assert doc["schema"] == 1 and doc["in_sync"] is False and doc["exit_code"] == 2
    gpu = by_item(doc)
    assert (gpu["power_limit"]["status"], gpu["power_limit"]["desired"], gpu["power_limit"]["actual"]) == (
        "drift",
        "600 W",
        "700 W",
    )
    assert gpu["power_limit"]["changes"] == ["set power limit of GPU 0 from 700 W to 600 W (nvidia-smi -i 0 -pl 600)"]
    assert gpu["locked_clocks"]["status"] == "drift"
    assert gpu["fan_curve"]["status"] == "not_applicable"  # SXM H200: no fans
    assert gpu["persistence"]["status"] == "in_sync"
    assert gpu["ecc"]["status"] == "in_sync"
    node = by_item(doc, None)
    assert node["transparent_hugepages"]["status"] == "drift"
    assert node["nouveau"]["status"] == "drift"
    assert node["nouveau"]["changes"][-1] == "run: update-initramfs -u"

    text = gpu_agent("plan", "--config", str(config))
    assert text.returncode == 2
    assert "power_limit            0    drift" in text.stdout
    assert text.stdout.rstrip().endswith("plan: drift")


def test_plan_fits_100_columns_and_shows_every_change_whole(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="mixed")
    text = config.read_text().replace(
        "nouveau: blacklisted}",
        "nouveau: blacklisted, triton_cache: {path: /var/cache/triton, owner: root, group: root, mode: '0755',"
        " services: [sglang]}}",
    )
    config.write_text(text + "services:\n  - {name: sglang, unit: sglang.service, health_url: 'http://127.0.0.1:1/'}\n")
    _, doc = plan_json(config)
    result = gpu_agent("plan", "--config", str(config))
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, result.stdout
    for item in doc["items"]:
        for change in item["changes"] if item["status"] == "drift" else []:
            assert f"    -> {change}" in lines or len(f"    -> {change}") > 100, change
    # the long desired state wraps inside its column: every word is there
    triton = next(i for i in doc["items"] if i["item"] == "triton_cache")
    assert all(word in result.stdout for word in triton["desired"].split())


def test_design_example_policy_on_a_mixed_node(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="mixed")
    code, doc = plan_json(config)
    assert code == 2
    rtx = by_item(doc, 4)
    assert rtx["power_limit"]["desired"] == "260 W" and rtx["power_limit"]["status"] == "drift"
    assert rtx["fan_curve"]["status"] == "drift"
    assert rtx["ecc"]["status"] == "drift"
    assert doc["profiles"] == {"0": 0, "1": 0, "2": 0, "3": 0, "4": 1, "5": 1}


def test_impossible_value_is_a_plan_error_naming_the_range(tmp_path: Path) -> None:
    config = write_config(tmp_path, watts=900)
    result = gpu_agent("plan", "--config", str(config))
    assert result.returncode == 1
    assert "900 W is outside this board's range 200-700 W" in result.stdout
    assert result.stdout.rstrip().endswith("plan: errors")
    # and apply refuses to touch it, while still fixing the rest
    applied = gpu_agent("apply", "--json", "--config", str(config))
    assert applied.returncode == 1
    results = {(r["item"], r["gpu"]): r for r in json.loads(applied.stdout)["results"]}
    assert results[("power_limit", 0)]["outcome"] == "skipped"
    assert results[("locked_clocks", 0)]["outcome"] == "applied"
    assert sim(tmp_path).power_limit_watts(0) == 700.0


def test_apply_then_plan_in_another_process_is_in_sync(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    applied = gpu_agent("apply", "--config", str(config))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    code, doc = plan_json(config)
    assert code == 0, doc
    assert doc["in_sync"] is True
    again = gpu_agent("apply", "--json", "--config", str(config))
    outcomes = {r["outcome"] for r in json.loads(again.stdout)["results"]}
    assert outcomes == {"unchanged"}
    assert (tmp_path / "host/etc/modprobe.d/gpu-agent-nouveau.conf").exists()
    assert (tmp_path / "host/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip() == "never"


def test_observe_mode_changes_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path, mode="observe")
    before = (tmp_path / "host/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    result = gpu_agent("apply", "--json", "--config", str(config))
    assert result.returncode == 1  # drift left unapplied
    doc = json.loads(result.stdout)
    drifting = [r for r in doc["results"] if r["status"] == "drift"]
    assert drifting and all(r["outcome"] == "skipped" and r["mode"] == "observe" for r in drifting)
    assert sim(tmp_path).power_limit_watts(0) == 700.0
    assert (tmp_path / "host/sys/kernel/mm/transparent_hugepage/enabled").read_text() == before
    assert not (tmp_path / "host/etc/modprobe.d/gpu-agent-nouveau.conf").exists()
    human = gpu_agent("apply", "--config", str(config))
    assert "left unchanged: observe mode" in human.stdout
    assert "nothing to restore" in gpu_agent("restore", "--config", str(config)).stdout


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result = gpu_agent("apply", "--dry-run", "--json", "--config", str(config))
    assert result.returncode == 0
    power = next(r for r in json.loads(result.stdout)["results"] if r["item"] == "power_limit")
    assert power["outcome"] == "skipped" and power["outcome_detail"].startswith("dry run: would set power limit")
    assert plan_json(config)[0] == 2


def test_gpu_lost_mid_apply_leaves_the_other_gpus_handled(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="h200x2")
    sim(tmp_path, "h200x2").fail_call(1, "set_power_limit_watts", GpuErrorKind.GPU_LOST)
    result = gpu_agent("apply", "--json", "--config", str(config))
    assert result.returncode == 1
    results = {(r["item"], r["gpu"]): r for r in json.loads(result.stdout)["results"]}
    assert results[("power_limit", 1)]["outcome"] == "failed"
    assert "lost" in results[("power_limit", 1)]["outcome_detail"].lower()
    assert results[("locked_clocks", 1)]["outcome"] == "applied"
    assert results[("power_limit", 0)]["outcome"] == "applied"
    assert results[("transparent_hugepages", None)]["outcome"] == "applied"


def test_lost_gpu_before_plan_is_an_error_item(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="h200x2")
    sim(tmp_path, "h200x2").set_lost(1)
    code, doc = plan_json(config)
    assert code == 1
    lost = by_item(doc, 1)
    assert all(i["status"] == "error" and i["error_kind"] == "gpu_lost" for i in lost.values())
    assert by_item(doc, 0)["power_limit"]["status"] == "drift"


def test_restore_returns_defaults(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="mixed")
    assert gpu_agent("apply", "--config", str(config)).returncode == 0
    backend = sim(tmp_path, "mixed")
    assert backend.power_limit_watts(0) == 600.0
    # fans at a fixed speed, as a daemon killed while it drove them leaves them
    writer = SimulatedBackend("mixed", tmp_path / "state", writable_items=("fan_curve",))
    writer.init()
    writer.set_fan_speed_percent(4, 0, 60)
    writer.set_fan_speed_percent(5, 1, 60)
    backend.reload()
    assert backend.fan_manual(4, 0) and backend.fan_manual(5, 1)
    restored = gpu_agent("restore", "--config", str(config))
    assert restored.returncode == 0, restored.stdout + restored.stderr
    backend.reload()
    assert not backend.fan_manual(4, 0) and not backend.fan_manual(5, 1)
    assert backend.power_limit_watts(0) == 700.0
    assert backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None


def test_status_direct_read(tmp_path: Path) -> None:
    config = write_config(tmp_path, profile="mixed")
    result = gpu_agent("status", "--json", "--config", str(config))
    assert result.returncode == 2, result.stderr  # power_limit drifted in enforce mode: attention needed
    doc = json.loads(result.stdout)
    assert doc["source"] == "direct" and "no daemon" in doc["note"]
    assert doc["verdict"]["problem"] is None
    assert any(line.startswith("policy drift: power_limit on GPU 0") for line in doc["verdict"]["attention"])
    gpus = doc["gpus"]
    assert len(gpus) == 6
    h200 = gpus[0]
    assert h200["name"] == "NVIDIA H200" and h200["power_limit_watts"] == 700.0
    assert h200["fan_speeds_percent"] is None  # not supported: null, not an error
    assert h200["read_errors"] == {}
    assert h200["clock_event_reasons_active"] == ["gpu_idle"]
    assert gpus[4]["fan_speeds_percent"] == [30, 30]
    assert doc["policy"]["in_sync"] is False
    human = gpu_agent("status", "--config", str(config))
    assert "NVIDIA H200" in human.stdout and "items in sync" in human.stdout


def test_status_without_a_driver_says_so_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("backend: nvml\n")
    result = gpu_agent("status", "--config", str(config))
    assert result.returncode == 2  # the driver unreadable: attention needed, never "all healthy"
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert len(problems) == 1, result.stdout
    assert problems[0].startswith("PROBLEM: GPU driver unreadable: NVIDIA driver")
    assert "all healthy" not in result.stdout
    assert "Traceback" not in result.stderr and result.stderr == ""


@pytest.mark.parametrize(
    ("text", "code"),
    [("mode: enforce\n", 0), ("mode: enforce\npolicy: {gpus: [{match: {index: 0}, power_limit_watts: 0}]}\n", 1)],
)
def test_check_config_exit_codes(tmp_path: Path, text: str, code: int) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(text + f"remediation: {{rules_dirs: [{Path(__file__).parents[2] / 'rules'}]}}\n")
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == code, result.stderr
    if code:
        assert result.stderr.strip() == f"{config}:2 policy.gpus[0].power_limit_watts: must be > 0"


def test_bad_config_on_plan_is_one_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("mode: enforce\nbogus: 1\n")
    result = gpu_agent("plan", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.strip() == f"{config}:2 bogus: unknown key"


def test_missing_explicit_config_is_an_error(tmp_path: Path) -> None:
    result = gpu_agent("plan", "--config", str(tmp_path / "none.yaml"))
    assert result.returncode == 1
    assert "cannot read" in result.stderr


def demo_run(directory: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_CONFIG"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "demo", "--dir", str(directory), "--exit-after-scenario"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def assert_scenario_played(out: str) -> None:
    steps = [out.index(f"== {n}.") for n in range(1, 7)]
    assert steps == sorted(steps) and steps[-1] < out.index("scenario done")
    assert "power_limit drifted (650 W, want 600 W) and was corrected" in out
    # The health line lists every thermal reason the GPU reports at that moment (sw alone, or with hw).
    (health,) = [line for line in out.splitlines() if line.startswith("   GPU 4 is ")]
    assert "sw_thermal_slowdown" in health and "check_mechanicals" in health, health
    assert "likely cause: GPU 2 thermal slowdown" in out
    assert "rule xid-restart-service restarted sglang" in out
    assert "600 W (current)" in out and "450 W" in out and "\n   recommended: " in out
    assert "power_limit_watts: " in out and "restored: GPU 0 power limit 600 W" in out


@pytest.mark.skipif(
    not (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")),
    reason="needs Alertmanager: apt-get install -y prometheus-alertmanager (scripts/install-test-deps)",
)
def test_demo_plays_the_scenario_on_a_live_daemon_twice_in_one_dir(tmp_path: Path) -> None:
    """The demo starts a real Alertmanager when one is installed and shows the alert arrive; run
    again into the same --dir it starts from a fresh node; without Alertmanager (nor curl) on PATH
    the alert action is reported as not configured, and the metrics are fetched with python."""
    directory = tmp_path / "demo"
    first = demo_run(directory)
    assert first.returncode == 0, first.stdout + first.stderr
    assert_scenario_played(first.stdout)
    assert "a real Alertmanager (" in first.stdout
    assert "   Alertmanager received InferenceLatencyAboveSlo (warning): service sglang: e2e p95" in first.stdout
    assert "   curl -s http://127.0.0.1:" in first.stdout

    (directory / "notes.txt").write_text("mine")  # not the demo's: left alone
    bare = tmp_path / "bare-path"
    bare.mkdir()
    second = demo_run(directory, path=str(bare))
    assert second.returncode == 0, second.stdout + second.stderr
    assert_scenario_played(second.stdout)
    assert "no Alertmanager installed (prometheus-alertmanager)" in second.stdout
    assert "   the alert: not configured (no Alertmanager configured: set remediation.alertmanager_url" in second.stdout
    assert "curl" not in second.stdout
    assert 'python3 -c "import urllib.request; print(urllib.request.urlopen(' in second.stdout
    assert (directory / "notes.txt").read_text() == "mine"
    pid_file = directory / "sglang.pid"  # the stand-in service is stopped with the demo
    pid = standin.read_pid(pid_file)
    assert pid is None or not standin.running(pid)


def test_check_config_validates_rules_with_file_and_line(tmp_path: Path) -> None:
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    (rules / "10-bad.yaml").write_text(
        "rules:\n  - name: bad\n    match: {xid: {codes: [13]}}\n    actions: [restart_servce]\n"
    )
    config = tmp_path / "agent.yaml"
    config.write_text(f"remediation: {{rules_dir: {rules}}}\n")
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr == (
        f"{rules / '10-bad.yaml'}:4 rules[0].actions[0]: unknown key 'restart_servce' (did you mean"
        " 'restart_service'?)\n"
    )
    (rules / "10-bad.yaml").write_text(
        "rules:\n  - name: bad\n    mach: {xid: {codez: [13]}}\n    actions: [{restart_servce: {}}]\n"
    )
    typos = gpu_agent("check-config", "--config", str(config))
    assert typos.returncode == 1
    assert "rules[0].mach: unknown key (did you mean 'match'?)" in typos.stderr
    assert "rules[0].actions[0].restart_servce: unknown key (did you mean 'restart_service'?)" in typos.stderr
    (rules / "10-bad.yaml").write_text(
        "rules:\n  - name: good\n    match: {xid: {codes: [13]}}\n    actions: [restart_service]\n"
    )
    ok = gpu_agent("check-config", "--config", str(config))
    assert ok.returncode == 0 and "1 rules from" in ok.stdout
    shipped = gpu_agent("check-config", "--config", str(config), "--rules", str(Path(__file__).parents[2] / "rules"))
    assert shipped.returncode == 0, shipped.stderr


def test_the_rules_an_admin_kept_from_0_1_load_and_their_alert_identity_is_warned_of(tmp_path: Path) -> None:
    """0.1's alertmanager steps named their own severity (the rules 0.1 shipped, which an upgrade keeps
    as the admin's: packaging/legacy-rules): they load, and each such field is a warning that names
    file, line and field (`--strict`: exit 1); the step raises the catalogue's alert regardless."""
    legacy = Path(__file__).parents[2] / "packaging/legacy-rules"
    config = tmp_path / "agent.yaml"
    config.write_text(f"remediation: {{rules_dirs: [{legacy}]}}\n")
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "alertmanager.severity: ignored" in line]
    assert len(warned) == 7, result.stderr
    assert warned[0].startswith(f"warning: {legacy / '10-xid.yaml'}:")
    assert ": on_exhausted[0].alertmanager.severity: ignored: an alert's name, severity and labels are the" in warned[0]
    strict = gpu_agent("check-config", "--config", str(config), "--strict")
    assert strict.returncode == 1 and strict.stderr == result.stderr


def test_check_config_shows_where_each_rule_came_from(tmp_path: Path) -> None:
    shipped, admin = tmp_path / "shipped", tmp_path / "admin"
    for directory in (shipped, admin):
        directory.mkdir(mode=0o755)
    good = "rules:\n  - name: {}\n    match: {{gpu_lost: }}\n    actions: [recommend_reboot]\n"
    (shipped / "10-a.yaml").write_text(good.format("a"))
    (shipped / "20-b.yaml").write_text(good.format("b"))
    (admin / "10-a.yaml").write_text(good.format("site-a"))
    (admin / "20-b.yaml").write_text("")
    for file in (*shipped.iterdir(), *admin.iterdir()):
        file.chmod(0o644)
    config = tmp_path / "agent.yaml"
    config.write_text(f"remediation: {{rules_dirs: [{shipped}, {admin}]}}\n")
    result = gpu_agent("check-config", "--config", str(config), "--strict")
    assert result.returncode == 0, result.stderr
    assert "1 rules from 1 files:" in result.stdout
    assert f"  {admin / '10-a.yaml'} (overrides {shipped / '10-a.yaml'})" in result.stdout
    assert f"  {admin / '20-b.yaml'}: masked (disables {shipped / '20-b.yaml'})" in result.stdout


def test_check_config_refuses_a_rules_dir_that_does_not_exist(tmp_path: Path) -> None:
    """A typo in remediation.rules_dirs would have the daemon run without its rules: an error naming
    the file, line and field; `--rules` likewise."""
    config = tmp_path / "agent.yaml"
    config.write_text(f"mode: observe\nremediation:\n  rules_dirs: [{tmp_path / 'rules.dd'}]\n")
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr == (
        f"{config}:3 remediation.rules_dirs: {tmp_path / 'rules.dd'}: no such directory (a typo? the daemon would"
        " run without these rules)\n"
    )
    flag = gpu_agent("check-config", "--config", str(config), "--rules", str(tmp_path / "nope"))
    assert flag.returncode == 1 and f"--rules: {tmp_path / 'nope'}: no such directory" in flag.stderr


def test_check_config_lets_the_default_override_dir_be_absent(tmp_path: Path) -> None:
    shipped = Path(__file__).parents[2] / "rules"
    assert not Path(DEFAULT_RULES_DIR).exists()  # the admin has written no override here
    config = tmp_path / "agent.yaml"
    config.write_text(f"remediation: {{rules_dirs: [{shipped}, {DEFAULT_RULES_DIR}]}}\n")
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"warning: {DEFAULT_RULES_DIR}: no such directory\n"
    strict = gpu_agent("check-config", "--config", str(config), "--strict")
    assert strict.returncode == 1 and "Traceback" not in strict.stderr


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line names `text` (the demo's directory)."""
    return [pid for pid, cmdline in live_processes("cmdline") if text in cmdline and standin.running(pid)]


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_the_demo_and_everything_it_started(tmp_path: Path, signum: signal.Signals) -> None:
    import re
    import time

    directory = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_CONFIG"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--dir", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # the agent and the stand-in server both run once step 1 prints
            if line.startswith("== 1."):
                break
        else:
            pytest.fail(f"the demo ended before step 1: {demo.stderr.read() if demo.stderr else ''}")
        config = (directory / "agent.yaml").read_text()
        # the agent's metrics, the stand-in's port and, where one is installed, the demo's Alertmanager
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", config)]
        alertmanager = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        assert len(ports) == (3 if alertmanager else 2) and not any(_port_free(p) for p in ports)
        assert len(_processes_mentioning(str(directory))) >= (3 if alertmanager else 2)
        demo.send_signal(signum)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 128 + signum, out + err
    assert f"stopping ({signum.name})" in out
    assert "Traceback" not in err
    deadline = time.monotonic() + 5
    while _processes_mentioning(str(directory)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(directory)) == []
    assert all(_port_free(p) for p in ports), ports


def test_a_second_run_on_a_busy_metrics_port_says_what_to_do(tmp_path: Path) -> None:
    import socket

    config = write_config(tmp_path, mode="observe")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config.write_text(
            config.read_text()
            + f'metrics: {{listen: "127.0.0.1:{port}"}}\napi: {{socket: {tmp_path / "agent.sock"}}}\n'
        )
        result = gpu_agent("run", "--config", str(config), "--log-format", "json")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"gpu-agent: metrics.listen 127.0.0.1:{port} is already in use"), result.stderr
    assert "another metrics.listen" in last


def test_restore_json_in_observe_mode_is_json(tmp_path: Path) -> None:
    result = gpu_agent("restore", "--json", "--config", str(write_config(tmp_path, mode="observe")))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == 1 and document["results"] == []
    assert "observe mode" in document["note"]


def test_xid_parse_lines_carry_the_schema() -> None:
    line = "[ 1234.5] NVRM: Xid (PCI:0000:5d:00): 79, pid=4242, name=python3, GPU has fallen off the bus.\n"
    result = gpu_agent("xid", "parse", stdin=line)
    assert result.returncode == 0, result.stderr
    [record] = [json.loads(text) for text in result.stdout.splitlines()]
    assert record["schema"] == 1 and record["xid"] == 79


def test_xid_parse_reads_past_an_endless_line_and_bytes_that_are_not_utf8() -> None:
    line = b"NVRM: Xid (PCI:0000:5d:00): 79, pid=1, name=\xff\xfe, GPU has fallen off the bus.\n"
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "xid", "parse"],
        input=b"a" * (3 * XID_PARSE_MAX_LINE_BYTES + 5) + b"\n" + line,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    [record] = [json.loads(text) for text in result.stdout.splitlines()]
    assert (record["xid"], record["process"]) == (79, "\ufffd\ufffd")


def test_bounded_lines_cut_a_long_line_and_skip_its_rest() -> None:
    stream = io.BytesIO(b"x" * 25 + b"\nshort\n" + b"y" * 10 + b"\n" + b"tail")
    assert list(bounded_lines(stream, limit_bytes=10)) == ["x" * 10, "short", "y" * 10, "tail"]


def test_ack_of_nothing_is_an_error_but_ack_all_is_not(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    typo = gpu_agent("ack", "xid-restart-servce", "--config", str(config))
    assert typo.returncode == 1
    assert (
        typo.stderr.startswith("gpu-agent: xid-restart-servce: nothing to acknowledge")
        and "Traceback" not in typo.stderr
    )
    everything = gpu_agent("ack", "all", "--config", str(config))
    assert everything.returncode == 0, everything.stderr
    assert "all: nothing to acknowledge" in everything.stdout


def test_ack_reboot_withdraws_the_recommendation_from_status(tmp_path: Path) -> None:
    """The reboot recommendation shows how it clears, and `ack reboot` clears it (no daemon here:
    in the store's directory); a second ack finds nothing."""
    config = write_config(tmp_path)
    gpu_agent("ack", "all", "--config", str(config))  # the store, made as a daemon would
    (tmp_path / "state" / "reboot-recommended").write_text(json.dumps({"reason": "Xid 79", "event": "xid"}))
    before = gpu_agent("status", "--config", str(config))
    assert "reboot recommended: Xid 79 (`gpu-agent ack reboot` once dealt with otherwise)" in before.stdout
    acked = gpu_agent("ack", "reboot", "--config", str(config))
    assert acked.returncode == 0, acked.stderr
    assert acked.stdout == "reboot: reboot recommendation withdrawn: no longer in the verdict or the alerts\n"
    assert "REBOOT RECOMMENDED" not in gpu_agent("status", "--config", str(config)).stdout
    again = gpu_agent("ack", "reboot", "--config", str(config))
    assert again.returncode == 1 and "nothing to acknowledge" in again.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--json"],
        ["apply", "--json", "--dry-run"],
        ["restore", "--json"],
        ["status", "--json", "--direct"],
        ["events", "--json"],
        ["xid", "explain", "79", "--json"],
    ],
)
def test_every_json_flag_prints_json(tmp_path: Path, argv: list[str]) -> None:
    args = [*argv, "--config", str(write_config(tmp_path, mode="observe"))] if argv[0] != "xid" else argv
    result = gpu_agent(*args)
    assert result.returncode in (0, 2), result.stderr
    assert json.loads(result.stdout)["schema"] == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("limit", ["0", "-5", "ten", "²", "٣", "1000001", "9" * 23])
def test_events_limit_must_be_a_count_sqlite_can_take(tmp_path: Path, limit: str) -> None:
    """SQLite would read a negative LIMIT as none at all, and refuse one beyond 64 bits with an OverflowError."""
    result = gpu_agent("events", "--limit", limit, "--config", str(write_config(tmp_path)))
    assert result.returncode == 2
    assert f"argument --limit: '{limit}': give a whole number from 1 to 1000000" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_checkout_wrapper_runs_the_venv_cli_or_says_how_to_set_it_up(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    wrapper = copy / "scripts" / "gpu-agent"
    wrapper.write_bytes((repo / "scripts" / "gpu-agent").read_bytes())
    wrapper.chmod(0o755)
    missing = subprocess.run([wrapper, "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr == f"gpu-agent: {copy}/.venv is not set up yet: run {copy}/scripts/setup first\n"
    # A .venv whose gpu-agent is this interpreter running the CLI, called from another directory.
    (copy / ".venv/bin").mkdir(parents=True)
    (copy / ".venv/bin/gpu-agent").write_text(f'#!/bin/sh\nexec {sys.executable} -m agent.cli "$@"\n')
    (copy / ".venv/bin/gpu-agent").chmod(0o755)
    found = subprocess.run([wrapper, "--version"], capture_output=True, text=True, cwd="/")
    assert found.returncode == 0, found.stderr
    assert found.stdout.startswith("gpu-agent ")
