"""Every way out of a job that changes GPU settings puts them back (agent.policy.holds,
agent.policy.transaction): a sweep and a GPU reset are run with an error of an unexpected type
injected at each of their calls in turn (every GPU call, scrape, journal write, recommendation),
and after each run the simulated GPU has its original settings, nothing is held, the hold journal
has no open row and the sweep's row is closed, naming the error. Then the ways out that come from
outside: a reload that takes the write away or drops the service, the agent stopping, and the
next start after a kill -9."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from action_kinds import ActionKind, action_spec
from helpers import action_context, http_server, make_event, wait_until
from hosttree import make_host_tree
from snapshots import snapshot_from_backend

from agent import verdict
from agent.backend.base import ClockDomain, GpuBackend, WriteGuard
from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.policy import holds as holds_module
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.holds import PolicyHolds
from agent.policy.plan import ItemPlan, PlanStatus
from agent.rules.actions.dispatch import execute
from agent.rules.model import Decision, Outcome, Target
from agent.store.database import Store
from agent.tune import measure, sweep
from agent.tune.model import TuneDocument, TuneRequest
from agent.tune.sweep import TuneJob, hold_owner

#: The errors a job meets that nobody planned for, one per injection in turn.
UNEXPECTED: tuple[type[Exception], ...] = (ValueError, KeyError, RuntimeError, TypeError, ZeroDivisionError, OSError)
#: The job's calls into the service's reader and the recommendation, unwrapped.
SCRAPE = measure.scrape
RECOMMEND = sweep.recommend
#: Calls whose failure is absorbed by a retry: reading an original, writing it back, the journal's end.
RETRIED = {
    "backend.power_limit_watts",
    "backend.locked_clocks_mhz",
    "backend.set_power_limit_watts",
    "backend.reset_locked_clocks",
    "store.save_tune",
    "store.end_hold",
}


class Seams:
    """Counts the calls a job makes through its seams; the call numbered `at` raises an error of an
    unexpected type (once)."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.calls = 0
        self.fired: str | None = None

    def hit(self, where: str) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.fired = where
            raise UNEXPECTED[self.calls % len(UNEXPECTED)](f"injected at {where}")

    def wrap(self, where: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.hit(where)
            return call(*args, **kwargs)

        return wrapped


class Through:
    """`target` with every method call counted by `seams` (attributes read as they are)."""

    def __init__(self, target: object, seams: Seams, prefix: str) -> None:
        self._target = target
        self._seams = seams
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        return self._seams.wrap(f"{self._prefix}.{name}", value) if callable(value) else value

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._target, name, value)


class SweepParts:
    """What a sweep reads of the daemon (agent.tune.sweep.SweepNode): here the test's backend, store and ledger."""

    def __init__(self, backend: GpuBackend, store: Store, holds: PolicyHolds) -> None:
        self.backend = backend
        self.store = store
        self.holds = holds
        self.clock = time.time

    def current_backend(self) -> GpuBackend:
        return self.backend

    def current_store(self) -> Store:
        return self.store


# -- a server page whose counters move: about 20 requests/s -------------------------------------


