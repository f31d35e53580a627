"""SLO checks on a service's own latency and the cause named for a breach: one test per cause, the
priority between causes, the event and its evidence, and one event per breach."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.config.service_entry import ServiceSlo
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.services.latency_cause import CauseFinding, SloWatch, attribute_cause, check_slo, regression_event
from agent.state import GpuSample, LatencyFigures, QueueTimeTrend, ServiceFigures

GIB = 1024**3
HW_SLOWDOWN = 0x8
HW_THERMAL = 0x40
SW_POWER_CAP = 0x4
GPU_IDLE = 0x1


def sample(gpu: int, t: float, **fields: object) -> GpuSample:
    base: dict[str, object] = {
        "temperature_celsius": 66,
        "power_usage_watts": 655.0,
        "power_limit_watts": 700.0,
        "graphics_clock_mhz": 1980,
        "sm_clock_mhz": 1980,
        "clock_event_reasons": 0,
        "gpu_utilization_percent": 97,
        "memory_used_bytes": 126 * GIB,
        "memory_total_bytes": 141 * GIB,
        "slowdown_temperature_celsius": 89,
    }
    base.update(fields)
    return GpuSample(gpu, f"GPU-{gpu}", "NVIDIA H200", f"0000000{gpu}:18:00.0", True, t, **base)  # type: ignore[arg-type]


def clean_window(gpus: tuple[int, ...] = (0, 1), seconds: int = 60) -> list[GpuSample]:
    return [sample(gpu, float(t)) for gpu in gpus for t in range(0, seconds, 5)]


def figures(e2e_p95: float | None = 2.0, ttft_p95: float | None = 0.3, requests: float = 100) -> ServiceFigures:
    latency = {}
    if e2e_p95 is not None:
        latency["e2e"] = LatencyFigures(requests, 1.0, {0.5: 1.0, 0.95: e2e_p95, 0.99: e2e_p95 * 1.1})
    if ttft_p95 is not None:
        latency["ttft"] = LatencyFigures(requests, 0.1, {0.5: 0.1, 0.95: ttft_p95, 0.99: ttft_p95 * 1.1})
    return ServiceFigures("sglang", "sglang", 60.0, 60.0, latency, running=20, waiting=0, kv_cache_usage_ratio=0.5)


def xid_event(gpu: int, t: float, code: int = 13) -> Event:
    return Event(
        EventKind.XID,
        Severity.WARNING,
        gpu,
        f"GPU-{gpu}",
        f"Xid {code} on GPU {gpu}",
        t,
        "nvml",
        key=f"xid:GPU-{gpu}:{code}:{t}",
        data={"xid": code},
    )


# -- the SLO -------------------------------------------------------------------------------------------


def test_slo_breaches_name_the_missed_objective() -> None:
    slo = ServiceSlo(e2e_p95_seconds=1.5, ttft_p95_seconds=0.5)
    (breach,) = check_slo(slo, figures(e2e_p95=2.0, ttft_p95=0.3))
    assert (breach.objective, breach.observed_seconds, breach.limit_seconds) == ("e2e_p95", 2.0, 1.5)
    both = check_slo(slo, figures(e2e_p95=2.0, ttft_p95=0.9))
    assert [b.objective for b in both] == ["e2e_p95", "ttft_p95"]
    assert check_slo(slo, figures(e2e_p95=1.4)) == []


def test_no_verdict_without_an_slo_figures_or_enough_requests() -> None:
    slo = ServiceSlo(e2e_p95_seconds=1.5, min_requests=20)
    assert check_slo(None, figures()) == []
    assert check_slo(slo, None) == []
    assert check_slo(slo, figures(requests=19)) == []
    assert len(check_slo(slo, figures(requests=20))) == 1


# -- causes ----------------------------------------------------------------------------------------------


def test_clean_gpus_and_a_growing_queue_is_queueing() -> None:
    finding = attribute_cause(clean_window(), gpus=[0, 1], waiting_history=[(0, 0), (30, 12), (60, 40)])
    assert finding.cause == "queueing"
    assert finding.gpu is None
    assert finding.evidence["queue"] == {"waiting_first": 0, "waiting_peak": 40}
    assert "grew from 0 to 40" in finding.summary


def test_clean_gpus_and_rising_queue_time_is_queueing_with_its_evidence() -> None:
    rising = QueueTimeTrend(earlier_mean_seconds=0.05, later_mean_seconds=2.1)
    finding = attribute_cause(
        clean_window(), gpus=[0, 1], waiting_history=[(0, 3), (60, 3)], queue_time=rising, queue_time_p95_seconds=4.2
    )
    assert finding.cause == "queueing"
    assert "queue time rose from 0.05 s to 2.10 s" in finding.summary
    assert finding.evidence["queue"] == {
        "waiting_first": 3,
        "waiting_peak": 3,
        "queue_time_mean_earlier_seconds": 0.05,
        "queue_time_mean_later_seconds": 2.1,
        "queue_time_p95_seconds": 4.2,
    }
    steady = QueueTimeTrend(earlier_mean_seconds=0.05, later_mean_seconds=0.07)  # under 1.5 times: noise
    assert attribute_cause(clean_window(), gpus=[0, 1], queue_time=steady).cause == "unknown"


KV_FULL = [(0.0, 0.90), (30.0, 0.97), (60.0, 0.96)]


def test_a_full_kv_cache_with_a_growing_queue_is_kv_cache_full() -> None:
    finding = attribute_cause(
        clean_window(), gpus=[0, 1], waiting_history=[(0, 0), (60, 25)], kv_cache_usage_history=KV_FULL
    )
    assert finding.cause == "kv_cache_full"
    assert finding.gpu is None
    assert finding.summary == "KV cache 97% full, waiting requests grew from 0 to 25"
    assert finding.evidence["kv_cache_usage_peak_ratio"] == 0.97
    assert finding.evidence["kv_cache_usage_last_ratio"] == 0.96
    by_queue_time = attribute_cause(
        clean_window(), gpus=[0, 1], kv_cache_usage_history=KV_FULL, queue_time=QueueTimeTrend(0.1, 0.9)
    )
    assert by_queue_time.cause == "kv_cache_full"
    assert "queue time rose from 0.10 s to 0.90 s" in by_queue_time.summary


def test_a_full_kv_cache_without_a_queue_or_a_queue_under_a_fuller_cache_is_not_kv_cache_full() -> None:
    quiet = attribute_cause(
        clean_window(), gpus=[0, 1], waiting_history=[(0, 2), (60, 2)], kv_cache_usage_history=KV_FULL
    )
    assert quiet.cause == "unknown"  # a full cache serving everything it admits: no latency cause
    roomy = [(0.0, 0.80), (60.0, 0.94)]
    queued = attribute_cause(
        clean_window(), gpus=[0, 1], waiting_history=[(0, 0), (60, 9)], kv_cache_usage_history=roomy
    )
    assert queued.cause == "queueing"


def test_a_gpu_cause_comes_before_a_full_kv_cache() -> None:
    hot = [sample(0, float(t), temperature_celsius=91, clock_event_reasons=HW_THERMAL) for t in (40, 45, 50, 55)]
    finding = attribute_cause(
        clean_window() + hot, gpus=[0, 1], waiting_history=[(0, 0), (60, 25)], kv_cache_usage_history=KV_FULL
    )
    assert finding.cause == "thermal_slowdown"


def test_clean_gpus_and_no_queue_is_unknown() -> None:
    finding = attribute_cause(clean_window(), gpus=[0, 1], waiting_history=[(0, 0), (60, 0)])
    assert finding.cause == "unknown"
    assert finding.evidence["temperatures_celsius"] == {"0": 66, "1": 66}


def test_thermal_slowdown_names_the_gpu_its_temperature_and_seconds() -> None:
    window = clean_window()
    hot = [
        sample(1, float(t), temperature_celsius=91, clock_event_reasons=HW_SLOWDOWN | HW_THERMAL)
        for t in (40, 45, 50, 55)
    ]
    finding = attribute_cause(window + hot, gpus=[0, 1], waiting_history=[(0, 0), (60, 9)])
    assert finding.cause == "thermal_slowdown"
    assert finding.gpu == 1
    assert finding.uuid == "GPU-1"
    assert finding.evidence["temperature_celsius"] == 91
    assert finding.evidence["slowdown_temperature_celsius"] == 89
    # four samples 5 s apart: the last one counts a typical interval too
    assert finding.evidence["reasons"] == {"hw_slowdown": 20.0, "hw_thermal_slowdown": 20.0}
    assert finding.summary == "GPU 1 thermal slowdown for 40 s at 91 C"


def test_power_cap_names_the_gpu_and_its_limit() -> None:
    capped = [
        sample(0, float(t), clock_event_reasons=SW_POWER_CAP, power_usage_watts=600.0, power_limit_watts=600.0)
        for t in range(0, 60, 5)
    ]
    finding = attribute_cause(capped + clean_window((1,)), gpus=[0, 1])
    assert finding.cause == "power_cap"
    assert finding.gpu == 0
    assert finding.evidence["power_limit_watts"] == 600.0
    assert finding.evidence["reasons"] == {"sw_power_cap": 60.0}


def test_clocks_below_the_locked_clock_without_a_reason() -> None:
    slow = [sample(0, float(t), graphics_clock_mhz=1410) for t in range(0, 60, 5)]
    finding = attribute_cause(slow, gpus=[0], expected_clock_mhz={0: 1980})
    assert finding.cause == "clocks_below_expected"
    assert finding.gpu == 0
    assert (finding.evidence["expected_clock_mhz"], finding.evidence["lowest_clock_mhz"]) == (1980, 1410)
    # without an expected clock there is nothing to compare with
    assert attribute_cause(slow, gpus=[0]).cause == "unknown"


def test_idle_clocks_are_not_clocks_below_expected() -> None:
    idle = [
        sample(0, float(t), graphics_clock_mhz=345, clock_event_reasons=GPU_IDLE, gpu_utilization_percent=0)
        for t in range(0, 60, 5)
    ]
    assert attribute_cause(idle, gpus=[0], expected_clock_mhz={0: 1980}).cause == "unknown"


def test_memory_near_full() -> None:
    full = [sample(0, float(t), memory_used_bytes=int(140.5 * GIB)) for t in range(0, 60, 5)]
    finding = attribute_cause(full, gpus=[0])
    assert finding.cause == "memory_near_full"
    assert finding.evidence["memory_used_ratio"] == pytest.approx(140.5 / 141, abs=1e-4)
    # a server's usual ~90 % preallocation is not "full"
    assert attribute_cause(clean_window((0,)), gpus=[0]).cause == "unknown"


def test_a_recent_xid_on_the_service_gpus_comes_first() -> None:
    window = clean_window()
    hot = [sample(1, 50.0, temperature_celsius=91, clock_event_reasons=HW_SLOWDOWN)]
    finding = attribute_cause(window + hot, gpus=[0, 1], xid_events=[xid_event(0, 30.0)], window_start_seconds=0.0)
    assert finding.cause == "xid"
    assert finding.gpu == 0
    assert finding.evidence["xids"] == [13]


def test_xids_outside_the_window_or_on_other_gpus_do_not_count() -> None:
    old_or_elsewhere = [xid_event(0, -10.0), xid_event(5, 30.0), replace(xid_event(0, 30.0), kind=EventKind.GPU_LOST)]
    finding = attribute_cause(clean_window(), gpus=[0, 1], xid_events=old_or_elsewhere, window_start_seconds=0.0)
    assert finding.cause == "unknown"


def test_only_the_service_gpus_are_looked_at() -> None:
    hot_elsewhere = [
        sample(3, float(t), temperature_celsius=92, clock_event_reasons=HW_THERMAL) for t in range(0, 60, 5)
    ]
    assert attribute_cause(clean_window() + hot_elsewhere, gpus=[0, 1]).cause == "unknown"
    assert attribute_cause(clean_window() + hot_elsewhere, gpus=None).cause == "thermal_slowdown"


def test_thermal_outranks_power_and_queueing() -> None:
    both = [
        sample(0, float(t), clock_event_reasons=SW_POWER_CAP | HW_THERMAL, temperature_celsius=90)
        for t in range(0, 60, 5)
    ]
    finding = attribute_cause(both, gpus=[0], waiting_history=[(0, 0), (60, 50)])
    assert finding.cause == "thermal_slowdown"


# -- the event ---------------------------------------------------------------------------------------------


def test_the_event_carries_cause_evidence_and_points_thermal_at_the_fan_curve() -> None:
    hot = [sample(2, float(t), temperature_celsius=91, clock_event_reasons=HW_THERMAL) for t in range(0, 60, 5)]
    finding = attribute_cause(hot, gpus=[2])
    slo = ServiceSlo(e2e_p95_seconds=1.5)
    event = regression_event("sglang", check_slo(slo, figures()), finding, figures(), now=60.0)
    assert event.kind is EventKind.SERVICE_LATENCY_REGRESSION
    assert event.kind.value == "service_latency_regression"
    assert (event.gpu, event.uuid) == (2, "GPU-2")
    assert (
        event.message == "service sglang: e2e p95 2.00 s > 1.5 s; likely cause: GPU 2 thermal slowdown for 60 s at 91 C"
    )
    assert event.data["cause"] == "thermal_slowdown"
    assert event.data["see_policy"] == "fan_curve"
    assert event.data["breaches"] == [
        {"objective": "e2e_p95", "observed_seconds": 2.0, "limit_seconds": 1.5, "requests": 100}
    ]
    assert event.data["evidence"]["temperature_celsius"] == 91
    assert event.suggested_action is SuggestedAction.CHECK_MECHANICALS
    assert event.key == "service_latency_regression:sglang:thermal_slowdown"


def test_slo_watch_emits_once_per_breach_and_again_when_the_cause_changes() -> None:
    watch = SloWatch()
    slo = ServiceSlo(e2e_p95_seconds=1.5)
    calls: list[str] = []

    def cause(name: str):  # type: ignore[no-untyped-def]
        def attribute():  # type: ignore[no-untyped-def]
            calls.append(name)
            return attribute_cause(clean_window(), gpus=[0], waiting_history=[(0, 0), (1, 5 if name == "q" else 0)])

        return attribute

    assert watch.update("sglang", slo, figures(e2e_p95=1.0), cause("q"), 1.0) == []
    assert calls == []  # no breach: the cause is not even looked for
    (first,) = watch.update("sglang", slo, figures(), cause("q"), 2.0)
    assert first.data["cause"] == "queueing"
    assert watch.update("sglang", slo, figures(), cause("q"), 3.0) == []
    (changed,) = watch.update("sglang", slo, figures(), cause("u"), 4.0)
    assert changed.data["cause"] == "unknown"
    assert watch.update("sglang", slo, figures(e2e_p95=1.0), cause("q"), 5.0) == []
    (again,) = watch.update("sglang", slo, figures(), cause("u"), 6.0)
    assert again.timestamp_seconds == 6.0


def test_slo_watch_holds_the_breach_in_progress_for_the_verdict() -> None:
    """Not only the event when a breach starts: while it lasts the verdict has it, with its figure,
    objective and cause; once the service is back under its objective, it has none."""
    watch = SloWatch()
    slo = ServiceSlo(e2e_p95_seconds=1.5)

    def queueing() -> CauseFinding:
        return attribute_cause(clean_window(), gpus=[0], waiting_history=[(0, 0), (1, 5)])

    assert watch.breaches() == ()
    watch.update("sglang", slo, figures(e2e_p95=2.0), queueing, 1.0)
    watch.update("sglang", slo, figures(e2e_p95=2.5), queueing, 2.0)  # no new event; the figure moves on
    (breach,) = watch.breaches()
    assert (breach.service, breach.objective, breach.observed_seconds, breach.limit_seconds) == (
        "sglang",
        "e2e_p95",
        2.5,
        1.5,
    )
    assert breach.cause == "queueing" and breach.cause_summary.startswith("queueing: waiting requests grew")
    watch.update("sglang", slo, figures(e2e_p95=1.0), queueing, 3.0)
    assert watch.breaches() == ()
