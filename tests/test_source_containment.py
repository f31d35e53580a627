"""Each input from an inference server or a command the agent runs is contained: a running daemon
(a real process on a simulated RTX PRO 6000, with a real notify socket) faces a hostile source (a
real server process that trickles its headers, answers pages it cannot believe or JSON nested
60 000 deep; commands that flood their output and hang) and still keeps the fans on the curve,
puts a moved power limit back and sends WATCHDOG=1 on time. The source's failure is its own
reported error."""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import RunningAgent, running_agent
from helpers import wait_until
from slow_endpoint import SlowEndpoint

from agent.backend.sim import SimulatedBackend

pytestmark = pytest.mark.real_daemon

WAIT_SECONDS = 20.0

POLICY = """\
  gpus:
    - match: {model: "NVIDIA RTX PRO 6000*"}
      power_limit_watts: 450
      fan_curve: [[30, 30], [50, 65], [75, 100]]
policy_interval_seconds: 1
"""

#: A start or stop command that writes without end: only its tail may stay in the agent's memory.
FLOOD = "[/bin/sh, -c, 'yes flooding-output-line-of-a-service-command']"

#: The agent's peak resident memory while a source floods it (VmHWM): about 65 MB measured on the
#: simulated node, far below the hundreds of MB a flood writes in a few seconds.
RSS_BOUND_KIB = 160 * 1024


def service(name: str, url: str, extra: str = "") -> str:
    return (
        f"  - name: {name}\n    manager: command\n    start_command: [/bin/true]\n    stop_command: [/bin/true]\n"
        f'    health_url: "{url}"\n    probe_interval_seconds: 0.3\n    probe_timeout_seconds: 0.5\n'
        f"    scrape_interval_seconds: 0.5\n{extra}"
    )


def assert_the_loop_is_unhurt(agent: RunningAgent) -> None:
    """WATCHDOG=1 on time, fans following the curve, a moved power limit put back."""
    gpus = SimulatedBackend("rtx-pro-6000", agent.state_dir)
    gpus.init()
    before = len(agent.notifications.times("WATCHDOG"))
    for celsius, percent in ((60, 79), (45, 56)):
        gpus.set_temperature(0, celsius)
        wait_until(lambda p=percent: gpus.fan_speed_percent(0, 0) == p, WAIT_SECONDS, f"fans at {percent} %")
    operator = SimulatedBackend("rtx-pro-6000", agent.state_dir, writable_items=["power_limit"])
    operator.init()
    operator.set_power_limit_watts(0, 500)
    wait_until(lambda: gpus.power_limit_watts(0) == 450.0, WAIT_SECONDS, "the moved power limit put back")
    agent.notifications.poll(2.0)
    pings = agent.notifications.times("WATCHDOG")
    assert len(pings) >= before + 3, pings[-5:]
    recent = [t for t in pings if t > pings[-1] - 2.0]
    assert max(b - a for a, b in itertools.pairwise(recent)) < 0.9, recent
    assert agent.process.poll() is None


def finished_remediations(agent: RunningAgent, rule: str, what: str) -> list[dict[str, Any]]:
    """Waits for `rule`'s remediations that have ended (neither running nor suppressed)."""
    return wait_until(
        lambda: [
            r
            for r in agent.status()["recent_remediations"]
            if r["rule"] == rule and r["outcome"] not in ("running", "suppressed")
        ],
        WAIT_SECONDS,
        what,
    )