def _page() -> bytes:
    done = int(time.monotonic() * 20)
    e2e = "sglang:e2e_request_latency_seconds"
    lines = [
        f"# TYPE {e2e} histogram",
        f'{e2e}_bucket{{le="0.5"}} {done // 2}',
        f'{e2e}_bucket{{le="1"}} {done}',
        f'{e2e}_bucket{{le="+Inf"}} {done}',
        f"{e2e}_count {done}",
        f"{e2e}_sum {done * 0.6}",
        "# TYPE sglang:generation_tokens_total counter",
        f"sglang:generation_tokens_total {done * 100}",
        "sglang:num_running_reqs 4",
    ]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with http_server(lambda path: (200, {}, _page() if path == "/metrics" else b"ok")) as url:
        yield url


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated clocks settle at once: poll them often, so a hundred sweeps take seconds."""
    monkeypatch.setattr(measure, "SETTLE_POLL_SECONDS", 0.02)


# -- the sweep ------------------------------------------------------------------------------------

WRITABLE = frozenset({"power_limit", "locked_clocks"})
#: Two GPUs for a power sweep (a step written to one and not the other is put back too), one for
#: a clock sweep (its calls are many, the same per GPU).
GPUS = {"power": (0, 1), "clocks": (0,)}
REQUESTS = {
    "power": {"kind": "power", "start": 700, "stop": 550, "step": 150},
    "clocks": {"kind": "clocks", "start": 1980, "stop": 1680, "step": 300},
}


class Node:
    def __init__(self, tmp_path: Path, server: str) -> None:
        self.plain = SimulatedBackend("h200x2", tmp_path / "sim", writable_items=WRITABLE)
        self.plain.init()
        self.store = Store.open(tmp_path / "state")
        self.service = ServiceConfig(
            name="sglang", health_url=f"{server}/health", metrics_url=f"{server}/metrics", gpus=[0, 1]
        )

    def settings(self) -> tuple[float, float, object, object]:
        graphics = ClockDomain.GRAPHICS
        return (
            self.plain.power_limit_watts(0),
            self.plain.power_limit_watts(1),
            self.plain.locked_clocks_mhz(0, graphics),
            self.plain.locked_clocks_mhz(1, graphics),
        )

    def job(self, kind: str, seams: Seams, holds: PolicyHolds, **request: Any) -> TuneJob:
        fields = {**REQUESTS[kind], "service": "sglang", "dwell_seconds": 0.05, "min_request_rate": 0.0, **request}
        gpus = GPUS[kind]
        document = TuneDocument(0, TuneRequest(**fields), gpus, (), "running", time.time(), service_gpus=gpus)
        document.id = self.store.begin_tune(document.started_seconds, document.to_json())
        backend: GpuBackend = Through(self.plain, seams, "backend")  # type: ignore[assignment]
        store: Store = Through(self.store, seams, "store")  # type: ignore[assignment]
        return TuneJob(document, self.service, SweepParts(backend, store, holds))

    def row(self, job: TuneJob) -> dict[str, Any]:
        row = self.store.tune(job.document.id)
        assert row is not None
        return row.document


@pytest.fixture
def node(tmp_path: Path, server: str) -> Iterator[Node]:
    made = Node(tmp_path, server)
    yield made
    made.store.close()


def injected_everywhere(run: Callable[[Seams], None], check: Callable[[Seams], None], most: int = 400) -> int:
    """Run once per call the job makes, that call failing with an unexpected error, then `check`;
    the number of calls the job made (its run without a failure)."""
    for at in range(1, most):
        seams = Seams(at)
        run(seams)
        check(seams)
        if seams.fired is None:  # it made fewer calls than `at`: every one has failed once
            return at - 1
    raise AssertionError(f"the job made more than {most} calls")


@pytest.mark.parametrize("kind", ["power", "clocks"])
def test_an_unexpected_error_at_any_call_of_a_sweep_puts_the_settings_back(
    node: Node, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holds = PolicyHolds(lambda: node.store, "boot-a")
    originals = node.settings()
    jobs: list[TuneJob] = []

    def run(seams: Seams) -> None:
        monkeypatch.setattr(measure, "scrape", seams.wrap("scrape", SCRAPE))
        monkeypatch.setattr(sweep, "recommend", seams.wrap("recommend", RECOMMEND))
        job = node.job(kind, seams, holds)
        jobs.append(job)
        job.run()

    def check(seams: Seams) -> None:
        job = jobs[-1]
        row = node.row(job)
        where = f"fault at call {seams.at} ({seams.fired})"
        assert node.settings() == originals, where
        assert holds.active() == [] and all(holds.held(key[0], key[1]) is None for key in job.keys), where
        assert node.store.open_holds() == [], where
        assert job.finished.is_set() and row["state"] != "running", where
        if seams.fired is None:
            # a clock sweep from unlocked clocks measures them as a step of their own
            assert row["state"] == "done" and len(row["steps"]) == {"power": 2, "clocks": 3}[kind], row["detail"]
        elif row["state"] == "done":
            assert seams.fired in RETRIED, where  # a write that ends the job, tried again
        else:
            assert row["state"] == "failed" and f"injected at {seams.fired}" in row["detail"], (where, row["detail"])

    calls = injected_everywhere(run, check)
    assert calls > 30  # reading, setting, settling, measuring, journaling, restoring: all of them


# -- the GPU reset ----------------------------------------------------------------------------------


def reset_decision() -> Decision:
    event = make_event(gpu=0, uuid=None, xid=48)
    return Decision("xid-reset-gpu", event, Target(gpu=0), action_spec(ActionKind.RESET_GPU), 0, 1, "Xid 48", False)


def test_an_unexpected_error_at_any_call_of_a_reset_puts_the_settings_back(tmp_path: Path) -> None:
    """The reset returns the power limit and the clock lock to their defaults; whatever fails where,
    the settings the GPU had before are back afterwards (the policy here drives neither)."""
    config = AgentConfig.model_validate(
        {"mode": "enforce", "policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "persistence": "enabled"}]}}
    )
    plain = SimulatedBackend("h200x2", tmp_path / "sim", writable_items=config.writable_items())
    plain.init()
    plain.set_power_limit_watts(0, 600)
    plain.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, 1500, 1755)
    host = HostContext(make_host_tree(tmp_path / "host"))
    store = Store.open(tmp_path / "state")
    holds = PolicyHolds(lambda: store, "boot-a")
    outcomes: list[Outcome] = []

    def run(seams: Seams) -> None:
        backend: GpuBackend = Through(plain, seams, "backend")  # type: ignore[assignment]
        ctx = action_context(config, backend, host, {})
        ctx.policy = PolicyEngine(config, backend, host, holds)
        outcomes.append(execute(reset_decision(), ctx).outcome)  # never raises

    def check(seams: Seams) -> None:
        where = f"fault at call {seams.at} ({seams.fired})"
        assert plain.power_limit_watts(0) == 600.0, where
        assert plain.locked_clocks_mhz(0, ClockDomain.GRAPHICS) == (1500, 1755), where
        assert holds.active() == [] and holds.held("power_limit", 0) is None, where
        assert store.open_holds() == [], where
        if seams.fired is None:
            assert outcomes[-1] is Outcome.SUCCESS

    try:
        calls = injected_everywhere(run, check)
    finally:
        store.close()
    assert calls > 10 and Outcome.FAILED in outcomes


# -- the next start after a kill -9 -------------------------------------------------------------


def test_recovery_puts_back_what_a_killed_run_left_whatever_fails_once(tmp_path: Path) -> None:
    plain = SimulatedBackend("h200x2", tmp_path / "sim", writable_items=WRITABLE)
    plain.init()
    store = Store.open(tmp_path / "state")

    def run(seams: Seams) -> None:
        killed = PolicyHolds(lambda: store, "boot-a")  # the run killed with the setting changed
        transaction = killed.begin("tune-1", "tune sweep 1 drives it", plain, [("power_limit", 0)])
        transaction.write("power_limit", 0, 450.0)
        started = PolicyHolds(lambda: store, "boot-a")  # the next start
        recovered: list[tuple[str, str]] = []
        started.on_recovered(lambda owner, what: recovered.append((owner, what)))
        backend: GpuBackend = Through(plain, seams, "backend")  # type: ignore[assignment]
        task = started.recover(lambda: backend)
        assert task is not None and started.held("power_limit", 0) == "tune-1 left it changed; being put back"
        task.run()
        assert recovered == [("tune-1", "restored at start: GPU 0 power limit 700 W")]
        assert started.held("power_limit", 0) is None

    def check(seams: Seams) -> None:
        assert plain.power_limit_watts(0) == 700.0 and store.open_holds() == []

    try:
        assert injected_everywhere(run, check) == 1  # one write, retried when it fails
        # A hold from another boot: the reboot reset the GPU, nothing is written back.
        other = PolicyHolds(lambda: store, "boot-a")
        other.begin("tune-2", "tune sweep 2 drives it", plain, [("power_limit", 0)]).write("power_limit", 0, 450.0)
        after_reboot = PolicyHolds(lambda: store, "boot-b")
        task = after_reboot.recover(lambda: plain)
        assert task is not None
        task.run()
        (row, *_) = store.holds()
        assert row.owner == "tune-2" and row.detail.startswith("not put back: the node rebooted since")
        assert plain.power_limit_watts(0) == 450.0 and store.open_holds() == []
    finally:
        store.close()


# -- from outside: a reload, the agent stopping -----------------------------------------------------


def running_sweep(
    node: Node, holds: PolicyHolds, monkeypatch: pytest.MonkeyPatch
) -> tuple[TuneJob, threading.Thread, threading.Event]:
    """A power sweep in its second step (550 W set), held there: its scrapes wait (never looking at
    the abort) until the event returned is set."""
    gate = threading.Event()

    def gated_scrape(*args: Any, **kwargs: Any) -> Any:
        if node.plain.power_limit_watts(0) == 550.0:
            gate.wait(30)
        return SCRAPE(*args, **kwargs)

    monkeypatch.setattr(measure, "scrape", gated_scrape)
    job = node.job("power", Seams(), holds)
    thread = threading.Thread(target=job.run)
    thread.start()
    wait_until(lambda: node.plain.power_limit_watts(0) == 550.0, 30, "the 550 W step set", poll_seconds=0.02)
    return job, thread, gate


def enforce(services: list[ServiceConfig], mode: str = "enforce") -> AgentConfig:
    return AgentConfig.model_validate({"mode": mode, "services": [s.model_dump() for s in services]})


@pytest.mark.parametrize("change", ["observe", "power_limit observe", "service removed", "service's GPUs"])
def test_a_reload_that_takes_the_sweep_away_ends_it_with_the_originals_back_first(
    node: Node, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holds = PolicyHolds(lambda: node.store, "boot-a")
    job, thread, gate = running_sweep(node, holds, monkeypatch)
    unchanged = enforce([node.service])
    new = {
        "observe": enforce([node.service], "observe"),
        "power_limit observe": AgentConfig.model_validate(
            {
                "mode": "enforce",
                "policy": {"modes": {"power_limit": "observe"}},
                "services": [node.service.model_dump()],
            }
        ),
        "service removed": enforce([]),
        "service's GPUs": enforce([node.service.model_copy(update={"gpus": [1]})]),
    }[change]
    assert holds.end_conflicting(unchanged) == [] and job.finished.wait(0.3) is False  # nothing to end
    ended = holds.end_conflicting(new)
    # Back before the reload goes on to switch the write guard: the old guard allowed the restore.
    assert node.plain.power_limit_watts(0) == 700.0 and node.plain.power_limit_watts(1) == 700.0
    node.plain.write_guard = WriteGuard(new.writable_items())
    assert len(ended) == 1 and ended[0].startswith(f"{hold_owner(job.document.id)} ended (")
    gate.set()
    thread.join(10)
    row = node.row(job)
    assert row["state"] == "aborted" and "the config was reloaded: " in row["detail"], row["detail"]
    assert "NOT restored" not in row["detail"] and node.store.open_holds() == []
    assert node.plain.power_limit_watts(0) == 700.0  # nothing wrote a step after the restore


def test_the_agent_stopping_puts_the_originals_back_even_while_the_job_is_stuck(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job stuck where it does not look at its abort (a scrape that has not returned): the ledger
    puts the originals back without it, and the job's own end still closes its row."""
    holds = PolicyHolds(lambda: node.store, "boot-a")
    job, thread, gate = running_sweep(node, holds, monkeypatch)
    holds.end_all("the agent is stopping")
    assert node.plain.power_limit_watts(0) == 700.0 and holds.active() == []
    assert node.store.open_holds() == []
    gate.set()
    thread.join(10)
    row = node.row(job)
    assert row["state"] == "aborted" and row["detail"].startswith("the agent is stopping"), row["detail"]
    assert node.plain.power_limit_watts(0) == 700.0


