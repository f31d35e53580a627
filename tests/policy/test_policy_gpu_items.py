"""The five GPU policy items (power limit, locked clocks, fan curve, persistence, ECC) against
the simulated backend, on an H200 (SXM: no fans, ECC on) and an RTX PRO 6000 (fans, ECC off)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.backend.base import SETTER_ITEMS, ClockDomain, GpuBackend
from agent.backend.errors import GpuErrorKind, WriteRefused
from agent.backend.sim import SimulatedBackend
from agent.config import GPU_ITEMS, AgentConfig, Mode, PolicyConfig
from agent.config.desired import FanCurve, GpuMatch, GpuProfile, LockedClocks
from agent.host.paths import HostPaths
from agent.names.policy_items import GPU_ITEM_NAMES, GPU_RESET_ITEM, NODE_ITEM_NAMES
from agent.policy import ecc, fan_curve, locked_clocks, persistence, power_limit
from agent.policy.base import ERROR_LABELS, GpuContext, HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.gpu_item import format_watts
from agent.policy.item import GpuItem, NodeItem, Planned, PolicyItem, RestorableGpuItem, enforce, planned
from agent.policy.plan import ApplyOutcome, ItemPlan, PlanStatus
from agent.policy.registry import GPU_ITEMS as REGISTERED
from agent.policy.registry import NODE_ITEMS, RESTORABLE_ITEMS, RESTORABLE_NAMES

PROFILES = ("h200", "rtx-pro-6000")
GPU = 0


class Recorder:
    """The simulated backend, with every setter call written down (to prove nothing was re-applied)."""

    def __init__(self, inner: SimulatedBackend) -> None:
        self.inner = inner
        self.writes: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in SETTER_ITEMS:
            return attr

        def record(*args: Any) -> Any:
            self.writes.append((name, args))
            return attr(*args)

        return record


@dataclass
class Node:
    backend: SimulatedBackend
    recorder: Recorder
    ctx: GpuContext


def make_node(
    tmp_path: Path,
    profile: str,
    writable: Iterable[str] = GPU_ITEMS,
    privileged: bool = True,
) -> Node:
    backend = SimulatedBackend(profile, tmp_path / "state", writable_items=tuple(writable), privileged=privileged)
    backend.init()
    recorder = Recorder(backend)
    ctx = GpuContext(backend=recorder, gpu=GPU, identity=backend.identity(GPU))  # type: ignore[arg-type]
    return Node(backend, recorder, ctx)


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- per-item desired values -----------------------------------------------------------------------


def _graphics_clock(backend: GpuBackend, offset: int) -> tuple[int, int]:
    """A supported graphics clock `offset` steps into the list, and the memory clock it belongs to."""
    memory_mhz = max(backend.supported_memory_clocks_mhz(GPU))
    return sorted(backend.supported_graphics_clocks_mhz(GPU, memory_mhz))[offset], memory_mhz


CURVE = FanCurve(points=[(30, 30), (50, 65), (75, 100)], hysteresis_celsius=3)


@dataclass(frozen=True)
class Case:
    """How to exercise one item: a desired value that differs from the board's state, and one that
    the board cannot take (with the words the error must contain)."""

    item: GpuItem[Any, Any]
    drift: Callable[[GpuBackend], Any]
    impossible: Callable[[GpuBackend], tuple[Any, list[str]]] | None
    settles_after_reboot: bool = False


def _power_drift(backend: GpuBackend) -> float:
    low, high = backend.power_limit_constraints_watts(GPU)
    return round((low + high) / 2)


def _power_impossible(backend: GpuBackend) -> tuple[Any, list[str]]:
    low, high = backend.power_limit_constraints_watts(GPU)
    want = high + 200
    return want, [f"{format_watts(want)} W is outside this board's range {format_watts(low)}-{format_watts(high)} W"]


def _clocks_drift(backend: GpuBackend) -> LockedClocks:
    graphics_mhz, memory_mhz = _graphics_clock(backend, 10)
    return LockedClocks(gpu_mhz=(graphics_mhz, graphics_mhz), memory_mhz=(memory_mhz, memory_mhz))


def _clocks_impossible(backend: GpuBackend) -> tuple[Any, list[str]]:
    graphics_mhz, memory_mhz = _graphics_clock(backend, 10)
    below, above = graphics_mhz, _graphics_clock(backend, 11)[0]
    supported = backend.supported_graphics_clocks_mhz(GPU, memory_mhz)
    return LockedClocks(gpu_mhz=(graphics_mhz + 1, graphics_mhz + 1)), [
        f"graphics clock {graphics_mhz + 1} MHz is not supported",
        f"nearest supported: {below}, {above} MHz",
        f"range {min(supported)}-{max(supported)} MHz",
    ]


def _fan_impossible(backend: GpuBackend) -> tuple[Any, list[str]]:
    low, high = backend.fan_speed_range_percent(GPU)
    return FanCurve(points=[(20, low - 10), (80, high)]), [
        f"fan curve point 20 C -> {low - 10}% is outside this board's fan speed range {low}-{high}%"
    ]


def _flip(enabled: bool) -> str:
    return "disabled" if enabled else "enabled"


CASES = {
    "power_limit": Case(power_limit.ITEM, _power_drift, _power_impossible),
    "locked_clocks": Case(locked_clocks.ITEM, _clocks_drift, _clocks_impossible),
    "fan_curve": Case(fan_curve.ITEM, lambda b: CURVE, _fan_impossible),
    "persistence": Case(persistence.ITEM, lambda b: _flip(b.persistence_enabled(GPU)), None),
    "ecc": Case(ecc.ITEM, lambda b: _flip(b.ecc_mode(GPU).current), None, settles_after_reboot=True),
}

# Fans are the one feature the H200 lacks: that pairing has its own not-applicable test.
APPLICABLE = [(p, item) for p in PROFILES for item in GPU_ITEMS if (p, item) != ("h200", "fan_curve")]
ids = [f"{p}-{item}" for p, item in APPLICABLE]


# -- every item, both boards -----------------------------------------------------------------------


def test_every_registered_item_satisfies_its_protocol() -> None:
    """mypy checks each item class against its protocol (agent/policy/registry.py is typed on them);
    this checks the registry at run time: every name has its item, in the names' order, and each
    item carries the members the engine calls."""
    assert [i.name for i in REGISTERED] == list(GPU_ITEM_NAMES) == [*CASES, "vbios"]
    assert [i.name for i in NODE_ITEMS] == list(NODE_ITEM_NAMES)
    for registered in REGISTERED:
        assert isinstance(registered, GpuItem) and isinstance(registered, PolicyItem)
        assert registered.scope == "gpu"
        assert registered.name == "vbios" or CASES[registered.name].item is registered
    for node_item in NODE_ITEMS:
        assert isinstance(node_item, NodeItem) and not isinstance(node_item, RestorableGpuItem)
        assert node_item.scope == "node"
    assert [i.name for i in REGISTERED if isinstance(i, RestorableGpuItem)] == [
        "power_limit",
        "locked_clocks",
        "fan_curve",
    ]
    assert {i.name for i in RESTORABLE_ITEMS} == RESTORABLE_NAMES == {"power_limit", "locked_clocks", "fan_curve"}
    # The write guard knows every GPU item's setters, and nothing else but the reset permission.
    assert set(SETTER_ITEMS.values()) == {*GPU_ITEMS, GPU_RESET_ITEM}  # report-only vbios has no setter
    assert set(ERROR_LABELS) == set(GpuErrorKind)


def test_desired_reads_the_profile() -> None:
    profile = GpuProfile(
        match=GpuMatch(model="NVIDIA H200*"),
        power_limit_watts=600,
        locked_clocks=LockedClocks(gpu_mhz=(1500, 1500)),
        fan_curve=FanCurve.model_validate([[30, 30], [60, 100]]),
        persistence="enabled",
        ecc="disabled",
    )
    assert power_limit.ITEM.desired(profile) == 600
    assert locked_clocks.ITEM.desired(profile) == LockedClocks(gpu_mhz=(1500, 1500))
    assert fan_curve.ITEM.desired(profile) == FanCurve(points=[(30, 30), (60, 100)])
    assert persistence.ITEM.desired(profile) == "enabled"
    assert ecc.ITEM.desired(profile) == "disabled"
    empty = GpuProfile(match=GpuMatch(index=0))
    assert all(case.item.desired(empty) is None for case in CASES.values())


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_drift_apply_then_in_sync_and_not_reapplied(tmp_path: Path, profile: str, item: str) -> None:
    case = CASES[item]
    node = make_node(tmp_path, profile)
    want = case.drift(node.backend)

    done = case.item.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.DRIFT, done
    assert (done.plan.item, done.plan.gpu) == (item, GPU)
    assert done.plan.changes and done.plan.desired != done.plan.actual
    assert not node.recorder.writes, "plan must only read"

    result = enforce(case.item, node.ctx, want, done)
    expected_outcome = ApplyOutcome.REBOOT_REQUIRED if case.settles_after_reboot else ApplyOutcome.APPLIED
    assert result.outcome is expected_outcome, result
    assert node.recorder.writes and all(SETTER_ITEMS[name] == item for name, _ in node.recorder.writes)

    if case.settles_after_reboot:
        assert case.item.plan(node.ctx, want).plan.status is PlanStatus.REBOOT_REQUIRED
        node.backend.reboot()
    node.recorder.writes.clear()
    again = case.item.plan(node.ctx, want)
    assert again.plan.status is PlanStatus.IN_SYNC, again
    assert again.plan.changes == ()
    assert again.plan.desired == again.plan.actual or item == "fan_curve"
    unchanged = enforce(case.item, node.ctx, want, again)
    assert unchanged.outcome is ApplyOutcome.UNCHANGED
    assert node.recorder.writes == []


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_in_sync_state_survives_a_new_backend(tmp_path: Path, profile: str, item: str) -> None:
    """Settings live in the (simulated) device, not in the agent: a fresh process sees them in sync."""
    case = CASES[item]
    first = make_node(tmp_path, profile)
    want = case.drift(first.backend)
    enforce(case.item, first.ctx, want, case.item.plan(first.ctx, want))
    if case.settles_after_reboot:
        first.backend.reboot()
    second = make_node(tmp_path, profile)
    done = case.item.plan(second.ctx, want)
    assert done.plan.status is PlanStatus.IN_SYNC, done
    assert second.recorder.writes == []


@pytest.mark.parametrize(("profile", "item"), [(p, i) for p, i in APPLICABLE if CASES[i].impossible], ids=str)
def test_impossible_value_is_an_error_naming_the_range(tmp_path: Path, profile: str, item: str) -> None:
    case = CASES[item]
    node = make_node(tmp_path, profile)
    assert case.impossible is not None
    want, words = case.impossible(node.backend)
    done = case.item.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.ERROR, done
    assert done.plan.error_kind is None  # the device is fine; the config is wrong
    for text in words:
        assert text in done.plan.detail
    # Never clamped: nothing is applied for an error plan.
    assert enforce(case.item, node.ctx, want, done).outcome is ApplyOutcome.SKIPPED
    assert node.recorder.writes == []


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_no_permission_fails_apply(tmp_path: Path, profile: str, item: str) -> None:
    case = CASES[item]
    node = make_node(tmp_path, profile, privileged=False)
    want = case.drift(node.backend)
    done = case.item.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.DRIFT  # reading needs no root
    result = enforce(case.item, node.ctx, want, done)
    assert result.outcome is ApplyOutcome.FAILED
    assert "no_permission" in result.detail and "needs root" in result.detail
    assert case.item.plan(node.ctx, want).plan.status is PlanStatus.DRIFT


@pytest.mark.parametrize(("profile", "item"), [(p, i) for p in PROFILES for i in GPU_ITEMS], ids=str)
def test_gpu_lost(tmp_path: Path, profile: str, item: str) -> None:
    case = CASES[item]
    node = make_node(tmp_path, profile)
    want = case.drift(node.backend)
    before = case.item.plan(node.ctx, want)

    node.backend.set_lost(GPU)
    done = case.item.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.ERROR
    assert done.plan.error_kind == "gpu_lost"
    assert "GPU lost" in done.plan.detail
    if before.plan.status is PlanStatus.DRIFT:
        result = enforce(case.item, node.ctx, want, before)
        assert result.outcome is ApplyOutcome.FAILED
        assert "gpu_lost" in result.detail


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_write_refused_propagates(tmp_path: Path, profile: str, item: str) -> None:
    case = CASES[item]
    node = make_node(tmp_path, profile, writable=[i for i in GPU_ITEMS if i != item])
    want = case.drift(node.backend)
    done = case.item.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.DRIFT  # observe mode still plans
    with pytest.raises(WriteRefused) as refused:
        case.item.apply(node.ctx, done.changes)
    assert refused.value.item == item
    # Through the one enforce path it is a FAILED result naming the refusal, never a write.
    result = enforce(case.item, node.ctx, want, done)
    assert result.outcome is ApplyOutcome.FAILED
    assert f"policy item '{item}' is in observe mode" in result.detail
    assert case.item.plan(node.ctx, want).plan.status is PlanStatus.DRIFT


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
@pytest.mark.parametrize(
    "kind", [GpuErrorKind.TIMEOUT, GpuErrorKind.NOT_SUPPORTED, GpuErrorKind.RESET_REQUIRED], ids=str
)
def test_getter_errors_map_to_plan_status(tmp_path: Path, profile: str, item: str, kind: GpuErrorKind) -> None:
    getters = {
        "power_limit": "power_limit_watts",
        "locked_clocks": "locked_clocks_mhz",
        "fan_curve": "temperature_celsius",
        "persistence": "persistence_enabled",
        "ecc": "ecc_mode",
    }
    case = CASES[item]
    node = make_node(tmp_path, profile)
    want = case.drift(node.backend)
    node.backend.fail_call(GPU, getters[item], kind)
    done = case.item.plan(node.ctx, want)
    if kind is GpuErrorKind.NOT_SUPPORTED:
        assert done.plan.status is PlanStatus.NOT_APPLICABLE
        assert done.plan.error_kind is None
        assert node.ctx.identity.name in done.plan.detail
    else:
        assert done.plan.status is PlanStatus.ERROR
        assert done.plan.error_kind == kind.value
        assert ERROR_LABELS[kind] in done.plan.detail


# -- fans ------------------------------------------------------------------------------------------


def test_fan_curve_not_applicable_on_fanless_h200(tmp_path: Path) -> None:
    node = make_node(tmp_path, "h200")
    want = CURVE
    done = fan_curve.ITEM.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.NOT_APPLICABLE
    assert done.plan.in_sync
    assert done.plan.detail == "NVIDIA H200 (GPU 0) has no fans: no fan curve to enforce"
    assert enforce(fan_curve.ITEM, node.ctx, want, done).outcome is ApplyOutcome.UNCHANGED  # as `apply` reports it
    restored = fan_curve.ITEM.restore(node.ctx)
    assert restored.outcome is ApplyOutcome.SKIPPED
    assert node.recorder.writes == []


def _fans(backend: GpuBackend) -> list[tuple[bool, int]]:
    return [(backend.fan_manual(GPU, f), backend.fan_speed_percent(GPU, f)) for f in range(backend.fan_count(GPU))]


def test_fan_curve_interpolates_and_sets_every_fan(tmp_path: Path) -> None:
    node = make_node(tmp_path, "rtx-pro-6000")
    want = CURVE
    node.backend.set_temperature(GPU, 40)
    done = fan_curve.ITEM.plan(node.ctx, want)
    # 30 + (65 - 30) * 10 / 20 = 47.5 -> 48
    assert done.plan.desired == "48% (40 C on the curve)"
    assert done.plan.changes == (
        "set fan 0 of GPU 0 to 48% (40 C on the curve)",
        "set fan 1 of GPU 0 to 48% (40 C on the curve)",
    )
    assert "automatic" in done.plan.actual
    assert enforce(fan_curve.ITEM, node.ctx, want, done).outcome is ApplyOutcome.APPLIED
    assert _fans(node.backend) == [(True, 48), (True, 48)]

    for celsius, percent in ((10, 30), (30, 30), (75, 100), (110, 100)):
        node.ctx.item_state.clear()  # each a first reading: no hysteresis memory
        node.backend.set_temperature(GPU, celsius)
        assert fan_curve.ITEM.plan(node.ctx, want).plan.desired == f"{percent}% ({celsius} C on the curve)"


def test_fan_speed_tolerance_and_automatic_fan_is_drift(tmp_path: Path) -> None:
    node = make_node(tmp_path, "rtx-pro-6000")
    want = CURVE
    node.backend.set_temperature(GPU, 50)
    enforce(fan_curve.ITEM, node.ctx, want, fan_curve.ITEM.plan(node.ctx, want))
    node.backend.set_fan_speed_percent(GPU, 1, 67)  # 2 points off: in sync
    assert fan_curve.ITEM.plan(node.ctx, want).plan.status is PlanStatus.IN_SYNC
    node.backend.set_fan_speed_percent(GPU, 1, 68)  # 3 points off: drift, for that fan only
    assert fan_curve.ITEM.plan(node.ctx, want).plan.changes == ("set fan 1 of GPU 0 to 65% (50 C on the curve)",)

    # Automatic is drift whatever its speed: at 25 C the board's own curve also gives 30%, but
    # nothing would hold the fan there once the GPU warms.
    node.ctx.item_state.clear()
    node.backend.set_temperature(GPU, 25)
    enforce(fan_curve.ITEM, node.ctx, want, fan_curve.ITEM.plan(node.ctx, want))
    node.backend.set_fan_automatic(GPU, 0)
    assert _fans(node.backend) == [(False, 30), (True, 30)]
    done = fan_curve.ITEM.plan(node.ctx, want)
    assert done.plan.changes == ("set fan 0 of GPU 0 to 30% (25 C on the curve)",)
    assert done.plan.actual == "fan 0 30% automatic, fan 1 30% manual"


def test_fan_curve_hysteresis_sequence(tmp_path: Path) -> None:
    """What the daemon does every loop: plan against the current temperature, apply on drift."""
    node = make_node(tmp_path, "rtx-pro-6000")
    want = CURVE

    def loop(celsius: int) -> tuple[int, ItemPlan]:
        node.backend.set_temperature(GPU, celsius)
        done = fan_curve.ITEM.plan(node.ctx, want)
        if done.plan.status is PlanStatus.DRIFT:
            assert enforce(fan_curve.ITEM, node.ctx, want, done).outcome is ApplyOutcome.APPLIED
        speeds = {speed for _, speed in _fans(node.backend)}
        assert len(speeds) == 1
        return speeds.pop(), done.plan

    assert loop(40)[0] == 48  # rising: follows the curve at once
    assert loop(50)[0] == 65
    speed, plan = loop(48)  # falling within the hysteresis: held
    assert speed == 65
    assert plan.status is PlanStatus.IN_SYNC
    assert plan.desired == "65% (50 C on the curve)"
    assert "holding 65% until it cools to 47 C" in plan.detail
    assert loop(49)[0] == 65  # up again, still below the point that set it: held
    assert loop(47)[0] == 60  # 3 C below 50: follows the curve, 30 + 35 * 17 / 20 = 59.75
    assert loop(45)[0] == 60  # within 3 C of 47: held
    assert loop(44)[0] == 55  # 3 C below 47: 54.5 -> 55
    assert loop(46)[0] == 58  # rising again: at once
    assert loop(20)[0] == 30  # far beyond the hysteresis: straight down to the flat start
    assert loop(90)[0] == 100

    # A changed curve (config reload) starts over instead of holding the old target.
    node.backend.set_temperature(GPU, 88)
    other = FanCurve(points=[(30, 30), (90, 80)], hysteresis_celsius=3)
    assert fan_curve.ITEM.plan(node.ctx, other).plan.desired == "78% (88 C on the curve)"


def test_fan_restore_returns_every_fan_to_automatic(tmp_path: Path) -> None:
    node = make_node(tmp_path, "rtx-pro-6000")
    want = CURVE
    enforce(fan_curve.ITEM, node.ctx, want, fan_curve.ITEM.plan(node.ctx, want))
    assert all(manual for manual, _ in _fans(node.backend))

    restored = fan_curve.ITEM.restore(node.ctx)
    assert restored.outcome is ApplyOutcome.APPLIED, restored
    assert restored.plan.changes == (
        "return fan 0 of GPU 0 to automatic control",
        "return fan 1 of GPU 0 to automatic control",
    )
    assert not any(manual for manual, _ in _fans(node.backend))
    assert "fan_curve" not in node.ctx.item_state

    node.recorder.writes.clear()
    assert fan_curve.ITEM.restore(node.ctx).outcome is ApplyOutcome.UNCHANGED
    assert node.recorder.writes == []


# -- restore (power, clocks) -----------------------------------------------------------------------


def test_power_restore_returns_to_default(tmp_path: Path, profile: str) -> None:
    node = make_node(tmp_path, profile)
    default_watts = node.backend.default_power_limit_watts(GPU)
    want = _power_drift(node.backend)
    enforce(power_limit.ITEM, node.ctx, want, power_limit.ITEM.plan(node.ctx, want))
    assert node.backend.power_limit_watts(GPU) == pytest.approx(want, abs=0.5)

    restored = power_limit.ITEM.restore(node.ctx)
    assert restored.outcome is ApplyOutcome.APPLIED
    assert restored.plan.desired == f"default {format_watts(default_watts)} W"
    gpu = GPU
    assert restored.plan.changes == (
        f"set power limit of GPU {gpu} from {format_watts(want)} W to {format_watts(default_watts)} W"
        f" (nvidia-smi -i {gpu} -pl {format_watts(default_watts)})",
    )
    assert node.backend.power_limit_watts(GPU) == pytest.approx(default_watts, abs=0.5)

    node.recorder.writes.clear()
    assert power_limit.ITEM.restore(node.ctx).outcome is ApplyOutcome.UNCHANGED
    assert node.recorder.writes == []


def test_clock_restore_unlocks_both_domains(tmp_path: Path, profile: str) -> None:
    node = make_node(tmp_path, profile)
    want = _clocks_drift(node.backend)
    assert (
        enforce(locked_clocks.ITEM, node.ctx, want, locked_clocks.ITEM.plan(node.ctx, want)).outcome
        is ApplyOutcome.APPLIED
    )
    assert node.backend.locked_clocks_mhz(GPU, ClockDomain.GRAPHICS) == want.gpu_mhz

    restored = locked_clocks.ITEM.restore(node.ctx)
    assert restored.outcome is ApplyOutcome.APPLIED
    assert restored.plan.changes == (
        "reset locked graphics clocks of GPU 0 (nvidia-smi -i 0 -rgc)",
        "reset locked memory clocks of GPU 0 (nvidia-smi -i 0 -rmc)",
    )
    assert node.backend.locked_clocks_mhz(GPU, ClockDomain.GRAPHICS) is None
    assert node.backend.locked_clocks_mhz(GPU, ClockDomain.MEMORY) is None

    node.recorder.writes.clear()
    assert locked_clocks.ITEM.restore(node.ctx).outcome is ApplyOutcome.UNCHANGED
    assert node.recorder.writes == []


@pytest.mark.parametrize("item", RESTORABLE_ITEMS, ids=lambda i: i.name)
def test_restore_in_observe_mode_reads_only_and_fails_cleanly_when_lost(
    tmp_path: Path, profile: str, item: RestorableGpuItem[Any, Any]
) -> None:
    node = make_node(tmp_path, profile, writable=())
    result = item.restore(node.ctx)  # already at defaults: no write, so no WriteRefused
    assert result.outcome in (ApplyOutcome.UNCHANGED, ApplyOutcome.SKIPPED)
    node.backend.set_lost(GPU)
    lost = item.restore(node.ctx)
    assert lost.outcome is ApplyOutcome.FAILED
    assert lost.plan.error_kind == "gpu_lost"


# -- item specifics --------------------------------------------------------------------------------


def test_power_limit_texts_and_tolerance(tmp_path: Path) -> None:
    node = make_node(tmp_path, "h200")
    done = power_limit.ITEM.plan(node.ctx, 600)
    assert (done.plan.desired, done.plan.actual) == ("600 W", "700 W")
    assert done.plan.changes == ("set power limit of GPU 0 from 700 W to 600 W (nvidia-smi -i 0 -pl 600)",)
    assert done.plan.detail == "allowed 200-700 W"
    assert power_limit.ITEM.plan(node.ctx, 699.6).plan.status is PlanStatus.IN_SYNC  # NVML's mW rounding
    assert power_limit.ITEM.plan(node.ctx, 699.4).plan.status is PlanStatus.DRIFT
    error = power_limit.ITEM.plan(node.ctx, 900)
    assert error.plan.detail == "900 W is outside this board's range 200-700 W"
    assert power_limit.ITEM.plan(node.ctx, 150).plan.status is PlanStatus.ERROR


def test_locked_clocks_texts_and_memory_errors(tmp_path: Path) -> None:
    node = make_node(tmp_path, "h200")
    done = locked_clocks.ITEM.plan(node.ctx, LockedClocks(gpu_mhz=(1500, 1500)))
    assert (done.plan.desired, done.plan.actual) == ("graphics 1500-1500 MHz", "graphics unlocked")
    assert done.plan.changes == ("lock graphics clocks of GPU 0 to 1500-1500 MHz (nvidia-smi -i 0 -lgc 1500,1500)",)

    bad_memory = locked_clocks.ITEM.plan(node.ctx, LockedClocks(memory_mhz=(2600, 3201)))
    assert bad_memory.plan.status is PlanStatus.ERROR
    assert bad_memory.plan.detail == "memory clock 2600 MHz is not supported by this board; supported: 3201, 2201 MHz"

    too_high = locked_clocks.ITEM.plan(node.ctx, LockedClocks(gpu_mhz=(1500, 2100)))
    assert too_high.plan.detail == (
        "graphics clock 2100 MHz is not supported at memory clock 3201 MHz;"
        " nearest supported: 1980 MHz (range 345-1980 MHz)"
    )

    # Only the domain that differs is written.
    want = LockedClocks(gpu_mhz=(1500, 1500), memory_mhz=(3201, 3201))
    node.backend.set_locked_clocks_mhz(GPU, ClockDomain.MEMORY, 3201, 3201)
    result = enforce(locked_clocks.ITEM, node.ctx, want, locked_clocks.ITEM.plan(node.ctx, want))
    assert result.outcome is ApplyOutcome.APPLIED
    assert [name for name, _ in node.recorder.writes] == ["set_locked_clocks_mhz"]
    assert node.recorder.writes[0][1] == (GPU, ClockDomain.GRAPHICS, 1500, 1500)


def test_persistence_texts(tmp_path: Path) -> None:
    node = make_node(tmp_path, "h200")  # on, as in the fixture
    assert persistence.ITEM.plan(node.ctx, "enabled").plan.status is PlanStatus.IN_SYNC
    done = persistence.ITEM.plan(node.ctx, "disabled")
    assert (done.plan.desired, done.plan.actual) == ("disabled", "enabled")
    assert done.plan.changes == ("disable persistence mode on GPU 0 (nvidia-smi -i 0 -pm 0)",)


def test_ecc_pending_then_reboot(tmp_path: Path, profile: str) -> None:
    node = make_node(tmp_path, profile)
    current = node.backend.ecc_mode(GPU).current
    want = _flip(current)
    verb = "enable" if want == "enabled" else "disable"
    done = ecc.ITEM.plan(node.ctx, want)
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.changes == (
        f"{verb} ECC on GPU 0 (nvidia-smi -i 0 -e {int(not current)}); takes effect after reboot",
    )

    result = enforce(ecc.ITEM, node.ctx, want, done)
    assert result.outcome is ApplyOutcome.REBOOT_REQUIRED
    pending = ecc.ITEM.plan(node.ctx, want)
    assert pending.plan.status is PlanStatus.REBOOT_REQUIRED
    assert pending.plan.detail == f"ECC {verb} pending; takes effect after reboot"
    assert pending.plan.actual == f"{_flip(not current)} (pending {want})"
    node.recorder.writes.clear()
    assert enforce(ecc.ITEM, node.ctx, want, pending).outcome is ApplyOutcome.REBOOT_REQUIRED
    assert node.recorder.writes == []  # nothing more to do until the reboot

    node.backend.reboot()
    settled = ecc.ITEM.plan(node.ctx, want)
    assert settled.plan.status is PlanStatus.IN_SYNC
    assert settled.plan.actual == want


def test_ecc_pending_opposite_of_a_correct_current_mode_is_drift(tmp_path: Path) -> None:
    node = make_node(tmp_path, "h200")  # ECC on
    node.backend.set_ecc_mode(GPU, False)  # someone ran nvidia-smi -e 0: the next reboot turns it off
    done = ecc.ITEM.plan(node.ctx, "enabled")
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.actual == "enabled (pending disabled)"
    assert done.plan.changes == ("enable ECC on GPU 0 (nvidia-smi -i 0 -e 1)",)
    result = enforce(ecc.ITEM, node.ctx, "enabled", done)
    assert result.outcome is ApplyOutcome.APPLIED  # the current mode never changes: no reboot needed
    assert ecc.ITEM.plan(node.ctx, "enabled").plan.status is PlanStatus.IN_SYNC


# -- one description, one verification ---------------------------------------------------------------


def _as_command(setter: str, args: tuple[Any, ...]) -> str:
    """A recorded setter call as the words a change's text must contain for it."""
    gpu = args[0]
    if setter == "set_power_limit_watts":
        return f"nvidia-smi -i {gpu} -pl {format_watts(args[1])}"
    if setter == "set_locked_clocks_mhz":
        flag = "-lgc" if args[1] is ClockDomain.GRAPHICS else "-lmc"
        return f"nvidia-smi -i {gpu} {flag} {args[2]},{args[3]}"
    if setter == "reset_locked_clocks":
        return f"nvidia-smi -i {gpu} {'-rgc' if args[1] is ClockDomain.GRAPHICS else '-rmc'}"
    if setter == "set_fan_speed_percent":
        return f"set fan {args[1]} of GPU {gpu} to {args[2]}%"
    if setter == "set_fan_automatic":
        return f"return fan {args[1]} of GPU {gpu} to automatic control"
    if setter == "set_persistence":
        return f"nvidia-smi -i {gpu} -pm {int(args[1])}"
    assert setter == "set_ecc_mode", setter
    return f"nvidia-smi -i {gpu} -e {int(args[1])}"


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_plan_text_and_apply_write_are_one_description(tmp_path: Path, profile: str, item: str) -> None:
    """Each line `gpu-agent plan` shows is one write `apply` makes, with the very values shown."""
    case = CASES[item]
    node = make_node(tmp_path, profile)
    done = case.item.plan(node.ctx, case.drift(node.backend))
    assert done.plan.changes == tuple(change.text for change in done.changes) != ()
    case.item.apply(node.ctx, done.changes)
    assert len(node.recorder.writes) == len(done.changes)
    for text, (setter, args) in zip(done.plan.changes, node.recorder.writes):
        assert _as_command(setter, args) in text

    if isinstance(case.item, RestorableGpuItem):
        node.recorder.writes.clear()
        restored = case.item.restore(node.ctx)
        assert restored.outcome is ApplyOutcome.APPLIED, restored
        assert len(node.recorder.writes) == len(restored.plan.changes)
        for text, (setter, args) in zip(restored.plan.changes, node.recorder.writes):
            assert _as_command(setter, args) in text


