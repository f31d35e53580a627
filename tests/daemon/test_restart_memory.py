"""A restart of the agent is not a reboot: restarted (a real `gpu-agent run` process) in the middle of
every fault the simulator can inject, it forgets nothing; `ack gpu:UUID` forgets a lost GPU; a new
boot id starts afresh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DEFAULT_POLICY, RunningAgent, free_port, running_agent
from helpers import wait_until
from hosttree import make_host_tree

from agent.defaults import REBOOT_FLAG_NAME
from agent.host.paths import BOOT_ID_PATH

pytestmark = pytest.mark.real_daemon

PROFILE = "h200x8"
BOOT_A = "1f0e4c52-0000-4000-8000-00000000000a"
BOOT_B = "1f0e4c52-0000-4000-8000-00000000000b"
LOST_RULE = """rules:
  - name: gpu-lost
    match: {gpu_lost: {}}
    actions: [recommend_reboot]
    cooldown_seconds: 3600
    max_attempts: 3
    window_seconds: 86400
"""
#: One fault kind per line, spread over the eight GPUs so each keeps its own verdict (a lost GPU
#: answers nothing else). `reboot` is the one kind left out: it is the reboot test below.
FAULTS: tuple[tuple[str, ...], ...] = (
    ("xid", "48", "--gpu", "0", "--source", "both"),
    ("xid", "13", "--gpu", "0", "--source", "kmsg"),
    ("lost", "--gpu", "1"),
    ("reset-required", "--gpu", "2"),
    ("throttle", "--gpu", "3", "--reason", "hw_thermal_slowdown"),
    ("temperature", "--gpu", "3", "--celsius", "96"),
    ("ecc", "--gpu", "4", "--uncorrected", "2", "--corrected", "3"),
    ("remap", "--gpu", "4", "--pending"),
    ("pcie", "--gpu", "5", "--width", "8"),
    ("drift", "--gpu", "5", "--power-limit-watts", "450"),
    ("hang", "--gpu", "6", "--call", "temperature_celsius", "--seconds", "2"),
    ("fail", "--gpu", "7", "--call", "power_usage_watts", "--kind", "unknown"),
    ("processes", "--gpu", "7", "4242"),
    ("recovery-action", "--gpu", "7", "node_reboot"),
)
INJECTED_KINDS = {fault[0] for fault in FAULTS} | {"reboot"}


def write_boot_id(host_root: Path, boot_id: str) -> None:
    path = host_root / BOOT_ID_PATH.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")


def node(tmp_path: Path, boot_id: str = BOOT_A) -> Path:
    make_host_tree(tmp_path / "host", kernel_sysfs=False)
    write_boot_id(tmp_path / "host", boot_id)
    rules = tmp_path / "rules.d"
    rules.mkdir()
    (rules / "50-lost.yaml").write_text(LOST_RULE)
    return rules


def cli(agent: RunningAgent | Path, *args: str) -> str:
    config = agent if isinstance(agent, Path) else agent.config_path
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def series(metrics: str, family: str) -> dict[str, float]:
    """`{labels}` -> value of one family's samples in a /metrics text."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            name_labels, _, value = line.rpartition(" ")
            found[name_labels[len(family) :]] = float(value)
    return found


def memory_view(agent: RunningAgent) -> dict[str, Any]:
    """What the operator must still see after a restart: every GPU with its verdict, the Xid
    counters with their last-seen times, in status and in /metrics, and the reboot flag."""
    status = agent.status()
    metrics = agent.metrics()
    flag = agent.state_dir / REBOOT_FLAG_NAME
    # A GPU whose calls hang is stale: its `up` is that of the last sample it answered, which a fresh
    # process may not have had yet. Its verdict (degraded, readings stale) is what must survive.
    stale = {g["uuid"] for g in status["gpus"] if g["stale"]}
    return {
        "gpus": {
            g["uuid"]: (
                g["index"],
                None if g["uuid"] in stale else g["up"],
                g["health"]["state"],
                g["health"]["reason"],
            )
            for g in status["gpus"]
        },
        "xids": sorted((x["gpu"], x["uuid"], x["xid"], x["count"], x["last_seen_seconds"]) for x in status["xids"]),
        "gpu_up": {k: v for k, v in series(metrics, "gpu_agent_gpu_up").items() if not any(u in k for u in stale)},
        "xid_total": series(metrics, "gpu_agent_xid_errors_total"),
        "xid_last_seen": series(metrics, "gpu_agent_xid_last_seen_timestamp_seconds"),
        "expected": series(metrics, "gpu_agent_gpus_expected"),
        "reboot_flag": json.loads(flag.read_text())["rule"] if flag.exists() else None,
        # a fault still present after the restart is the same stored fault: not acted on again
        "remediations": sorted((r["rule"], r["action"], r["outcome"], r["count"]) for r in status["remediations"]),
    }


