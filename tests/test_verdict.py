"""agent/verdict.py: every fact the agent holds that needs an operator is one attention line with
its cause, in every mode; a healthy node has none. (tests/test_fault_agreement.py checks that a real
daemon's status, JSON, /metrics, STATUS= and /healthz carry these lines.)"""

from __future__ import annotations

from dataclasses import replace

from snapshots import h200_snapshot

from agent.daemon.publisher import systemd_status_line
from agent.documents import snapshot_document
from agent.policy.plan import CUDA_TOO_OLD_FACT, ItemPlan, PlanStatus
from agent.state import NodeSnapshot, ServiceStatus, SloBreachNow
from agent.verdict import AttentionCause, attention, attention_items


def healthy() -> NodeSnapshot:
    return h200_snapshot(gpus=2)


def causes(snapshot: NodeSnapshot) -> list[AttentionCause]:
    return [item.cause for item in attention_items(snapshot)]


def test_a_healthy_node_needs_nothing() -> None:
    assert attention(healthy()) == []
    assert "all healthy" in systemd_status_line(healthy())
    assert snapshot_document(healthy(), source="daemon")["verdict"]["exit_code"] == 0


def test_a_service_down_is_attention() -> None:
    snapshot = replace(healthy(), services=(ServiceStatus("sglang", "", False, 3, None, "connection refused"),))
    assert attention(snapshot) == ["service sglang down: connection refused"]
    assert causes(snapshot) == [AttentionCause.SERVICE_DOWN]
    # not probed yet, or up: nothing to say
    quiet = replace(healthy(), services=(ServiceStatus("a", "", None), ServiceStatus("b", "", True)))
    assert attention(quiet) == []


def test_a_service_over_its_objective_names_the_figure_the_objective_and_the_cause() -> None:
    breach = SloBreachNow("sglang", "e2e_p95", 1.75, 1.0, "thermal_slowdown", "GPU 1 thermal slowdown for 42 s at 91 C")
    snapshot = replace(healthy(), slo_breaches=(breach,))
    assert attention(snapshot) == [
        "service sglang over its latency objective: e2e p95 1.75 s > 1 s; likely cause: GPU 1 thermal slowdown"
        " for 42 s at 91 C"
    ]
    document = snapshot_document(snapshot, source="daemon")
    assert document["verdict"]["exit_code"] == 2
    assert document["verdict"]["causes"] == ["service_slo"]
    assert document["verdict"]["slo_breaches"][0]["cause"] == "thermal_slowdown"


def test_a_next_boot_that_is_not_ready_is_attention_in_observe_mode_too() -> None:
    summary = "6.8.0-50-generic — nvidia 580.159.04 module missing"
    plan = ItemPlan(
        "next_boot",
        None,
        PlanStatus.DRIFT,
        "ready",
        "6.8.0-50-generic: not ready",
        facts=(("kernel", "6.8.0-50-generic"), ("summary", summary)),
    )
    for mode in ("observe", "enforce"):
        snapshot = replace(healthy(), policy=(plan,), item_modes={"next_boot": mode})
        assert attention(snapshot) == [f"next boot not ready: {summary}"], mode
        assert "ATTENTION: next boot not ready" in systemd_status_line(snapshot)
        assert "all healthy" not in systemd_status_line(snapshot)


def test_a_driver_too_old_for_a_service_is_attention_and_not_also_drift() -> None:
    too_old = "sglang needs CUDA 13.1; driver 580.82.07 supports CUDA 13.0"
    plan = ItemPlan(
        "driver",
        None,
        PlanStatus.DRIFT,
        "any",
        "580.82.07 (580 branch, CUDA 13.0)",
        changes=(too_old,),
        facts=(("version", "580.82.07"), ("cuda_version", "13.0"), (CUDA_TOO_OLD_FACT, too_old)),
    )
    for mode in ("observe", "enforce"):
        snapshot = replace(healthy(), policy=(plan,), item_modes={"driver": mode})
        assert attention(snapshot) == [f"driver too old: {too_old}"], mode
    pinned = replace(plan, facts=(("version", "580.82.07"),))  # a pinned version missed: enforce-mode drift only
    assert attention(replace(healthy(), policy=(pinned,), item_modes={"driver": "observe"})) == []
    assert causes(replace(healthy(), policy=(pinned,), item_modes={"driver": "enforce"})) == [
        AttentionCause.POLICY_DRIFT
    ]


def test_no_rules_loaded_from_configured_dirs_is_attention_unless_remediation_is_off() -> None:
    none_loaded = replace(healthy(), rules_loaded=0, rules_dirs=("/etc/gpu-agent/rules.d",))
    assert causes(none_loaded) == [AttentionCause.NO_RULES]
    assert attention(none_loaded)[0].startswith("no remediation rules loaded from /etc/gpu-agent/rules.d")
    assert attention(replace(none_loaded, rules_loaded=3)) == []
    assert attention(replace(none_loaded, rules_loaded=None, rules_dirs=())) == []  # off, or a direct read


def test_what_a_reload_left_is_a_config_line() -> None:
    snapshot = replace(healthy(), config_pending_restart=("state_dir",))
    assert attention(snapshot) == ["config change needs a restart: state_dir"]
    assert causes(snapshot) == [AttentionCause.CONFIG]
    assert systemd_status_line(snapshot).endswith("; ATTENTION: config change needs a restart: state_dir")


def test_status_line_tells_a_setting_held_by_a_sweep_from_one_in_sync() -> None:
    """A tune sweep holds a GPU's power limit off its declared value on purpose: systemd's STATUS=
    says so (as `status` and /metrics do), neither "in sync" nor drift."""
    held = ItemPlan("power_limit", 0, PlanStatus.HELD, "700", "550", "held by gpu-agent tune power (sweep 3)")
    line = systemd_status_line(replace(healthy(), policy=(held,)))
    assert "policy: 1 held by a running job" in line, line
    assert "in sync" not in line and "drifted" not in line
    drift = replace(held, gpu=1, status=PlanStatus.DRIFT, detail="")
    assert "policy: 1 item(s) drifted, 1 held by a running job" in systemd_status_line(
        replace(healthy(), policy=(held, drift))
    )
