"""`gpu-agent tune power` against a real daemon process on a simulated H200 node with a real
stand-in sglang server driven by a closed-loop load on GPU 0: the sweep finds the optimum the
simulator's physics implies, an SLO breach stops the descent, thin traffic and observe mode are
refused, the policy loop never fights the sweep, and a kill -9 in the middle of a step leaves the
original limit restored once the daemon starts again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import RunningAgent, running_agent
from helpers import HttpAnswer, http_server, wait_until

from agent import api
from agent.backend.base import ClockDomain
from agent.backend.sim import SimulatedBackend, load_profile
from agent.backend.sim.physics import busy_power_mw, capped_clock_ratio
from agent.demo.standin_process import StandinServer, free_port
from agent.store.database import Store
from agent.textview import status_text

pytestmark = pytest.mark.real_daemon

PROFILE = "h200x2"


def policy(
    port: int, *, slo_seconds: float = 5.0, power_limit: str = "", interval: str = "", metrics_url: str = ""
) -> str:
    """The agent's policy block, then top-level keys after it (the harness appends it last)."""
    limit = f"\n      power_limit_watts: {power_limit}" if power_limit else ""
    metrics = f'\n    metrics_url: "{metrics_url}"' if metrics_url else ""
    return f"""\
  gpus:
    - match: {{model: "NVIDIA H200*"}}
      persistence: enabled{limit}
services:
  - name: sglang
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    health_url: "http://127.0.0.1:{port}/health"{metrics}
    gpus: [0]
    probe_interval_seconds: 0.2
    scrape_interval_seconds: 0.2
    slo: {{e2e_p95_seconds: {slo_seconds}, min_requests: 5}}
{interval}"""


