"""What a sweep checks before it starts (agent.tune.preflight) and what `tune apply` checks before it
writes (agent.tune.apply): a sick subject, the swept GPUs as the sweep found them, a recommendation
gone stale, and the drop-in that puts it in force for exactly the swept GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from snapshots import h200_snapshot

from agent.api import ApiError
from agent.backend.base import GpuIdentity
from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig
from agent.events import Health, HealthState
from agent.services.latency_cause import strain
from agent.state import ServiceFigures
from agent.tune.apply import dropin_text, stale
from agent.tune.model import Recommendation, SweptGpu, TuneDocument, TuneRequest
from agent.tune.preflight import setting_range, sick_subject, swept_gpus

H200 = "NVIDIA H200"
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
CONFIG = AgentConfig.model_validate(
    {
        "policy": {
            "gpus": [
                {"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 600, "persistence": "enabled"},
                {"match": {"model": "NVIDIA RTX*"}, "power_limit_watts": 300},
            ]
        }
    }
)


def node(*models: str) -> dict[int, GpuIdentity]:
    return {i: GpuIdentity(i, f"GPU-{i}", model, f"0000:0{i}:00.0", "", "", 0) for i, model in enumerate(models)}


def figures(waiting: list[tuple[float, float]], kv: float | None = 0.5) -> ServiceFigures:
    return ServiceFigures("sglang", "sglang", 1000.0, 300.0, kv_cache_usage_ratio=kv, waiting_history=tuple(waiting))


def test_a_strained_server_is_named_and_a_drained_burst_is_not() -> None:
    assert strain(figures([(900, 0), (950, 0), (1000, 0)])) == []
    assert strain(figures([(900, 0)], kv=0.97)) == ["KV cache 97% full (new requests wait for room)"]
    assert strain(figures([(940, 2), (970, 6), (1000, 11)])) == [
        "waiting queue growing: 2 -> 11 requests over the last 60 s"
    ]
    # A burst minutes ago, or one that drained again within the minute: not growing now.
    assert strain(figures([(700, 0), (800, 40), (950, 0), (1000, 0)])) == []
    assert strain(figures([(950, 0), (970, 9), (1000, 3)])) == []


def test_a_sick_subject_says_why_gpu_by_gpu() -> None:
    snapshot = h200_snapshot(
        health={
            0: Health.healthy(),
            1: Health(HealthState.DEGRADED, "1 uncorrected ECC error (volatile)"),
        },
        stale_gpus=frozenset({2}),
    )
    assert sick_subject(snapshot, "sglang", [0], figures([])) == []
    assert sick_subject(snapshot, "sglang", [0, 1, 2, 7], figures([(990, 1), (1000, 5)], kv=0.96)) == [
        "GPU 1 is degraded: 1 uncorrected ECC error (volatile)",
        "GPU 2's readings are stale (a call hung)",
        "GPU 7 does not answer",
        "service sglang: KV cache 96% full (new requests wait for room)",
        "service sglang: waiting queue growing: 1 -> 5 requests over the last 10 s",
    ]


def test_every_step_is_checked_against_the_board_before_anything_is_set(tmp_path: object) -> None:
    from pathlib import Path

    backend = SimulatedBackend("h200x2", Path(str(tmp_path)) / "sim")
    backend.init()
    request = TuneRequest("power", "sglang", 700, 100, 150, 5)
    with pytest.raises(ApiError, match=r"refused: 100 W is outside GPU 0's power limit range 200-700 W"):
        setting_range(backend, request, [0, 1])
    assert setting_range(backend, replace(request, stop=400), [0, 1]) == (200.0, 700.0)
    clocks = TuneRequest("clocks", "sglang", 1980, 1000, 7, 5)
    with pytest.raises(ApiError, match=r"1973 MHz is not a supported graphics clock of GPU 0 \("):
        setting_range(backend, clocks, [0])


def test_the_swept_gpus_are_written_down_with_the_profile_they_ran_under() -> None:
    mixed = node(H200, H200, RTX)
    one, *_ = swept_gpus(CONFIG.policy, mixed, [0])
    assert (one.whole_model, one.profile, one.profile_alone) == (False, 0, False)
    assert one.profile_match == '{model: "NVIDIA H200*"}'
    assert one.settings == {"power_limit_watts": 600.0, "persistence": "enabled"}
    both = swept_gpus(CONFIG.policy, mixed, [0, 1])
    assert all(g.whole_model and g.profile_alone for g in both)
    with pytest.raises(ApiError, match="GPU 5 does not answer"):
        swept_gpus(CONFIG.policy, mixed, [5])


def applied(swept: tuple[SweptGpu, ...], setting: float = 450, kind: str = "power") -> TuneDocument:
    recommendation = Recommendation(setting, H200, "", 0.1, -0.01, 0.0, "", targets="")
    request = TuneRequest(kind, "sglang", 700, 400, 150, 5)  # type: ignore[arg-type]
    gpus = tuple(g.gpu for g in swept)
    return TuneDocument(7, request, gpus, (), "done", 0.0, recommendation=recommendation, swept=swept)


def test_the_drop_in_names_exactly_the_swept_gpus_and_sets_only_the_recommended_key() -> None:
    mixed = node(H200, H200, RTX)
    one = applied(swept_gpus(CONFIG.policy, mixed, [0]))
    text = dropin_text(one, "2030-01-01 00:00:00")
    assert text.endswith(
        'policy:\n  gpu_overrides:\n    - match: {uuid: "GPU-0"}  # GPU 0\n      power_limit_watts: 450\n'
    )
    assert "from tune 7 (power sweep of service sglang)" in text.replace("\n# ", " ")
    model = applied(swept_gpus(CONFIG.policy, mixed, [0, 1]))
    assert dropin_text(model, "").endswith(
        '    - match: {model: "NVIDIA H200"}  # every GPU of this model was swept\n      power_limit_watts: 450\n'
    )
    locked = AgentConfig.model_validate(
        {"policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "locked_clocks": {"memory_mhz": [3201, 3201]}}]}}
    )
    clock = applied(swept_gpus(locked.policy, mixed, [0]), 1500, "clocks")
    # A clock lock is one key: the memory lock the profile has goes with the new graphics lock.
    assert "locked_clocks: {gpu_mhz: [1500, 1500], memory_mhz: [3201, 3201]}" in dropin_text(clock, "")


def test_a_recommendation_goes_stale_when_its_gpus_or_its_profile_change() -> None:
    mixed = node(H200, H200, RTX)
    now = {i: (g.uuid, g.name) for i, g in mixed.items()}
    one = applied(swept_gpus(CONFIG.policy, mixed, [0]))
    both = applied(swept_gpus(CONFIG.policy, mixed, [0, 1]))
    assert stale(one, now, CONFIG) == [] and stale(both, now, CONFIG) == []
    swapped = {**now, 0: ("GPU-9", H200)}
    assert stale(one, swapped, CONFIG) == ["GPU 0 is GPU-9 now, not the GPU-0 the sweep measured"]
    assert stale(one, {k: v for k, v in now.items() if k}, CONFIG) == [
        "GPU 0 is gone now, not the GPU-0 the sweep measured"
    ]
    third = {**now, 3: ("GPU-3", H200)}
    assert stale(both, third, CONFIG)[0] == "the node has 3 NVIDIA H200 GPUs now, 2 when the sweep measured all of them"
    edited = AgentConfig.model_validate(
        {"policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 650}]}}
    )
    assert stale(one, now, edited) == [
        "GPU 0's power_limit_watts in the config is 650.0 now, 600.0 when the sweep measured against it"
    ]