# -- a hold is not drift while its job runs; one that outlives its job is --------------------------


def test_a_held_setting_is_held_while_its_job_runs_and_drift_once_the_hold_outlives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed sweep left GPU 0 at 450 W. While the recovery task waits for the backend, the
    plan says `held`, naming the sweep (no attention). When it gives up without a backend, the hold
    outlives its job: drift again, and the verdict's line names the job whose hold it is."""
    plain = SimulatedBackend("h200x2", tmp_path / "sim", writable_items=WRITABLE)
    plain.init()
    config = AgentConfig.model_validate(
        {"mode": "enforce", "policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 700}]}}
    )
    store = Store.open(tmp_path / "state")
    try:
        killed = PolicyHolds(lambda: store, "boot-a")
        killed.begin("tune-1", "tune sweep 1 drives it", plain, [("power_limit", 0)]).write("power_limit", 0, 450.0)
        started = PolicyHolds(lambda: store, "boot-a")
        task = started.recover(lambda: None)  # the GPU backend does not open
        assert task is not None
        engine = PolicyEngine(config, plain, HostContext(make_host_tree(tmp_path / "host")), started)

        def power(gpu: int) -> ItemPlan:
            return next(p for p in engine.plan().items if (p.item, p.gpu) == ("power_limit", gpu))

        def attention(plan: ItemPlan) -> list[str]:
            snapshot = snapshot_from_backend(plain, policy=(plan,), item_modes={"power_limit": "enforce"})
            return [line for line in verdict.attention(snapshot, "enforce") if line.startswith("policy drift")]

        pending = power(0)
        assert pending.status is PlanStatus.HELD and pending.detail.startswith(
            "held: tune-1 left it changed; being put back"
        )
        assert attention(pending) == []
        monkeypatch.setattr(holds_module, "RECOVERY_BACKEND_WAIT_SECONDS", 0.1)
        task.run()
        orphan = power(0)
        assert orphan.status is PlanStatus.DRIFT and orphan.detail.startswith(
            "held for tune-1, whose job has ended (tune-1 left it changed; being put back)"
        )
        assert attention(orphan) == [
            "policy drift: power_limit on GPU 0 (want 700 W, have 450 W): held for tune-1, whose job has ended"
        ]
        assert plain.power_limit_watts(0) == 450.0 and power(1).status is PlanStatus.IN_SYNC
        assert engine.apply().results[0].detail.startswith("held:")  # still never written by the loop
    finally:
        store.close()