def settled(agent: RunningAgent, wanted: Any = None) -> Any:
    """The view once two reads a loop apart agree (and equal `wanted`, when given)."""
    last: list[Any] = [None]

    def stable() -> Any:
        now = memory_view(agent)
        same = now == last[0] and (wanted is None or now == wanted)
        last[0] = now
        return now if same else None

    def differences() -> str:
        if wanted is None or last[0] is None:
            return f"a settled view; last {last[0]}"
        return "the view from before the restart; differs in " + "; ".join(
            f"{key}: {wanted[key]} != {last[0][key]}" for key in wanted if wanted[key] != last[0][key]
        )

    return wait_until(stable, 60.0, differences, poll_seconds=0.5)


def test_faults_cover_every_kind_the_simulator_injects() -> None:
    from agent.demo.inject import FAULTS as SIMULATOR_FAULTS

    assert set(SIMULATOR_FAULTS) == INJECTED_KINDS


def test_restart_in_the_middle_of_every_fault_forgets_nothing(tmp_path: Path) -> None:
    rules = node(tmp_path)
    with running_agent(tmp_path, profile=PROFILE, rules_dir=rules, watchdog_usec=None) as agent:
        agent.notifications.wait_for("READY", "1")
        for fault in FAULTS:
            cli(agent, "inject", *fault)

        def every_fault_seen() -> bool:
            status = agent.status()
            return (
                (agent.state_dir / REBOOT_FLAG_NAME).exists()
                and len(status["xids"]) == 2
                and all(g["health"]["state"] != "healthy" for g in status["gpus"])
            )

        # Every GPU carries a fault; the slow tier (remapping, link, recovery action) takes a while.
        wait_until(every_fault_seen, 90.0, "every GPU faulty, both Xids, the reboot flag", poll_seconds=0.5)
        before = settled(agent)
    assert before["gpus"] and not before["gpus"][next(iter(u for u, g in before["gpus"].items() if g[0] == 1))][1]
    assert before["expected"] == {"": 8.0}
    assert [(gpu, xid, count) for gpu, _, xid, count, _ in before["xids"]] == [(0, 13, 1), (0, 48, 1)]
    assert before["gpus"][next(u for u, g in before["gpus"].items() if g[0] == 0)][2] == "unhealthy"

    with running_agent(tmp_path, profile=PROFILE, rules_dir=rules, watchdog_usec=None) as agent:
        agent.notifications.wait_for("READY", "1")
        after = settled(agent, before)
        assert after == before
        # The lost GPU was remembered (its identity unreadable now), not rediscovered.
        assert "node memory loaded" in agent.log()


def test_ack_forgets_a_lost_gpu_and_a_reboot_starts_fresh(tmp_path: Path) -> None:
    rules = node(tmp_path)
    with running_agent(tmp_path, profile="h200x2", rules_dir=rules, watchdog_usec=None) as agent:
        agent.notifications.wait_for("READY", "1")
        cli(agent, "inject", "xid", "31", "--gpu", "0", "--source", "nvml")
        cli(agent, "inject", "lost", "--gpu", "1")
        wait_until(lambda: not agent.status()["gpus"][1]["up"], 30.0, "GPU 1 lost", poll_seconds=0.3)
        lost_uuid = agent.status()["gpus"][1]["uuid"]
    with running_agent(tmp_path, profile="h200x2", rules_dir=rules, watchdog_usec=None) as agent:
        agent.notifications.wait_for("READY", "1")
        status = agent.status()
        assert [(g["uuid"], g["up"]) for g in status["gpus"]][1] == (lost_uuid, False)
        assert series(agent.metrics(), "gpu_agent_gpu_up")[f'{{gpu="1",uuid="{lost_uuid}"}}'] == 0.0
        assert "acknowledged gone" in cli(agent, "ack", f"gpu:{lost_uuid}")
        wait_until(
            lambda: (
                [g["index"] for g in agent.status()["gpus"]] == [0]
                and series(agent.metrics(), "gpu_agent_gpus_expected") == {"": 1.0}
            ),
            30.0,
            "the acknowledged GPU gone from status and /metrics",
            poll_seconds=0.3,
        )
        assert lost_uuid not in agent.metrics()
        assert [(x["xid"], x["count"]) for x in agent.status()["xids"]] == [(31, 1)]

    # The node reboots: the simulated GPUs come back, the kernel gives a new boot id.
    write_boot_id(tmp_path / "host", BOOT_B)
    cli(tmp_path / "agent.yaml", "inject", "reboot")
    with running_agent(tmp_path, profile="h200x2", rules_dir=rules, watchdog_usec=None) as agent:
        agent.notifications.wait_for("READY", "1")
        wait_until(
            lambda: [g["up"] for g in agent.status()["gpus"]] == [True, True],
            30.0,
            "both GPUs up after the reboot",
            poll_seconds=0.3,
        )
        status = agent.status()
        assert status["xids"] == []
        assert all(g["health"]["state"] == "healthy" for g in status["gpus"])
        assert series(agent.metrics(), "gpu_agent_gpus_expected") == {"": 2.0}


