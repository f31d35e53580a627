"""The advisor's pure parts and its journal: the settings a request walks, the traffic checks,
the recommendation rule, the policy engine's holds, the passive report and the store's rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hosttree import make_host_tree

from agent.api import ApiError
from agent.api_server import handle_request
from agent.backend.base import ClockDomain, WriteGuard
from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.holds import PolicyHolds
from agent.policy.plan import ApplyOutcome
from agent.store.database import Store
from agent.store.tunes import HistoryRow
from agent.tune.model import StepReading, SweptGpu, TuneDocument, TuneRequest
from agent.tune.passive import passive_report, traffic_band
from agent.tune.recommend import recommend, thin_traffic, uneven_traffic
from agent.tune.runner import PRIVILEGED_METHODS, checked_request


def request(**values: object) -> TuneRequest:
    fields: dict[str, object] = {
        "kind": "power",
        "service": "sglang",
        "start": 700,
        "stop": 400,
        "step": 100,
        "dwell_seconds": 10,
    }
    fields.update(values)
    return TuneRequest(**fields)  # type: ignore[arg-type]


def step(
    setting: float,
    tps: float,
    tpj: float,
    *,
    baseline: bool = False,
    breach: bool = False,
    rate: float = 10.0,
    flight: float = 5.0,
) -> StepReading:
    return StepReading(
        setting=setting,
        baseline=baseline,
        seconds=10,
        mean_power_watts=tps / tpj,
        mean_sm_mhz=1500,
        tokens_per_second=tps,
        tokens_per_joule=tpj,
        e2e_p95_seconds=0.5 + (0.5 if breach else 0.0),
        ttft_p95_seconds=0.1,
        max_temperature_celsius=60,
        throttle_reasons=("sw_power_cap",),
        request_rate=rate,
        requests_in_flight=flight,
        requests=100,
        slo_breaches=("e2e_p95 1 s > 0.8 s",) if breach else (),
    )


def test_settings_walk_down_or_up_and_include_the_end_on_the_grid() -> None:
    assert request().settings() == [700, 600, 500, 400]
    assert request(stop=450).settings() == [700, 600, 500]
    assert request(start=1380, stop=1980, step=300, kind="clocks").settings() == [1380, 1680, 1980]
    again = TuneRequest.from_json(request(gpus=(0, 1)).to_json())
    assert again == request(gpus=(0, 1))


H200 = "NVIDIA H200"
#: GPU 0 of four H200s, under the one profile that matches them all (so not its alone).
GPU0 = SweptGpu(0, "GPU-0", H200, False, 0, False, '{model: "NVIDIA H200*"}', {"power_limit_watts": 700.0})


def measured(steps: list[StepReading], swept: tuple[SweptGpu, ...] = (GPU0,), **values: object) -> TuneDocument:
    slo: dict[str, float] = {"e2e_p95": 0.8}
    bounds = (200.0, 700.0)
    return TuneDocument(
        1, request(**values), (0,), (), "done", 0.0, steps=steps, slo=slo, swept=swept, setting_range=bounds
    )


def test_the_recommendation_is_the_best_tokens_per_joule_within_slo_and_tolerance() -> None:
    steps = [
        step(700, 1000, 1.50, baseline=True),
        step(600, 970, 1.62),  # within 5 % of the best tokens/s
        step(500, 900, 1.80),  # better tokens/J, but 10 % slower
        step(400, 800, 1.90, breach=True),
    ]
    chosen, why = recommend(measured(steps))
    assert chosen is not None and chosen.setting == 600, why
    assert chosen.reason == (
        "600 W: most tokens per joule with p95 under the objective and tokens/s within 5 % of the best (1000.0/s)"
    )
    assert round(chosen.tokens_per_joule_change_ratio or 0, 3) == 0.08
    assert round(chosen.tokens_per_second_change_ratio or 0, 3) == -0.03
    assert chosen.e2e_p95_change_seconds == 0.0
    # The trade-off the tolerance ruled out, as what it is, and the tolerance that would take it.
    assert chosen.tradeoff == (
        "the most tokens per joule within the objective is at 500 W (+20.0 % tokens/J, -10.0 % tokens/s against"
        " the current setting), but its tokens/s are 10.0 % under the best, outside the 5 % tolerance"
        " (--tolerance 0.1 takes it)"
    )
    assert chosen.edge == "" and chosen.targets == "GPU 0 (GPU-0)"
    wider, _ = recommend(measured(steps, throughput_tolerance=0.15))
    assert wider is not None and wider.setting == 500 and wider.tradeoff == ""
    # A breach is never recommended however good its tokens/J.
    loose, _ = recommend(measured(steps, throughput_tolerance=0.5))
    assert loose is not None and loose.setting == 500
    none, why = recommend(measured([step(700, 1000, 1.5, baseline=True, breach=True)]))
    assert none is None and "every step missed" in why


def test_a_best_step_at_the_edge_says_which_way_to_extend_the_sweep() -> None:
    """The lowest step best: the optimum may lie lower, and the flag that goes there; at the board's
    lowest there is nothing further; an ascending clock sweep extends with --from."""
    low = [step(700, 1000, 1.5, baseline=True), step(600, 990, 1.7), step(500, 985, 1.9)]
    chosen, _ = recommend(measured(low, stop=500))
    assert chosen is not None and chosen.setting == 500
    assert (
        chosen.edge
        == "500 W is the lowest setting measured: the best may lie below it (extend the sweep with --to 400)"
    )
    at_floor = [step(700, 1000, 1.5, baseline=True), step(450, 990, 1.7), step(200, 985, 1.9)]
    floor, _ = recommend(measured(at_floor, stop=200, step=250))
    assert (
        floor is not None
        and floor.edge == "200 W is the lowest setting measured and the board's lowest: nothing beyond it"
    )
    clocks = [step(1980, 1000, 1.5, baseline=True), step(1380, 995, 1.9), step(1680, 998, 1.7)]
    up, _ = recommend(measured(clocks, kind="clocks", start=1380, stop=1980, step=300))
    assert up is not None and up.setting == 1380
    assert up.edge.endswith("(extend the sweep with --from 1080)")
    # The SM clock the step gives up: the headroom for a peak, which flat tokens/s hides.
    slow = [step(700, 1000, 1.5, baseline=True), replace(step(500, 990, 1.9), mean_sm_mhz=1050)]
    headroom, _ = recommend(measured(slow))
    assert headroom is not None and round(headroom.sm_clock_change_ratio or 0, 2) == -0.3


def test_the_snippet_is_written_against_the_profile_in_force() -> None:
    """GPU 0 of a model-wide profile: a profile of its own before that one, every other key copied
    (pasted at the end it would be shadowed; pasted first without them, the other keys would go).
    A profile only the swept GPUs have: its one key changed in place. A clock lock keeps its memory lock."""
    steps = [step(700, 1000, 1.5, baseline=True), step(600, 990, 1.7)]
    settings = {"power_limit_watts": 700.0, "persistence": "enabled", "locked_clocks": {"gpu_mhz": [1980, 1980]}}
    subset = replace(GPU0, settings=settings)
    chosen, _ = recommend(measured(steps, swept=(subset,)))
    assert chosen is not None and chosen.snippet == (
        "policy:\n  gpus:\n"
        '    - match: {uuid: "GPU-0"}  # before policy.gpus[0], its other keys copied\n'
        "      power_limit_watts: 600\n"
        "      persistence: enabled\n"
        "      locked_clocks: {gpu_mhz: [1980, 1980]}"
    )
    alone = tuple(replace(GPU0, gpu=g, uuid=f"GPU-{g}", whole_model=True, profile_alone=True) for g in range(4))
    everyone, _ = recommend(measured(steps, swept=alone))
    assert everyone is not None and everyone.snippet == (
        'policy:\n  gpus:\n    - match: {model: "NVIDIA H200*"}  # policy.gpus[0]: change this key\n'
        "      power_limit_watts: 600"
    )
    assert everyone.targets == "every NVIDIA H200 (GPU 0, 1, 2, 3)"
    memory = replace(GPU0, settings={"locked_clocks": {"gpu_mhz": [1980, 1980], "memory_mhz": [3201, 3201]}})
    clocks, _ = recommend(measured([step(1500, 10, 1.0, baseline=True)], swept=(memory,), kind="clocks"))
    assert clocks is not None
    assert "locked_clocks: {gpu_mhz: [1500, 1500], memory_mhz: [3201, 3201]}" in clocks.snippet


def test_thin_and_uneven_traffic() -> None:
    assert thin_traffic(step(700, 1, 1, rate=0.4), 1.0) == "0.40 requests/s, below the floor of 1/s"
    assert thin_traffic(step(700, 1, 1, rate=3), 1.0) is None
    first = step(700, 1000, 1.5, rate=10, flight=5)
    assert uneven_traffic(first, step(600, 900, 1.6, rate=10.5, flight=7), 0.25) is None  # open loop: rate kept
    assert uneven_traffic(first, step(600, 900, 1.6, rate=7, flight=5.2), 0.25) is None  # closed loop: flight kept
    moved = uneven_traffic(first, step(600, 900, 1.6, rate=4, flight=2), 0.25)
    assert moved is not None and "10 -> 4 requests/s" in moved


def test_a_held_item_is_planned_but_never_written(tmp_path: Path) -> None:
    config = AgentConfig.model_validate(
        {"mode": "enforce", "policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 600}]}}
    )
    backend = SimulatedBackend("h200x2", tmp_path / "state", writable_items=config.writable_items())
    backend.init()
    holds = PolicyHolds()
    transaction = holds.begin("tune-1", "tune sweep 1 drives it", backend, [("power_limit", 0)])
    engine = PolicyEngine(config, backend, HostContext(make_host_tree(tmp_path / "host")), holds)
    report = engine.apply()
    results = {(r.plan.item, r.plan.gpu): r for r in report.results}
    assert results[("power_limit", 0)].outcome is ApplyOutcome.SKIPPED
    assert results[("power_limit", 0)].detail == "held: tune sweep 1 drives it"
    assert results[("power_limit", 1)].outcome is ApplyOutcome.APPLIED
    assert (backend.power_limit_watts(0), backend.power_limit_watts(1)) == (700.0, 600.0)
    (held,) = [p for p in report.plan.items if (p.item, p.gpu) == ("power_limit", 0)]
    assert held.detail.startswith("held: tune sweep 1 drives it; allowed 200-700 W")
    transaction.close()
    engine.apply()
    assert backend.power_limit_watts(0) == 600.0


def test_the_journal_keeps_running_sweeps_and_the_last_one(tmp_path: Path) -> None:
    document = TuneDocument(0, request(), (0,), (), "running", 100.0)
    with Store.open(tmp_path) as store:
        first = store.begin_tune(100.0, document.to_json())
        document.id, document.state = first, "done"
        store.save_tune(first, document.to_json(), 130.0)
        second = store.begin_tune(200.0, TuneDocument(0, request(), (0,), (), "running", 200.0).to_json())
        assert [row.row_id for row in store.running_tunes()] == [second]
        last = store.last_tune()
        assert last is not None and last.row_id == second and last.document["id"] == second
        done = store.tune(first)
        assert done is not None and TuneDocument.from_json(done.document).state == "done"


def test_passive_advice_compares_limits_only_at_the_same_traffic(tmp_path: Path) -> None:
    model = "NVIDIA H200"
    with Store.open(tmp_path) as store:
        store.add_history([HistoryRow("sglang", model, "power:700@4-8", 3600, 3.6e6, 2.3e6, 0.7, 10.0)])
        store.add_history([HistoryRow("sglang", model, "power:700@4-8", 3600, 3.6e6, 2.3e6, 0.9, 20.0)])
        store.add_history([HistoryRow("sglang", model, "power:550@4-8", 3600, 3.5e6, 1.9e6, 0.8, 30.0)])
        # An idle night at 400 W: a fine tokens/J of nothing, never compared with the busy hours.
        store.add_history([HistoryRow("sglang", model, "power:400@idle", 36000, 1e5, 5e6, 0.3, 40.0)])
        store.add_history([HistoryRow("sglang", model, "power:400@4-8", 30, 2e4, 1e4, 1.9, 40.0)])  # too short
        store.add_history([HistoryRow("sglang", model, "power:600@16-32", 600, 2e6, 3e5, 1.0, 50.0)])
        rows = store.history("sglang")
    top = next(r for r in rows if r.setting == "power:700@4-8")
    assert (top.seconds, top.e2e_p95_max_seconds) == (7200, 0.9)
    report = passive_report("sglang", rows, slo_e2e_p95_seconds=1.5)
    shown = [(item["traffic_band"], item["power_limit_watts"], item["enough"]) for item in report["limits"]]
    assert shown == [
        ("idle", 400, True),
        ("4-8", 700, True),
        ("4-8", 550, True),
        ("4-8", 400, False),
        ("16-32", 600, True),
    ]
    assert report["verdicts"] == [
        "NVIDIA H200 at idle (under 0.1 requests/s): not compared (tokens per joule there says nothing about a limit)",
        "NVIDIA H200 at 4-8 requests/s: 550 W looked free: +17.7% tokens/J against 700 W with tokens/s within 5%"
        " and p95 within the SLO (confirm with a sweep)",
        "NVIDIA H200 at 16-32 requests/s: too little history to compare limits: 600 W for 10.0 min; each limit"
        " needs 1 min at this traffic (a sweep, gpu-agent tune power, measures them now)",
    ]
    assert report["comparable"] is True and report["changed"] is False
    strict = passive_report("sglang", rows, slo_e2e_p95_seconds=0.75)
    assert "NVIDIA H200 at 4-8 requests/s: no lower limit looked free against 700 W" in strict["verdicts"]
    # History from before the bands: shown, never compared; with nothing to compare, not comparable.
    old = [HistoryRow("sglang", model, "power:700", 3600, 3.6e6, 2.3e6, 0.7, 10.0)]
    unbanded = passive_report("sglang", old, None)
    assert unbanded["limits"][0]["traffic_band"] == "unbanded" and unbanded["comparable"] is False
    assert unbanded["verdicts"][0].startswith(
        "NVIDIA H200 at traffic unknown (kept before traffic bands): not compared"
    )
    empty = passive_report("sglang", [], None)
    assert empty["comparable"] is False and empty["verdicts"][0].startswith("no history yet")


def test_traffic_bands_are_powers_of_two() -> None:
    assert [traffic_band(r) for r in (0.0, 0.05, 0.1, 1.0, 3.0, 4.0, 100.0)] == [
        "idle", "idle", "0.0625-0.125", "1-2", "2-4", "4-8", "64-128"
    ]  # fmt: skip


def test_only_a_trusted_peer_may_start_or_abort_a_sweep() -> None:
    """A group given read access to the socket (api.group) reads status but cannot change the node."""
    handlers = {"tune_start": lambda _p: {"id": 1}, "status": lambda _p: {"ok": 1}}
    untrusted = lambda method: method not in PRIVILEGED_METHODS  # noqa: E731
    refused = handle_request(b'{"method": "tune_start", "params": {}}', handlers, untrusted)
    assert refused == {
        "ok": False,
        "error": "tune_start changes the node: only root or the agent's own user may call it",
    }
    assert handle_request(b'{"method": "status"}', handlers, untrusted) == {"ok": True, "result": {"ok": 1}}
    assert handle_request(b'{"method": "tune_start"}', handlers, lambda _m: True)["ok"] is True
    assert {"tune_start", "tune_abort"} == PRIVILEGED_METHODS


def test_a_transaction_puts_back_a_lock_an_unlock_and_a_limit(tmp_path: Path) -> None:
    backend = SimulatedBackend(
        "h200x2", tmp_path / "state", writable_items={"power_limit", "locked_clocks"}
    )  # fmt: skip
    backend.init()
    backend.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, 1500, 1755)
    holds = PolicyHolds()
    keys = [(item, gpu) for item in ("locked_clocks", "power_limit") for gpu in (0, 1)]
    with holds.begin("tune-1", "tune sweep 1 drives it", backend, keys) as transaction:
        for gpu in (0, 1):
            transaction.write("locked_clocks", gpu, (1200, 1200))
            transaction.write("power_limit", gpu, 400.0)
        assert holds.held("power_limit", 1) == "tune sweep 1 drives it"
    assert transaction.restored == (
        "GPU 0 clocks locked 1500-1755 MHz",
        "GPU 1 clocks unlocked",
        "GPU 0 power limit 700 W",
        "GPU 1 power limit 700 W",
    )
    assert backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS) == (1500, 1755)
    assert backend.locked_clocks_mhz(1, ClockDomain.GRAPHICS) is None
    assert backend.power_limit_watts(1) == 700.0
    assert holds.held("power_limit", 1) is None and holds.active() == []


def test_an_original_that_could_not_go_back_stays_the_original(tmp_path: Path) -> None:
    """A restore the guard refuses is reported, and the next job on that setting takes the true
    original, never the step it was left at."""
    backend = SimulatedBackend("h200x2", tmp_path / "state", writable_items={"power_limit"})
    backend.init()
    holds = PolicyHolds()
    with holds.begin("tune-1", "tune sweep 1 drives it", backend, [("power_limit", 0)]) as transaction:
        transaction.write("power_limit", 0, 400.0)
        backend.write_guard = WriteGuard(())  # observe mode now: nothing may be written
    (line,) = transaction.restored or ()
    assert line.startswith("GPU 0 power limit 700 W NOT restored: refused to set_power_limit_watts")
    assert backend.power_limit_watts(0) == 400.0 and holds.held("power_limit", 0) is None
    backend.write_guard = WriteGuard({"power_limit"})
    with holds.begin("tune-2", "tune sweep 2 drives it", backend, [("power_limit", 0)]) as second:
        assert second.originals == {("power_limit", 0): 700.0}
        second.write("power_limit", 0, 550.0)
    assert second.restored == ("GPU 0 power limit 700 W",) and backend.power_limit_watts(0) == 700.0


def test_a_sweep_longer_than_two_hours_is_refused_before_it_starts() -> None:
    """64 steps of an hour's dwell was 64 h of a node held at settings nobody chose; the bound counts
    every step's settling and dwell, the current setting's own step included."""
    fine = {"kind": "power", "service": "sglang", "start": 700, "stop": 400, "step": 50, "dwell_seconds": 600}
    assert len(checked_request(fine).settings()) == 7  # 8 steps x (600 + 10) s: 81 min
    with pytest.raises(ApiError) as refused:
        checked_request({**fine, "dwell_seconds": 900})
    assert str(refused.value) == (
        "bad tune request: the sweep could take 2 h 1 min (8 steps x (900 s dwell + 10 s settle)); at most 2 h:"
        " fewer steps (a larger --step) or a shorter --dwell"
    )
    with pytest.raises(ApiError, match=r"could take 8 h 47 min \(62 steps"):
        checked_request({**fine, "step": 5, "dwell_seconds": 500})