def peak_rss_kib(agent: RunningAgent, field: str = "VmHWM") -> int:
    """The agent's peak resident memory (VmHWM), or its current one (VmRSS)."""
    status = Path(f"/proc/{agent.process.pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def test_hostile_metrics_pages_are_each_services_error(tmp_path: Path) -> None:
    """A server that trickles its response headers (the scrape outside its deadline before: no
    `metrics_up` series at all) and one whose page carries NaN buckets (the StopIteration that
    killed `gpu-agent run`)."""
    page = tmp_path / "page.txt"
    page.write_text(
        '# TYPE sglang:e2e_request_latency_seconds histogram\nsglang:e2e_request_latency_seconds_bucket{le="1"} NaN\n'
        'sglang:e2e_request_latency_seconds_bucket{le="+Inf"} NaN\nsglang:e2e_request_latency_seconds_count NaN\n'
    )
    with SlowEndpoint("drip", "--interval", "0.1") as dripping, SlowEndpoint("file", "--body", str(page)) as nan:
        services = "services:\n" + service("dripping", dripping.url("/health")) + service("nan", nan.url("/health"))
        # The scrape's deadline (the shorter of its interval and the probe timeout) is 0.5 s, room
        # enough for the answering server on a loaded test machine.
        with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY + services, interval=1.0) as agent:
            agent.notifications.wait_for("READY", "1")
            wait_until(
                lambda: (
                    'gpu_agent_service_metrics_up{service="dripping"} 0.0' in (text := agent.metrics())
                    and 'gpu_agent_service_metrics_up{service="nan"} 0.0' in text
                ),
                WAIT_SECONDS,
                "both services' metrics_up at 0",
            )
            errors = {s["name"]: s["metrics"]["metrics_error"] for s in agent.status()["services"]}
            assert errors["dripping"] == "timed out after 0.5 s"
            assert errors["nan"].startswith("unreadable page: sglang:e2e_request_latency_seconds has a bucket")
            assert_the_loop_is_unhurt(agent)
            assert "Traceback" not in agent.log()


#: How long the churning servers are scraped (every 0.2 s), and how much the agent's resident memory
#: may grow meanwhile: each window keeps at most 8 MiB. Before the bounds, the token counter's churn
#: alone grew the agent by about 5 MiB a second at one scrape a second.
CHURN_SECONDS = 30.0
CHURN_GROWTH_BOUND_KIB = 32 * 1024


def test_label_churn_is_each_services_error_and_memory_stays_bounded(tmp_path: Path) -> None:
    """Two servers whose series take new label values on every scrape: one writes 5000 series of
    its generated-token counter (past a page's bound of label sets), the other 200 of every family
    (within a page's bound, past the window's bound of series within a few scrapes). The agent's
    memory stays flat and each service shows the churn as its `unreadable page` error."""
    with (
        SlowEndpoint("churn", "--churn", "tokens", "--series", "5000") as tokens,
        SlowEndpoint("churn", "--churn", "every-family", "--series", "200") as every,
    ):
        churning = (tokens, every)
        fast = "    scrape_interval_seconds: 0.2\n    probe_timeout_seconds: 2\n"
        services = "services:\n" + service("tokens", tokens.url("/health"), fast)
        services += service("every", every.url("/health"), fast)
        services = services.replace("    scrape_interval_seconds: 0.5\n", "").replace(
            "    probe_timeout_seconds: 0.5\n", ""
        )
        with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY + services, interval=1.0) as agent:
            agent.notifications.wait_for("READY", "1")
            wait_until(
                lambda: all(sum(1 for line in server.lines if line.startswith("request")) >= 3 for server in churning),
                WAIT_SECONDS,
                "both servers scraped",
            )
            started_kib = peak_rss_kib(agent, "VmRSS")
            began = time.monotonic()
            rss_kib = [started_kib]
            while time.monotonic() - began < CHURN_SECONDS:
                time.sleep(2.0)
                rss_kib.append(peak_rss_kib(agent, "VmRSS"))
            errors = {s["name"]: (s.get("metrics") or {}).get("metrics_error") for s in agent.status()["services"]}
            text = agent.metrics()
            assert_the_loop_is_unhurt(agent)
            assert "Traceback" not in agent.log()
    assert max(rss_kib) - started_kib < CHURN_GROWTH_BOUND_KIB, rss_kib
    assert errors["tokens"] == "unreadable page: sglang:generation_tokens has more than 256 label sets", errors
    assert re.fullmatch(
        r"unreadable page: \d+ series over the window, more than the 1024 kept \(labels that take new values on"
        r" every scrape\?\)",
        errors["every"],
    ), errors
    for name in ("tokens", "every"):
        assert f'gpu_agent_service_metrics_up{{service="{name}"}} 0.0' in text
    scraped = sum(1 for line in [*tokens.lines, *every.lines] if line.startswith("request"))
    assert scraped > CHURN_SECONDS / 0.2, scraped  # both were scraped all along
    print(
        f"\nchurn: {scraped} pages in {CHURN_SECONDS:g} s, RSS {started_kib // 1024} MiB, at most {max(rss_kib) // 1024} MiB"
    )


