"""The CLI end to end, as an operator runs it: real processes, a simulated node, a fake host tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hosttree import make_host_tree

from agent import standin
from agent.backend.base import ClockDomain
from agent.backend.errors import GpuErrorKind
from agent.backend.sim import SimulatedBackend

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
    assert backend.fan_manual(4, 0) and backend.power_limit_watts(0) == 600.0
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
    config.write_text(text)
    result = gpu_agent("check-config", "--config", str(config))
    assert result.returncode == code
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


def test_demo_plays_the_scenario_on_a_live_daemon(tmp_path: Path) -> None:
    result = gpu_agent("demo", "--dir", str(tmp_path / "demo"), "--exit-after-scenario")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert (
        out.index("== 1.") < out.index("== 2.") < out.index("== 3.") < out.index("== 4.") < out.index("scenario done")
    )
    assert "power_limit drifted (650 W, want 600 W) and was corrected" in out
    assert "GPU 4 is degraded: clocks slowed by sw_thermal_slowdown" in out
    assert "rule xid-restart-service restarted sglang" in out
    pid_file = tmp_path / "demo/sglang.pid"  # the stand-in service is stopped with the demo
    assert not pid_file.exists() or not standin.running(int(pid_file.read_text()))


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
    assert result.stderr.startswith(f"{rules / '10-bad.yaml'}:4 rules[0].actions[0]")
    (rules / "10-bad.yaml").write_text(
        "rules:\n  - name: good\n    match: {xid: {codes: [13]}}\n    actions: [restart_service]\n"
    )
    ok = gpu_agent("check-config", "--config", str(config))
    assert ok.returncode == 0 and "1 rules from" in ok.stdout
    shipped = gpu_agent("check-config", "--config", str(config), "--rules", str(Path(__file__).parent.parent / "rules"))
    assert shipped.returncode == 0, shipped.stderr