@contextmanager
def node(
    tmp_path: Path,
    *,
    mode: str = "enforce",
    load: tuple[str, ...] = ("--concurrency", "16"),
    port: int | None = None,
    rules_dir: Path | None = None,
    **policy_args: Any,
) -> Iterator[tuple[RunningAgent, SimulatedBackend]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    state_dir = tmp_path / "state"
    args = ("--flavor", "sglang", "--sim-state-dir", str(state_dir), "--sim-profile", PROFILE, "--gpus", "0", *load)
    agent_config = {"mode": mode, "profile": PROFILE, "policy": policy(port, **policy_args), "rules_dir": rules_dir}
    with (
        StandinServer(tmp_path, port=port, extra_args=args),
        running_agent(tmp_path, **agent_config) as agent,
    ):
        agent.notifications.wait_for("READY", "1")
        wait_until(lambda: traffic_seen(agent), 30, "the service's request figures")
        backend = SimulatedBackend(PROFILE, state_dir)
        backend.init()
        yield agent, backend


def traffic_seen(agent: RunningAgent) -> bool:
    (service,) = agent.status()["services"]
    return bool(service["up"] and (service.get("metrics") or {}).get("latency_seconds", {}).get("e2e"))


def tune(agent: RunningAgent, *args: str, timeout: float = 120) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "tune", *args, "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout, result.stderr


def sweep_json(agent: RunningAgent, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = tune(agent, "power", "--service", "sglang", *args, "--json")
    assert out, err
    return code, dict(json.loads(out))


def implied_tokens_per_joule(limit_watts: float) -> float:
    """What the simulator's physics says tokens/J goes as at a power limit: the clock it reaches
    (on the supported grid) over the power it draws."""
    model = load_profile(PROFILE).models[0]
    clocks = model.supported_graphics_clocks_mhz
    reachable = capped_clock_ratio(model, limit_watts * 1000) * model.max_clocks_mhz.graphics
    mhz = next((c for c in clocks if c <= reachable), clocks[-1])
    return mhz / min(busy_power_mw(model, 1.0) / 1000, limit_watts)


def test_a_sweep_finds_the_optimum_the_physics_implies_and_restores_the_limit(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        code, document = sweep_json(
            agent, "--from", "700", "--to", "250", "--step", "150", "--dwell", "3", "--tolerance", "0.5"
        )
        assert code == 0, document
        assert backend.power_limit_watts(0) == 700.0  # put back
        status = agent.status()
    steps = document["steps"]
    assert [s["setting"] for s in steps] == [700, 550, 400, 250]
    assert steps[0]["baseline"] and not any(s["baseline"] for s in steps[1:])
    assert document["state"] == "done" and "GPU 0 power limit 700 W" in document["detail"]
    implied = {s["setting"]: implied_tokens_per_joule(s["setting"]) for s in steps}
    measured = {s["setting"]: s["tokens_per_joule"] for s in steps}
    assert max(measured, key=measured.__getitem__) == max(implied, key=implied.__getitem__) == 400
    for setting in implied:  # the measured curve has the physics' shape, not only its peak
        ratio = measured[setting] / measured[700]
        assert abs(ratio - implied[setting] / implied[700]) < 0.04, (setting, measured, implied)
    for step in steps:
        assert abs(step["mean_power_watts"] - min(step["setting"], 655)) < 10, (
            step
        )  # the cap held, the loop never fought
        assert step["request_rate"] > 1 and step["e2e_p95_seconds"] and step["ttft_p95_seconds"]
    assert "sw_power_cap" in steps[1]["throttle_reasons"] and "sw_power_cap" not in steps[0]["throttle_reasons"]
    assert steps[0]["mean_sm_mhz"] > steps[1]["mean_sm_mhz"] > steps[2]["mean_sm_mhz"] > steps[3]["mean_sm_mhz"]
    recommendation = document["recommendation"]
    assert recommendation["setting"] == 400
    # GPU 0 of the two H200s its profile matches: a profile of its own before that one, its keys copied.
    (swept,) = document["swept"]
    assert recommendation["snippet"] == (
        "policy:\n  gpus:\n"
        f'    - match: {{uuid: "{swept["uuid"]}"}}  # before policy.gpus[0], its other keys copied\n'
        "      persistence: enabled\n"
        "      power_limit_watts: 400"
    )
    assert recommendation["rule"] == (
        "most tokens per joule with p95 under the objective and tokens/s within 50 % of the best"
    )
    # Per-GPU power beside the total; one GPU measured here, so the two agree.
    assert all(abs(s["gpu_power_watts"][0] - s["mean_power_watts"]) < 1 for s in steps)
    assert recommendation["tokens_per_joule_change_ratio"] > 0.1
    assert recommendation["tokens_per_second_change_ratio"] < -0.2
    assert status["last_tune"]["recommended"] == 400 and status["last_tune"]["state"] == "done"
    assert "last tune: power sweep 1 of sglang (" in status_text(status)
    assert "): done, recommends 400 W (+" in status_text(status)


def test_the_table_and_the_default_tolerance(tmp_path: Path) -> None:
    with node(tmp_path, power_limit="700", interval="policy_interval_seconds: 1\n") as (agent, backend):
        code, out, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "550", "--step", "150", "--dwell", "3"
        )
        assert backend.power_limit_watts(0) == 700.0
        code_last, out_last, _ = tune(agent, "--last")
        _, last_json, _ = tune(agent, "--last", "--json")
        code_passive, out_passive, _ = tune(agent, "power", "--service", "sglang", "--passive", "--json")
        _, passive_text, _ = tune(agent, "power", "--service", "sglang", "--passive")
    assert code == 0, out + err
    assert "step 2 of 2: 550 W" in err  # progress on stderr
    header = next(line for line in out.splitlines() if line.startswith("limit"))
    for column in (
        "W per swept GPU",
        "W total (1 GPU)",
        "SM MHz",
        "tokens/s",
        "tokens/J",
        "p95 e2e (SLO 5 s)",
        "p95 TTFT (no SLO)",
        "max temp",
        "throttle reasons",
    ):
        assert column in header
    assert "700 W (current)" in out and "sw_power_cap" in out and " ok " in out
    # 550 W gives up about 11 % of the tokens/s: outside the default 5 %, so the current limit stays best,
    # and the output says what 550 W would have given and the tolerance that would take it.
    assert "recommended: 700 W: most tokens per joule with p95 under the objective and tokens/s within 5 %" in out
    assert "note: the most tokens per joule within the objective is at 550 W (+" in out
    assert "outside the 5 % tolerance (--tolerance 0.1" in out  # 0.11 or 0.12, as the measurement fell
    assert "power_limit_watts: 700" in out
    assert code_last == 0 and out_last == out
    # The policy says 700 W and re-plans every second; held off GPU 0, it never put 700 W back mid-step.
    capped = json.loads(last_json)["steps"][1]
    assert capped["setting"] == 550 and capped["mean_power_watts"] < 560, capped
    # The daemon kept what the node did at each limit it ran at and at which traffic, the sweep's
    # included; a few seconds at a limit compare nothing, and the report says so (exit 2).
    report = json.loads(out_passive)
    assert code_passive == 2 and report["changed"] is False and report["comparable"] is False
    seen = {item["power_limit_watts"]: item for item in report["limits"]}
    assert {700.0, 550.0} <= set(seen) and all(item["gpu_model"] == "NVIDIA H200" for item in seen.values())
    assert seen[550.0]["tokens_per_joule"] > 0 and seen[700.0]["seconds"] > 0
    assert {item["traffic_band"] for item in report["limits"]} <= {"4-8", "8-16", "16-32", "32-64"}
    assert "power history of service sglang (no changes made), by traffic band" in passive_text
    assert "(too short)" in passive_text and "too little history to compare limits" in passive_text


def test_an_slo_breach_stops_the_descent(tmp_path: Path) -> None:
    # p95 e2e about 0.77 s at 700 W, rising as the clock falls: past 0.85 s well before 250 W
    with node(tmp_path, slo_seconds=0.85) as (agent, backend):
        code, document = sweep_json(agent, "--from", "700", "--to", "250", "--step", "75", "--dwell", "2")
        assert backend.power_limit_watts(0) == 700.0
    steps = document["steps"]
    assert document["state"] == "stopped" and "descent stopped" in document["detail"], document["detail"]
    assert steps[-1]["slo_breaches"] and not any(s["slo_breaches"] for s in steps[:-1])
    assert 2 <= len(steps) < 7 and steps[-1]["setting"] > 250  # nothing below the breach was set
    assert code == 0 and document["recommendation"]["setting"] in [s["setting"] for s in steps[:-1]]


def test_thin_traffic_a_service_down_and_observe_mode_are_refused(tmp_path: Path) -> None:
    with node(tmp_path / "thin", load=("--request-rate", "0.3")) as (agent, backend):
        code, _, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "400", "--step", "100", "--dwell", "2"
        )
        assert code == 1 and "traffic too thin to measure" in err and "floor 1/s" in err, err
        assert backend.power_limit_watts(0) == 700.0
    with node(tmp_path / "down") as (agent, backend):
        (control,) = (tmp_path / "down").glob("standin-*.control")
        control.write_text("503\n")  # up, but not serving: the prober marks it down
        wait_until(lambda: agent.status()["services"][0]["up"] is False, 30, "the service marked down")
        code, _, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "400", "--step", "100", "--dwell", "2"
        )
        assert code == 1 and "refused: service sglang is down" in err, err
        assert backend.power_limit_watts(0) == 700.0
    with node(tmp_path / "observe", mode="observe") as (agent, backend):
        code, _, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "400", "--step", "100", "--dwell", "2"
        )
        assert code == 1 and "power_limit is in observe mode" in err, err
        code, _, err = tune(
            agent, "clocks", "--service", "sglang", "--from", "1980", "--to", "1500", "--step", "240", "--dwell", "2"
        )
        assert code == 1 and "locked_clocks is in observe mode" in err, err
        assert backend.power_limit_watts(0) == 700.0