def test_a_trickling_health_endpoint_and_flooding_service_commands_leave_the_action_worker_free(
    tmp_path: Path,
) -> None:
    """The health endpoint trickles its headers: probes fail at their deadline, the service is
    declared unhealthy and a rule restarts it, with stop and start commands that flood their output
    until their timeout and a readiness wait on the same endpoint. The restart ends (it held the
    single action worker for 40 s and more before), the agent's memory stays bounded, the loop
    is unhurt."""
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    (rules / "10-test.yaml").write_text(
        "rules:\n  - name: restart-unhealthy\n    match: {service_unhealthy: {probes: 3}}\n"
        "    actions:\n      - restart_service\n    cooldown_seconds: 0\n    max_attempts: 1\n"
    )
    os.chmod(rules / "10-test.yaml", 0o644)
    with SlowEndpoint("drip", "--interval", "0.1") as dripping:
        extra = "    command_timeout_seconds: 1\n    ready_timeout_seconds: 2\n    metrics_url: false\n"
        text = "services:\n" + service("llm", dripping.url("/health"), extra)
        text = text.replace("start_command: [/bin/true]", f"start_command: {FLOOD}")
        text = text.replace("stop_command: [/bin/true]", f"stop_command: {FLOOD}")
        with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY + text, rules_dir=rules) as agent:
            agent.notifications.wait_for("READY", "1")
            began = time.monotonic()
            finished = finished_remediations(agent, "restart-unhealthy", "the restart to end")
            assert time.monotonic() - began < 15.0
            assert finished[0]["outcome"] == "failed", finished
            assert "timed out after 1 s" in finished[0]["detail"] or "timed out" in finished[0]["detail"], finished
            (listed,) = agent.status()["services"]
            assert listed["up"] is False and "timed out after 0.5 s" in listed["detail"]
            assert_the_loop_is_unhurt(agent)
            assert peak_rss_kib(agent) < RSS_BOUND_KIB


def test_a_generate_probe_answered_with_deep_json_is_a_counted_failure(tmp_path: Path) -> None:
    body = tmp_path / "brackets"
    body.write_bytes(b"[" * 60_000)
    with SlowEndpoint("file", "--body", str(body)) as server:
        extra = "    probe: generate\n    kind: vllm\n    metrics_url: false\n"
        services = "services:\n" + service("llm", server.url("/health"), extra)
        with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY + services) as agent:
            agent.notifications.wait_for("READY", "1")
            wait_until(lambda: agent.status()["services"][0]["up"] is False, WAIT_SECONDS, "the service declared down")
            assert agent.status()["services"][0]["detail"] == "/v1/models lists no model"
            assert_the_loop_is_unhurt(agent)
            assert "RecursionError" not in agent.log()


def test_a_hook_that_floods_and_hangs_is_cut_at_its_timeout(tmp_path: Path) -> None:
    """A rule's hook writes without end and never exits: it is killed at its timeout with only its
    tail kept, the remediation ends, the loop is unhurt."""
    hook = tmp_path / "hooks" / "flood.sh"
    hook.parent.mkdir(mode=0o755)
    hook.write_text("#!/bin/sh\nyes hook-output-without-end\n")
    os.chmod(hook, 0o755)
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    (rules / "10-test.yaml").write_text(
        "rules:\n  - name: flooding-hook\n    match: {service_unhealthy: {probes: 1}}\n"
        f"    actions:\n      - run_hook: {{argv: [{hook}], timeout_seconds: 3}}\n    cooldown_seconds: 0\n"
    )
    os.chmod(rules / "10-test.yaml", 0o644)
    with SlowEndpoint("silent") as silent:
        services = "services:\n" + service("llm", silent.url("/health"), "    unhealthy_after_probes: 1\n")
        with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY + services, rules_dir=rules) as agent:
            agent.notifications.wait_for("READY", "1")
            finished = finished_remediations(agent, "flooding-hook", "the hook to end")
            detail = finished[0]["detail"]
            assert finished[0]["outcome"] == "failed"
            assert "timed out after 3 s (process group killed)" in detail and "bytes cut]" in detail, detail
            assert_the_loop_is_unhurt(agent)
            assert peak_rss_kib(agent) < RSS_BOUND_KIB


#: How long the chaos run throws hostile answers at the daemon: long enough for every kind of
#: answer to reach every reader many times (a request every 0.3 s per probe, 0.5 s per scrape).
CHAOS_SECONDS = 45.0


