"""Deadlines, dwells and timeouts run on the monotonic clock: the wall clock stepped an hour either
way (in-process: `time.time` and the injected wall clock both jump) in the middle of a drain, a
sweep step's dwell, a probe and the age of the last snapshot (`/healthz`) changes none of their
lengths. tests/test_layout.py keeps the wall clock out of deadline code for good."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from action_kinds import ActionKind, action_spec
from helpers import FakeClock, action_context, http_server, make_event
from hosttree import make_host_tree
from snapshots import TIMESTAMP_SECONDS, node_snapshot

from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import free_port
from agent.metrics.server import MetricsServer
from agent.policy.base import HostContext
from agent.rules.actions.service_actions import drain_service
from agent.rules.model import Decision, Target
from agent.services.prober import HealthProber
from agent.tune.measure import measure_step

STEPS = pytest.mark.parametrize("step_seconds", [-3600.0, 3600.0], ids=["back-1h", "forward-1h"])
#: Past this much of the wait, the wall clock jumps.
STEP_AFTER_SECONDS = 0.3
#: Each wait here lasts 1 s; a wall-clock deadline would make it last an hour, or end at the jump.
WAIT_SECONDS = 1.0


class SteppedWall:
    """The wall clock, stepped by `step_seconds` once STEP_AFTER_SECONDS have passed."""

    def __init__(self, step_seconds: float, real: Callable[[], float]) -> None:
        self.step_seconds = step_seconds
        self.real = real
        self.began = time.monotonic()

    def __call__(self) -> float:
        stepped = time.monotonic() - self.began > STEP_AFTER_SECONDS
        return self.real() + (self.step_seconds if stepped else 0.0)


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> SteppedWall:
    stepped = SteppedWall(request.node.callspec.params["step_seconds"], time.time)
    monkeypatch.setattr(time, "time", stepped)
    return stepped


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """`work()` on a thread (a wall-clock deadline would hold it for an hour: never waited out
    here), and how long it took on the monotonic clock."""
    result: list[Any] = []
    began = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(WAIT_SECONDS + 15)
    assert not thread.is_alive(), "still waiting: its deadline is on the wall clock"
    return (result[0] if result else None), time.monotonic() - began


def _busy_page(_path: str) -> tuple[int, dict[str, str], bytes]:
    """A server that always runs three requests: a drain waits for it until its timeout."""
    e2e = "sglang:e2e_request_latency_seconds"
    count = int(time.monotonic() * 10)
    lines = [
        f"# TYPE {e2e} histogram",
        f'{e2e}_bucket{{le="+Inf"}} {count}',
        f"{e2e}_count {count}",
        f"{e2e}_sum {count}",
        "sglang:generation_tokens_total 1000",
        "sglang:num_running_reqs 3",
    ]
    return 200, {}, ("\n".join(lines) + "\n").encode()


@pytest.fixture
def busy_server() -> Iterator[str]:
    with http_server(_busy_page) as url:
        yield url


@STEPS
def test_a_wall_clock_step_during_a_drain_neither_holds_the_restart_nor_cuts_the_drain(
    tmp_path: Path, busy_server: str, wall: SteppedWall, step_seconds: float
) -> None:
    service = ServiceConfig.model_validate(
        {
            "name": "sglang",
            "health_url": f"{busy_server}/health",
            "metrics_url": f"{busy_server}/metrics",
            "drain": {"hook": ["/bin/true"], "timeout_seconds": WAIT_SECONDS},
        }
    )
    config = AgentConfig(mode="enforce", services=[service])  # type: ignore[arg-type]
    backend = SimulatedBackend("h200x2", tmp_path / "sim")
    backend.init()
    ctx = action_context(
        config, backend, HostContext(make_host_tree(tmp_path / "host")), {}, clock=wall, drain_poll_seconds=0.05
    )
    restart = Decision(
        "restart", make_event(), Target(service="sglang"), action_spec(ActionKind.RESTART_SERVICE), 0, 1, "", False
    )
    steps: list[str] = []
    _, seconds = timed(lambda: drain_service(service, restart, ctx, steps))
    assert WAIT_SECONDS <= seconds < WAIT_SECONDS + 5, (seconds, steps)
    assert steps[1].startswith("sglang still running 3 request(s) when its drain timed out after 1."), steps


@STEPS
def test_a_wall_clock_step_during_a_sweep_steps_dwell_leaves_its_length(
    tmp_path: Path, busy_server: str, wall: SteppedWall, step_seconds: float
) -> None:
    service = ServiceConfig(name="sglang", health_url=f"{busy_server}/health", metrics_url=f"{busy_server}/metrics")
    backend = SimulatedBackend("h200x2", tmp_path / "sim")
    backend.init()
    reading, seconds = timed(
        lambda: measure_step(
            backend, [0], service, 700.0, baseline=True, dwell_seconds=WAIT_SECONDS, aborted=lambda: False
        )
    )
    assert reading is not None and abs(reading.seconds - WAIT_SECONDS) < 0.5, reading
    assert WAIT_SECONDS <= seconds < WAIT_SECONDS + 5


@STEPS
def test_a_wall_clock_step_during_a_probe_leaves_its_timeout_and_the_restart_window(
    wall: SteppedWall, step_seconds: float
) -> None:
    service = ServiceConfig(
        name="sglang",
        health_url=f"http://127.0.0.1:{free_port()}/health",  # nothing listens: every probe fails
        probe_interval_seconds=0.1,
        unhealthy_after_probes=1,
    )
    prober = HealthProber([service], clock=wall)
    result, seconds = timed(lambda: prober.wait_healthy("sglang", WAIT_SECONDS))
    assert result is not None and not result.ok
    assert WAIT_SECONDS <= seconds < WAIT_SECONDS + 5
    # The agent takes the service down for 60 s (a restart); an hour's step is no time passing.
    (before,) = prober.statuses()
    wall.began = time.monotonic()  # the wall clock as it was: it jumps again in STEP_AFTER_SECONDS
    prober.expect_down("sglang", 60.0)
    time.sleep(STEP_AFTER_SECONDS + 0.1)
    prober.probe_once("sglang")
    (status,) = prober.statuses()
    assert status.consecutive_failures == before.consecutive_failures, (before, status)
    assert status.detail.startswith("restart in progress: "), status


@STEPS
def test_a_wall_clock_step_neither_makes_healthz_stale_nor_hides_a_stalled_loop(step_seconds: float) -> None:
    clock = FakeClock(wall_seconds=TIMESTAMP_SECONDS)
    published = replace(node_snapshot(), published_monotonic_seconds=clock.monotonic())
    server = MetricsServer(
        "127.0.0.1:0", lambda: published, stale_after_seconds=30, clock=clock, monotonic=clock.monotonic
    )
    try:
        clock.step_wall(step_seconds)
        with urllib.request.urlopen(server.url + "/healthz", timeout=5) as answer:
            assert json.loads(answer.read())["snapshot_age_seconds"] == 0.0
        clock.advance(31)  # the loop stalled: 31 s since it last published, whatever the wall clock says
        with pytest.raises(urllib.error.HTTPError) as stale:
            urllib.request.urlopen(server.url + "/healthz", timeout=5)
        assert stale.value.code == 503 and json.loads(stale.value.read())["status"] == "stale"
    finally:
        server.close()