def test_kill_9_mid_step_is_rolled_back_at_the_next_start(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        started = api.call(
            agent.socket_path,
            "tune_start",
            {"kind": "power", "service": "sglang", "start": 700, "stop": 400, "step": 150, "dwell_seconds": 4},
        )
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.05)
        progress = api.call(agent.socket_path, "tune_status", {"id": started["id"]})["progress"]
        assert (progress["step"], progress["setting"]) == (2, 550)
        agent.process.kill()
        agent.process.wait()
        time.sleep(1.0)
        assert backend.power_limit_watts(0) == 550.0  # nothing ran in the killed agent
    with running_agent(
        tmp_path, mode="enforce", profile=PROFILE, policy=agent.config_path.read_text().split("policy:\n", 1)[1]
    ) as restarted:
        restarted.notifications.wait_for("READY", "1")
        wait_until(lambda: backend.power_limit_watts(0) == 700.0, 30, "the original limit back")
        last = wait_until(
            lambda: (d := api.call(restarted.socket_path, "tune_status")) and d["state"] != "running" and d,
            30,
            "the interrupted sweep closed",
        )
    assert last["state"] == "interrupted"
    assert "restored at start: GPU 0 power limit 700 W" in last["detail"] and "at 550" in last["detail"]


def test_abort_puts_the_limit_back(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        api.call(
            agent.socket_path,
            "tune_start",
            {"kind": "power", "service": "sglang", "start": 700, "stop": 400, "step": 100, "dwell_seconds": 4},
        )
        wait_until(lambda: backend.power_limit_watts(0) == 600.0, 30, "the second step set", poll_seconds=0.05)
        code, _, err = tune(
            agent, "power", "--service", "sglang", "--from", "700", "--to", "500", "--step", "100", "--dwell", "2"
        )
        assert code == 1 and "refused: tune 1 is running (gpu-agent tune --abort stops it)" in err, err
        code, _, err = tune(agent, "--abort")
        assert code == 0 and "aborting" in err
        last = wait_until(
            lambda: (d := api.call(agent.socket_path, "tune_status")) and d["state"] != "running" and d,
            20,
            "the sweep to end",
        )
        assert backend.power_limit_watts(0) == 700.0
    assert last["state"] == "aborted" and "gpu-agent tune --abort" in last["detail"]


def test_clocks_sweep_restores_the_unlocked_clocks(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        code, out, err = tune(
            agent,
            "clocks",
            "--service",
            "sglang",
            "--from",
            "1980",
            "--to",
            "1380",
            "--step",
            "300",
            "--dwell",
            "2",
            "--tolerance",
            "0.5",
        )
        assert backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None  # unlocked again
    assert code == 0, out + err
    assert "1980 MHz (current)" in out and "1380 MHz" in out
    assert "locked_clocks: {gpu_mhz: [1380, 1380]}" in out  # lower clock, lower power: the better tokens/J here
    assert "GPU 0 clocks unlocked" in out


def test_sigterm_mid_sweep_puts_the_limit_back_before_the_daemon_exits(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        api.call(
            agent.socket_path,
            "tune_start",
            {"kind": "power", "service": "sglang", "start": 700, "stop": 400, "step": 150, "dwell_seconds": 4},
        )
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.05)
        agent.signal(signal.SIGTERM)
        assert agent.process.wait(30) == 0
        assert backend.power_limit_watts(0) == 700.0
    with Store.open(tmp_path / "state") as store:
        last = store.last_tune()
    assert last is not None and last.document["state"] == "aborted"
    assert "the agent is stopping" in last.document["detail"]
    assert "restored: GPU 0 power limit 700 W" in last.document["detail"]


def test_ctrl_c_on_the_cli_aborts_and_waits_for_the_restore(tmp_path: Path) -> None:
    with node(tmp_path) as (agent, backend):
        cli = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "tune", "power", "--service", "sglang", "--from", "700", "--to", "400",
             "--step", "150", "--dwell", "4", "--config", str(agent.config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # A run started in the background (`cmd &` in a script) inherits SIGINT ignored, and
            # Python then installs no Ctrl-C handler: the CLI gets the terminal's default.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.05)
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=30)
        assert backend.power_limit_watts(0) == 700.0  # back before the CLI returned
    assert cli.returncode == 1, out + err
    assert "aborting: the daemon puts the original settings back" in err
    assert "aborted: aborted with Ctrl-C on the CLI" in out and "restored: GPU 0 power limit 700 W" in out
    assert "700 W (current)" in out  # the steps measured before the abort are still shown
    assert "recommended:" not in out and "no recommendation: the sweep did not finish" in out


# -- every way out: a reader's error of any type, a reload, and nothing waits behind the sweep ------


class MetricsRelay:
    """The stand-in's /metrics passed through, or (`redirect`) a 302 to port 99999, which no reader
    can follow: `urlsplit` raises ValueError for the port, not the reader's own error."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.redirect = False
        self.url = ""

    def answer(self, path: str) -> HttpAnswer:
        if self.redirect:
            return 302, {"Location": "http://127.0.0.1:99999/metrics"}, b""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.upstream_port}{path}", timeout=5) as answer:
                return 200, {}, answer.read()
        except OSError:
            return 503, {}, b""

    @contextmanager
    def serving(self) -> Iterator[MetricsRelay]:
        with http_server(self.answer) as base:
            self.url = f"{base}/metrics"
            yield self


def start_sweep(agent: RunningAgent, dwell_seconds: float = 4) -> dict[str, Any]:
    params = {"kind": "power", "service": "sglang", "start": 700, "stop": 400, "step": 150}
    return dict(api.call(agent.socket_path, "tune_start", {**params, "dwell_seconds": dwell_seconds}))


def ended(agent: RunningAgent, tune_id: int, seconds: float = 30) -> dict[str, Any]:
    return dict(
        wait_until(
            lambda: (
                (d := api.call(agent.socket_path, "tune_status", {"id": tune_id})) and d["state"] != "running" and d
            ),
            seconds,
            f"tune {tune_id} to end",
        )
    )


def test_a_redirect_no_reader_can_follow_mid_sweep_still_puts_the_limit_back(tmp_path: Path) -> None:
    """The reproduction: mid-sweep the service answers /metrics with a 302 to port 99999. The
    sweep fails with the original limit back and its row closed; `tune --abort` has nothing left
    to stop; the next sweep reads the true original, not the step the first one was at."""
    port = free_port()
    with MetricsRelay(port).serving() as relay, node(tmp_path, port=port, metrics_url=relay.url) as (agent, backend):
        first = start_sweep(agent)
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.05)
        relay.redirect = True
        document = ended(agent, first["id"])
        assert backend.power_limit_watts(0) == 700.0
        assert document["state"] == "failed", document["detail"]
        assert "restored: GPU 0 power limit 700 W" in document["detail"] and "NOT restored" not in document["detail"]
        code, _, err = tune(agent, "--abort")
        assert code == 1 and "no tune is running" in err, err
        relay.redirect = False
        second = wait_until(lambda: _started(agent), 30, "a second sweep accepted")
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "its 550 W step", poll_seconds=0.05)
        status = api.call(agent.socket_path, "tune_status", {"id": second["id"]})
        assert status["originals"] == [
            {"gpu": 0, "power_limit_watts": 700.0, "locked_graphics_mhz": None, "locked": False}
        ]
        api.call(agent.socket_path, "tune_abort", {})
        assert ended(agent, second["id"])["state"] == "aborted"
        assert backend.power_limit_watts(0) == 700.0
    with Store.open(tmp_path / "state") as store:
        assert store.running_tunes() == [] and store.open_holds() == []


def _started(agent: RunningAgent) -> dict[str, Any] | None:
    try:
        return start_sweep(agent)
    except api.ApiError:  # its figures still come back after the redirect: refused until then
        return None


def test_a_reload_to_observe_mid_sweep_puts_the_limit_back_before_the_guard_switches(tmp_path: Path) -> None:
    """The reproduction: SIGHUP with `mode: observe` while a sweep holds GPU 0 at 550 W. The reload
    ends the sweep and puts 700 W back under the old write guard, then switches: never "NOT
    restored", and nothing writes the limit afterwards."""
    with node(tmp_path) as (agent, backend):
        started = start_sweep(agent)
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.05)
        agent.config_path.write_text(agent.config_path.read_text().replace("mode: enforce", "mode: observe"))
        agent.signal(signal.SIGHUP)
        document = ended(agent, started["id"])
        assert backend.power_limit_watts(0) == 700.0
        assert document["state"] == "aborted", document["detail"]
        assert "the config was reloaded: power_limit is no longer in enforce mode" in document["detail"]
        assert "restored: GPU 0 power limit 700 W" in document["detail"] and "NOT restored" not in document["detail"]
        wait_until(lambda: '"config reloaded"' in agent.log(), 15, "the reload applied")
        assert backend.power_limit_watts(0) == 700.0


def test_an_xid_79_on_another_gpu_is_flagged_within_two_seconds_while_a_sweep_runs(tmp_path: Path) -> None:
    """Lanes, not one queue: the reboot recommendation never waits behind the sweep on GPU 0. The
    latency is the flag's time against the Xid event's, both as the daemon recorded them."""
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755, parents=True)
    for source in (Path(__file__).parents[2] / "rules").glob("*.yaml"):
        (rules / source.name).write_text(source.read_text())
        (rules / source.name).chmod(0o644)
    with node(tmp_path / "node", rules_dir=rules) as (agent, backend):
        started = start_sweep(agent, dwell_seconds=60)
        wait_until(
            lambda: (
                api.call(agent.socket_path, "tune_status", {"id": started["id"]})["progress"].get("doing")
                == "measuring"
            ),
            30,
            "the sweep measuring",
        )
        injected = subprocess.run(
            [sys.executable, "-m", "agent.cli", "inject", "xid", "79", "--gpu", "1", "--config", str(agent.config_path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert injected.returncode == 0, injected.stderr
        flag_path = agent.state_dir / "reboot-recommended"
        wait_until(flag_path.exists, 30, "the reboot recommendation")
        flag = json.loads(flag_path.read_text())
        assert api.call(agent.socket_path, "tune_status", {"id": started["id"]})["state"] == "running"
        with Store.open(agent.state_dir) as store:
            (xid,) = [e.event for e in store.events() if e.event.data.get("xid") == 79]
        latency = flag["time_seconds"] - xid.timestamp_seconds
        print(f"Xid 79 on GPU 1 during a sweep on GPU 0: reboot recommended {latency:.3f} s after the Xid")
        assert flag["xid"] == 79 and 0 <= latency < 2.0, latency
        api.call(agent.socket_path, "tune_abort", {})
        ended(agent, started["id"])
        assert backend.power_limit_watts(0) == 700.0


# -- a sweep is not drift, and a sick subject is not swept ---------------------------------------


def test_a_sweep_is_held_not_drift_in_every_view_and_a_sick_subject_is_refused(tmp_path: Path) -> None:
    """While a sweep drives GPU 0's limit, the item is `held` naming the sweep: no attention in
    `status`, no `policy drift` line, gpu_agent_policy_drift 0 and no GpuPolicyDrift from the alert
    rules on the scraped series (promtool). Then GPU 0 takes an uncorrected ECC error: a sweep is
    refused with the reason, unless --force."""
    from test_fault_agreement import PROMTOOL, expected_alerts, metric_samples, promtool_case

    with node(tmp_path, power_limit="700") as (agent, backend):
        started = start_sweep(agent, dwell_seconds=20)  # 700 W (the current limit) first, then 550 W
        wait_until(lambda: backend.power_limit_watts(0) == 550.0, 60, "the 550 W step set", poll_seconds=0.05)
        # A policy pass while it is held (the loop re-plans a setting it reads changed at once).
        wait_until(lambda: _power_item(agent)["actual"] == "550 W", 15, "the held limit planned")
        document = agent.status()
        text = subprocess.run(
            [sys.executable, "-m", "agent.cli", "status", "--config", str(agent.config_path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        samples = metric_samples(agent.metrics())
        held = _power_item(agent)
        api.call(agent.socket_path, "tune_abort", {})
        ended(agent, started["id"])
        assert backend.power_limit_watts(0) == 700.0

        code, _, err = tune(agent, "power", "--service", "sglang", "--from", "700", "--to", "550", "--step", "150",
                            "--dwell", "2")  # fmt: skip
        assert code == 0, err
        injected = subprocess.run(
            [sys.executable, "-m", "agent.cli", "inject", "ecc", "--gpu", "0", "--uncorrected", "1",
             "--config", str(agent.config_path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert injected.returncode == 0, injected.stderr
        wait_until(lambda: agent.status()["gpus"][0]["health"]["state"] != "healthy", 30, "GPU 0 not healthy")
        code, out, sick = tune(agent, "power", "--service", "sglang", "--from", "700", "--to", "550", "--step", "150",
                               "--dwell", "2")  # fmt: skip
        forced = api.call(
            agent.socket_path,
            "tune_start",
            {"kind": "power", "service": "sglang", "start": 700, "stop": 550, "step": 150, "dwell_seconds": 2,
             "force": True},
        )  # fmt: skip
        ended(agent, forced["id"])
        assert backend.power_limit_watts(0) == 700.0

    assert (held["status"], held["desired"], held["actual"]) == ("held", "700 W", "550 W"), held
    assert held["detail"].startswith(f"held: tune sweep {started['id']} drives it"), held
    assert document["verdict"]["exit_code"] == 0 and document["verdict"]["drift"] == [], document["verdict"]
    assert text.returncode == 0 and "policy drift" not in text.stdout and "all healthy" in text.stdout, text.stdout
    assert (
        f"power_limit GPU 0 (enforce): held (want 700 W, have 550 W) - held: tune sweep {started['id']}" in text.stdout
    )
    values = {(name, labels.get("item"), labels.get("gpu"), labels.get("status")): v for name, labels, v in samples}
    # The default scrape lists a GPU's drift series only while it drifts (policy_detail is off).
    assert values.get(("gpu_agent_policy_drift", "power_limit", "0", None), 0) == 0
    assert values[("gpu_agent_policy_targets", "power_limit", None, "held")] == 1
    assert ("gpu_agent_policy_targets", "power_limit", None, "drift") not in values
    if PROMTOOL is not None:
        fired = expected_alerts(document)
        assert fired["GpuPolicyDrift"] == []
        case = tmp_path / "alerts-test.yaml"
        case.write_text(json.dumps(promtool_case(samples, fired)))
        result = subprocess.run([PROMTOOL, "test", "rules", str(case)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr

    assert code == 1 and out == "", out
    assert "refused: GPU 0 is " in sick and "--force sweeps anyway" in sick, sick


def _power_item(agent: RunningAgent) -> dict[str, Any]:
    items = api.call(agent.socket_path, "status")["policy"]["items"]
    return dict(next(i for i in items if (i["item"], i["gpu"]) == ("power_limit", 0)))