def test_chaos_every_hostile_source_at_once(tmp_path: Path) -> None:
    """One server process answers each request with a hostile answer drawn at random (trickled
    headers, silence, resets, NaN/Inf/non-cumulative/`le="abc"` pages, 120k buckets, 9 MB, 60 000
    `[`, bytes that are not HTTP, 503, and now and then a good page) to the scrapes, health and
    generate probes of three services; the services it fails are restarted with stop and start
    commands that flood their output, and a hook that floods runs on every failure. For the whole
    run the fans follow the curve, a moved power limit is put back, WATCHDOG=1 never comes late,
    the agent's memory stays under RSS_BOUND_KIB, and no reader crashes."""
    hook = tmp_path / "hooks" / "flood.sh"
    hook.parent.mkdir(mode=0o755)
    hook.write_text("#!/bin/sh\nyes hook-output-without-end\n")
    os.chmod(hook, 0o755)
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    (rules / "10-test.yaml").write_text(
        "rules:\n"
        "  - name: chaos-hook\n    match: {service_unhealthy: {probes: 1}}\n"
        f"    actions:\n      - run_hook: {{argv: [{hook}], timeout_seconds: 1}}\n    cooldown_seconds: 0\n"
        "    max_attempts: 1000\n"
        "  - name: chaos-restart\n    match: {service_unhealthy: {probes: 1}}\n"
        "    actions:\n      - restart_service\n    cooldown_seconds: 0\n    max_attempts: 1000\n"
    )
    os.chmod(rules / "10-test.yaml", 0o644)
    flooding = "    command_timeout_seconds: 1\n    ready_timeout_seconds: 1\n    unhealthy_after_probes: 1\n"
    with SlowEndpoint("chaos", "--seed", "22") as server:
        text = "services:\n" + service("scraped", server.url("/health"), flooding)
        text += service("vllm", server.url("/health"), flooding + "    probe: generate\n    kind: vllm\n")
        text += service("sglang", server.url("/health"), flooding + "    probe: generate\n")
        text = text.replace("start_command: [/bin/true]", f"start_command: {FLOOD}")
        text = text.replace("stop_command: [/bin/true]", f"stop_command: {FLOOD}")
        with running_agent(
            tmp_path,
            profile="rtx-pro-6000",
            policy=POLICY + text,
            rules_dir=rules,
            interval=0.5,
            watchdog_usec=2_000_000,
        ) as agent:
            agent.notifications.wait_for("READY", "1")
            gpus = SimulatedBackend("rtx-pro-6000", agent.state_dir)
            gpus.init()
            operator = SimulatedBackend("rtx-pro-6000", agent.state_dir, writable_items=["power_limit"])
            operator.init()
            began = time.monotonic()
            rss_kib: list[int] = []
            rounds = 0
            # The pings are stamped when read: read them as they come, beside the checks below.
            done = threading.Event()

            def listen() -> None:
                while not done.is_set():
                    agent.notifications.poll(0.1)

            listening = threading.Thread(target=listen, daemon=True)
            listening.start()
            try:
                while time.monotonic() - began < CHAOS_SECONDS:
                    celsius, percent = ((60, 79), (45, 56))[rounds % 2]
                    gpus.set_temperature(0, celsius)
                    operator.set_power_limit_watts(0, 500 + rounds)
                    wait_until(
                        lambda p=percent: gpus.fan_speed_percent(0, 0) == p, WAIT_SECONDS, f"fans at {percent} %"
                    )
                    wait_until(lambda: gpus.power_limit_watts(0) == 450.0, WAIT_SECONDS, "the power limit put back")
                    rss_kib.append(peak_rss_kib(agent, "VmRSS"))
                    time.sleep(1.0)
                    rounds += 1
            finally:
                done.set()
                listening.join()
            assert agent.process.poll() is None
            pings = [t for t in agent.notifications.times("WATCHDOG") if t >= began]
            assert max(b - a for a, b in itertools.pairwise(pings)) < 1.8, pings
            assert peak_rss_kib(agent) < RSS_BOUND_KIB, rss_kib
            served = sum(1 for line in server.lines if line.startswith("request"))
            log = agent.log()
    assert rounds >= 5 and served > 100, (rounds, served)
    assert "crashed" not in log and "Traceback" not in log, log[-3000:]
    print(f"\nchaos: {rounds} rounds, {served} hostile answers, RSS max {max(rss_kib) // 1024} MiB")