def test_a_plan_whose_text_differs_from_its_changes_is_refused() -> None:
    change = power_limit.SetPowerLimit(GPU, 700, 600)
    shown = ItemPlan("power_limit", GPU, PlanStatus.DRIFT, "600 W", "700 W", changes=("set power limit to 500 W",))
    with pytest.raises(ValueError, match="plan shows"):
        Planned(shown, (change,))
    assert planned(shown, [change]).plan.changes == (change.text,)


class CountingBackend:
    """The simulated backend, counting every call by name."""

    def __init__(self, inner: SimulatedBackend) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)

        def count(*args: Any) -> Any:
            self.calls[name] += 1
            return attr(*args)

        return count if callable(attr) else attr

    def reads(self) -> int:
        """GPU reads the policy made, leaving out enumeration and the writes themselves."""
        return sum(n for name, n in self.calls.items() if name not in {*SETTER_ITEMS, "device_count", "identity"})


PROFILE_FIELDS = {"power_limit": "power_limit_watts"}


@pytest.mark.parametrize(("profile", "item"), APPLICABLE, ids=ids)
def test_apply_verifies_exactly_once(tmp_path: Path, profile: str, item: str) -> None:
    """apply = one plan, the writes it lists, one more plan: reading the GPU twice as often as a plan
    does, not three times (the item re-reading, then the engine re-planning)."""
    case = CASES[item]
    backend = SimulatedBackend(profile, tmp_path / "state", writable_items=GPU_ITEMS)
    backend.init()
    spy = CountingBackend(backend)
    gpu_profile = GpuProfile(match=GpuMatch(index=GPU), **{PROFILE_FIELDS.get(item, item): case.drift(backend)})
    config = AgentConfig(mode=Mode.ENFORCE, policy=PolicyConfig(gpus=[gpu_profile]))
    engine = PolicyEngine(config, spy, HostContext(HostPaths.at(tmp_path)))  # type: ignore[arg-type]

    engine.plan(only={item})
    one_plan = spy.reads()
    assert one_plan > 0
    spy.calls.clear()
    report = engine.apply(only={item})
    [result] = [r for r in report.results if r.plan.gpu == GPU]
    assert result.outcome is (ApplyOutcome.REBOOT_REQUIRED if case.settles_after_reboot else ApplyOutcome.APPLIED), (
        result
    )
    assert spy.reads() == 2 * one_plan

    # Nothing left to write: nothing to verify either.
    if case.settles_after_reboot:
        backend.reboot()
    spy.calls.clear()
    again = engine.apply(only={item})
    assert [r.outcome for r in again.results if r.plan.gpu == GPU] == [ApplyOutcome.UNCHANGED]
    assert spy.reads() == one_plan
    assert not set(spy.calls) & set(SETTER_ITEMS)