HELD_SLOWDOWN_RULE = """rules:
  - name: held-slowdown
    match: {throttle: {reasons: [sw_thermal_slowdown], held_seconds: 0.5}}
    actions: [recommend_reboot]
    cooldown_seconds: 0
    max_attempts: 100
    window_seconds: 86400
"""
#: Appended to the policy block of the harness's configuration: a top-level `services:` key.
FAILING_SERVICE = """services:
  - name: sglang
    health_url: {url}
    probe_interval_seconds: 0.05
    probe_timeout_seconds: 1
    unhealthy_after_probes: 100
"""
CLOCK_EVENT_SECONDS = "gpu_agent_gpu_clock_event_seconds_total"


def held_slowdown_view(agent: RunningAgent) -> tuple[float, list[float], int]:
    """GPU 0's sw_thermal_slowdown seconds in /metrics, the start times of the held slowdowns the
    rule acted on (a restarted clock would be a new fault), and the probe streak of sglang."""
    seconds = next(
        (
            value
            for labels, value in series(agent.metrics(), CLOCK_EVENT_SECONDS).items()
            if 'gpu="0"' in labels and 'reason="sw_thermal_slowdown"' in labels
        ),
        0.0,
    )
    history = json.loads(cli(agent, "events", "--json"))
    starts = sorted(e["data"]["active_since_seconds"] for e in history["events"] if e["key"].endswith("/held-slowdown"))
    streak = next(s["consecutive_failures"] for s in agent.status()["services"] if s["name"] == "sglang")
    return seconds, starts, streak


def test_restart_keeps_clock_event_time_the_held_slowdown_and_a_probe_streak(tmp_path: Path) -> None:
    make_host_tree(tmp_path / "host", kernel_sysfs=False)
    write_boot_id(tmp_path / "host", BOOT_A)
    rules = tmp_path / "rules.d"
    rules.mkdir()
    (rules / "50-held.yaml").write_text(HELD_SLOWDOWN_RULE)
    config = {
        "profile": "h200x2",
        "rules_dir": rules,
        "watchdog_usec": None,
        "policy": DEFAULT_POLICY + FAILING_SERVICE.format(url=f"http://127.0.0.1:{free_port()}/health"),
    }
    with running_agent(tmp_path, **config) as agent:
        agent.notifications.wait_for("READY", "1")
        cli(agent, "inject", "throttle", "--gpu", "0", "--reason", "sw_thermal_slowdown")
        wait_until(
            lambda: (lambda view: view[0] >= 2.0 and len(view[1]) == 1 and view[2] >= 5)(held_slowdown_view(agent)),
            60.0,
            "2 s of slowdown on GPU 0, the rule acting on it once, five failed probes",
            poll_seconds=0.3,
        )
        seconds_before, starts_before, streak_before = held_slowdown_view(agent)

    with running_agent(tmp_path, **config) as agent:
        agent.notifications.wait_for("READY", "1")
        seconds_after, starts_after, streak_after = held_slowdown_view(agent)
        assert seconds_after >= seconds_before  # a counter: never down
        assert starts_after == starts_before  # the same held slowdown, not a new one
        assert streak_after >= streak_before
        # And it goes on counting from there.
        wait_until(
            lambda: held_slowdown_view(agent)[0] >= seconds_before + 1.0,
            30.0,
            "the slowdown time growing after the restart",
            poll_seconds=0.3,
        )
        assert held_slowdown_view(agent)[1] == starts_before
