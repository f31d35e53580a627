"""The profiling telemetry: GPM activity across loops, field values per tier, memory v2, NVLink and the
fabric, through the simulator and through the NVML backend over the recorded H200 answers; the
NOT_SUPPORTED paths (no GPM on the RTX PRO 6000, no NVLink on a single H200); the nvlink_errors and
fabric watchers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from nvml_replay import FIXTURE_H200_TELEMETRY, H200_PROBED, Replay, h200_telemetry, install_replay
from snapshots import h200_sample

from agent.backend.base import FabricState, GpmActivity, NvLinkErrors
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.nvml import NvmlBackend
from agent.backend.sim import SimulatedBackend
from agent.collect import sample_gpu
from agent.config import AgentConfig
from agent.events import EventKind, HealthState, SuggestedAction
from agent.snapshot import NodeWatchers, build_snapshot
from agent.state import GpuSample
from agent.watch.fabric import FABRIC_MANAGER_SERVICE, FabricWatcher
from agent.watch.nvlink import NvLinkWatcher

RECORDED = json.loads(FIXTURE_H200_TELEMETRY.read_text())
MIB = 2**20


def sim(tmp_path: Path, profile: str) -> SimulatedBackend:
    backend = SimulatedBackend(profile, tmp_path / "state")
    backend.init()
    return backend


def not_supported(call: Any) -> None:
    with pytest.raises(GpuError) as info:
        call()
    assert info.value.kind is GpuErrorKind.NOT_SUPPORTED


# -- the simulator through the collector ----------------------------------------------------------


def test_gpm_activity_is_the_difference_between_two_loops_samples(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200")
    backend.set_processes(0, [100])
    unsupported: set[str] = set()
    first = sample_gpu(backend, 0, unsupported=unsupported)
    assert first.activity_supported is True
    assert first.sm_active_ratio is None  # one sample: nothing to difference yet
    backend.advance(2.0)
    second = sample_gpu(backend, 0, slow=False, unsupported=unsupported)
    assert second.sm_active_ratio == pytest.approx(0.96)
    assert second.sm_occupancy_ratio == pytest.approx(0.14)
    assert second.tensor_active_ratio == pytest.approx(0.94)
    assert second.dram_active_ratio == pytest.approx(0.17)
    assert second.pcie_rx_bytes_per_second == pytest.approx(14346304)
    assert second.nvlink_tx_bytes_per_second == 0.0  # a single H200: nothing on NVLink
    backend.set_processes(0, [])
    backend.advance(1.0)
    idle = sample_gpu(backend, 0, slow=False, unsupported=unsupported)
    assert idle.sm_active_ratio == pytest.approx(0.0)  # the last interval only, not an average since start
    assert unsupported == {"nvlink_up", "fabric"}  # a single H200; GPM was never unsupported


def test_fast_fields_memory_v2_and_the_slow_tier_on_a_single_h200(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200")
    sample = sample_gpu(backend, 0)
    assert sample.energy_joules is not None and sample.energy_joules > 0
    assert sample.memory_temperature_celsius == RECORDED["idle"]["field_values"]["value"]["MEMORY_TEMP"]["ull"]
    assert sample.memory_max_temperature_celsius == 95
    memory = RECORDED["idle"]["memory_info_v2"]["value"]
    assert (sample.memory_used_bytes, sample.memory_reserved_bytes, sample.memory_free_bytes) == (
        memory["used"],
        memory["reserved"],
        memory["free"],
    )
    assert sample.violation_reason_ns is not None and set(sample.violation_reason_ns) >= {"sw_power_cap"}
    assert sample.pcie_correctable_errors == 0 and sample.pcie_fatal_errors == 0
    assert (sample.mig_enabled, sample.max_sm_clock_mhz, sample.applications_graphics_clock_mhz) == (False, 1980, 1980)
    # one GPU alone: NVLink and the NVSwitch fabric answer NOT_SUPPORTED and stay None
    assert (sample.nvlink_errors, sample.nvlink_up, sample.fabric_state) == (None, None, None)
    assert not sample.read_errors


def test_the_energy_counter_is_read_in_the_slow_tier_only(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200")
    assert sample_gpu(backend, 0, slow=False).energy_joules is None
    assert sample_gpu(backend, 0, slow=True).energy_joules is not None


def test_energy_grows_with_simulated_time(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200")
    before = sample_gpu(backend, 0).energy_joules
    backend.advance(10.0)
    after = sample_gpu(backend, 0).energy_joules
    assert before is not None and after is not None
    assert after - before == pytest.approx(10.0 * backend.power_usage_watts(0), rel=0.01)


class _Counting:
    """The backend with a count of gpm_activity calls."""

    def __init__(self, backend: SimulatedBackend) -> None:
        self.backend = backend
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        self.calls += 1
        return self.backend.gpm_activity(gpu)


def test_no_gpm_is_asked_once_then_remembered_and_says_not_supported(tmp_path: Path) -> None:
    backend = _Counting(sim(tmp_path, "rtx-pro-6000"))
    unsupported: set[str] = set()
    for _ in range(3):
        sample = sample_gpu(backend, 0, unsupported=unsupported)  # type: ignore[arg-type]
        assert sample.activity_supported is False
        assert sample.sm_active_ratio is None and not sample.read_errors
    assert backend.calls == 1  # never an error loop
    assert "gpm_activity" in unsupported
    assert sample.memory_temperature_celsius is None  # GDDR: no memory temperature


def test_a_failing_telemetry_call_is_a_read_error_not_a_crash(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200")
    backend.fail_call(0, "fast_fields", GpuErrorKind.UNKNOWN)
    sample = sample_gpu(backend, 0)
    assert sample.read_errors == {"fast_fields": "unknown"}
    assert sample.memory_temperature_celsius is None and sample.power_instant_watts is None
    assert sample.temperature_celsius is not None and sample.energy_joules is not None


def test_nvlink_and_fabric_on_an_hgx_node(tmp_path: Path) -> None:
    backend = sim(tmp_path, "h200x8")
    sample = sample_gpu(backend, 3)
    assert sample.nvlink_up is not None and len(sample.nvlink_up) == 18 and all(sample.nvlink_up)
    assert sample.nvlink_errors is not None and len(sample.nvlink_errors) == 18
    assert sample.fabric_state == FabricState.COMPLETED and sample.fabric_status == 0
    backend.add_nvlink_errors(3, 5, "replay", 4)
    backend.set_nvlink_up(3, 7, False)
    backend.set_fabric_state(3, FabricState.IN_PROGRESS)
    changed = sample_gpu(backend, 3)
    assert changed.nvlink_errors is not None and changed.nvlink_errors[5].counts["replay"] == 4
    assert changed.nvlink_up is not None and changed.nvlink_up[7] is False
    assert changed.fabric_state == FabricState.IN_PROGRESS


# -- the NVML backend over the recorded H200 answers ----------------------------------------------


def test_nvml_gpm_differences_against_the_previous_sample_in_two_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replay = install_replay(monkeypatch, supplement={**h200_telemetry("loaded"), **H200_PROBED})
    nvml = NvmlBackend()
    nvml.init()
    assert nvml.gpm_activity(0) is None  # the first sample
    activity = nvml.gpm_activity(0)
    metrics = RECORDED["loaded"]["gpm_metrics"]["value"]
    assert activity is not None
    assert activity.sm_active_ratio == pytest.approx(metrics["SM_ACTIVITY"][0] / 100)
    assert activity.sm_occupancy_ratio == pytest.approx(metrics["SM_OCCUPANCY"][0] / 100)
    assert activity.tensor_active_ratio == pytest.approx(metrics["TENSOR_ACTIVE"][0] / 100)
    assert activity.dram_active_ratio == pytest.approx(metrics["DRAM_BW_UTIL"][0] / 100)
    assert activity.pcie_tx_bytes_per_second == pytest.approx(metrics["PCIE_TX"][0] * MIB)
    assert activity.pcie_rx_bytes_per_second == pytest.approx(metrics["PCIE_RX"][0] * MIB)
    assert replay.count("nvmlGpmQueryDeviceSupport") == 1  # asked once per GPU
    assert nvml.gpm_activity(0) is not None
    assert replay.count("nvmlGpmSampleGet") == 3
    assert replay.count("nvmlGpmSampleAlloc") == 2  # two buffers take turns: no allocation per loop
    assert replay.gpm_samples_live == 2
    nvml.shutdown()
    assert replay.gpm_samples_live == 0


def test_nvml_without_gpm_is_not_supported(replay: Replay, backend: NvmlBackend) -> None:
    replay.answer("nvmlGpmQueryDeviceSupport", {"isSupportedDevice": 0})
    not_supported(lambda: backend.gpm_activity(0))
    assert replay.count("nvmlGpmSampleAlloc") == 0


def test_nvml_fast_fields_in_one_call_in_protocol_units(replay: Replay, backend: NvmlBackend) -> None:
    fields = backend.fast_fields(0)
    recorded = RECORDED["idle"]["field_values"]["value"]
    assert fields.power_instant_watts == recorded["POWER_INSTANT"]["ull"] / 1000
    assert fields.memory_temperature_celsius == recorded["MEMORY_TEMP"]["ull"] == 39
    assert replay.count("nvmlDeviceGetFieldValues") == 1


def test_nvml_slow_fields_without_nvlink(replay: Replay, backend: NvmlBackend) -> None:
    fields = backend.slow_fields(0)
    assert fields.energy_joules == RECORDED["idle"]["field_values"]["value"]["TOTAL_ENERGY"]["ull"] / 1000
    assert (fields.pcie_correctable_errors, fields.pcie_fatal_errors) == (0, 0)
    assert fields.violation_ns["sw_power_cap"] == 0
    assert fields.nvlink_errors is None  # nvmlDeviceGetNvLinkState(0) answered NOT_SUPPORTED
    assert replay.count("nvmlDeviceGetFieldValues") == 1
    not_supported(lambda: backend.nvlink_states(0))
    assert replay.count("nvmlDeviceGetNvLinkState") == 1  # the link count is learned once


def test_nvml_reason_durations_past_32_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    install_replay(monkeypatch, supplement={**h200_telemetry("loaded"), **H200_PROBED})
    nvml = NvmlBackend()
    nvml.init()
    recorded = RECORDED["loaded"]["field_values"]["value"]["CLOCKS_EVENT_REASON_SW_POWER_CAP"]["ull"]
    assert nvml.slow_fields(0).violation_ns["sw_power_cap"] == recorded == 6539027136
    nvml.shutdown()


def test_nvml_a_not_supported_field_is_left_out_of_later_batches(replay: Replay, backend: NvmlBackend) -> None:
    replay.answer("nvmlDeviceGetFieldValues", "ERR:NVML_ERROR_NOT_SUPPORTED", 82)
    assert backend.fast_fields(0).memory_temperature_celsius is None
    assert backend.fast_fields(0).power_instant_watts is not None
    batches = [call.args[0] for call in replay.log if call.name == "nvmlDeviceGetFieldValues"]
    assert 82 in batches[0] and 82 not in batches[1]


def test_nvml_memory_v2_and_clocks_and_fabric(replay: Replay, backend: NvmlBackend) -> None:
    memory = backend.memory_info(0)
    recorded = RECORDED["idle"]["memory_info_v2"]["value"]
    assert (memory.used_bytes, memory.reserved_bytes) == (recorded["used"], recorded["reserved"])
    assert backend.applications_clock_mhz(0, 1) == RECORDED["idle"]["app_clocks_sm"]["value"]  # type: ignore[arg-type]
    not_supported(lambda: backend.fabric_info(0))


def test_nvml_memory_falls_back_to_v1_on_an_old_driver(replay: Replay, backend: NvmlBackend) -> None:
    replay.answer("nvmlDeviceGetMemoryInfo", "ERR:NVML_ERROR_FUNCTION_NOT_FOUND", pynvml.nvmlMemory_v2)
    memory = backend.memory_info(0)
    assert memory.reserved_bytes is None and memory.used_bytes == 644939776  # v1 counts reserved as used
    backend.memory_info(0)
    versions = [call.args for call in replay.log if call.name == "nvmlDeviceGetMemoryInfo"]
    assert versions == [(pynvml.nvmlMemory_v2,), (), ()]  # v2 asked once, then v1 straight away


def test_nvml_fabric_registration_in_progress(replay: Replay, backend: NvmlBackend) -> None:
    replay.answer(
        "nvmlDeviceGetGpuFabricInfoV",
        {"state": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, "status": 0, "cliqueId": 1, "clusterUuid": "00" * 16},
    )
    fabric = backend.fabric_info(0)
    assert (fabric.state, fabric.status, fabric.clique_id) == (FabricState.IN_PROGRESS, 0, 1)


def test_nvml_processes_carry_their_names(replay: Replay, backend: NvmlBackend) -> None:
    replay.answer(
        "nvmlDeviceGetComputeRunningProcesses",
        [{"pid": 4242, "usedGpuMemory": 2**30, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}],
    )
    replay.answer("nvmlSystemGetProcessName", b"/usr/bin/python3", 4242, gpu=0)
    (process,) = backend.compute_processes(0)
    assert (process.pid, process.used_memory_bytes, process.name) == (4242, 2**30, "/usr/bin/python3")


def test_nvml_observe_mode_reads_telemetry_without_a_setter(replay: Replay, backend: NvmlBackend) -> None:
    sample_gpu(backend, 0)
    sample_gpu(backend, 0)
    assert replay.calls == []


# -- watchers --------------------------------------------------------------------------------------


def _links(*counts: dict[str, int]) -> tuple[NvLinkErrors, ...]:
    return tuple(NvLinkErrors(link, c) for link, c in enumerate(counts))


ZERO = {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}


def test_nvlink_watcher_reports_increases_not_the_baseline() -> None:
    watcher = NvLinkWatcher(hold_seconds=60)
    base = h200_sample(0, nvlink_errors=_links(ZERO, {**ZERO, "replay": 5}), nvlink_up=(True, True))
    assert watcher.observe([base], 0.0) == []
    assert watcher.health(0).state is HealthState.HEALTHY
    grown = replace(base, nvlink_errors=_links(ZERO, {**ZERO, "replay": 7, "crc_data": 1}))
    (event,) = watcher.observe([grown], 10.0)
    assert event.kind is EventKind.NVLINK_ERRORS and event.data["increase"] == {"replay": 2, "crc_data": 1}
    assert event.data["link"] == 1
    assert watcher.health(0).state is HealthState.DEGRADED
    assert watcher.observe([grown], 20.0) == []  # no new errors: no event
    assert watcher.health(0).state is HealthState.DEGRADED  # still within the hold
    watcher.observe([grown], 100.0)
    assert watcher.health(0).state is HealthState.HEALTHY


def test_nvlink_watcher_link_down_and_up() -> None:
    watcher = NvLinkWatcher()
    up = h200_sample(0, nvlink_errors=_links(ZERO, ZERO), nvlink_up=(True, True))
    watcher.observe([up], 0.0)
    (down,) = watcher.observe([replace(up, nvlink_up=(True, False))], 1.0)
    assert down.kind is EventKind.NVLINK_DOWN and down.data == {"link": 1}
    assert watcher.observe([replace(up, nvlink_up=(True, False))], 2.0) == []
    health = watcher.health(0)
    assert health.state is HealthState.DEGRADED and "link 1" in health.reason
    (back,) = watcher.observe([up], 3.0)
    assert back.kind is EventKind.NVLINK_UP and watcher.health(0).state is HealthState.HEALTHY


def test_nvlink_watcher_leaves_gpus_without_nvlink_alone() -> None:
    watcher = NvLinkWatcher()
    assert watcher.observe([h200_sample(0)], 0.0) == []
    assert watcher.health(0).state is HealthState.HEALTHY


def test_fabric_watcher_unregistered_gpu_is_unhealthy_naming_the_fabric_manager() -> None:
    watcher = FabricWatcher(sustain_loops=2)
    pending = h200_sample(0, fabric_state=int(FabricState.IN_PROGRESS), fabric_status=0)
    assert watcher.observe([pending], 0.0) == []  # registration takes a moment at boot
    (event,) = watcher.observe([pending], 1.0)
    assert event.kind is EventKind.FABRIC_UNREGISTERED and event.suggested_action is SuggestedAction.RESTART_SERVICE
    assert FABRIC_MANAGER_SERVICE in event.message and event.data["service"] == "nvidia-fabricmanager"
    health = watcher.health(0)
    assert health.state is HealthState.UNHEALTHY and "nvidia-fabricmanager" in health.reason
    (done,) = watcher.observe([replace(pending, fabric_state=int(FabricState.COMPLETED))], 2.0)
    assert done.kind is EventKind.FABRIC_REGISTERED and watcher.health(0).state is HealthState.HEALTHY


def test_fabric_completed_with_an_error_status_is_not_registered() -> None:
    watcher = FabricWatcher(sustain_loops=1)
    failed = h200_sample(0, fabric_state=int(FabricState.COMPLETED), fabric_status=pynvml.NVML_ERROR_UNKNOWN)
    (event,) = watcher.observe([failed], 0.0)
    assert event.kind is EventKind.FABRIC_UNREGISTERED and "failed" in event.message


def test_snapshot_watchers_judge_the_fabric_and_nvlink_of_a_simulated_hgx(tmp_path: Path) -> None:
    """The watchers registered where agent/snapshot.py runs them (the daemon and status --direct)."""
    backend = sim(tmp_path, "h200x8")
    backend.set_fabric_state(2, FabricState.NOT_STARTED)
    backend.set_nvlink_up(5, 0, False)
    watchers = NodeWatchers()
    events = []
    samples: list[GpuSample] = []
    for loop in range(3):
        samples = [sample_gpu(backend, gpu) for gpu in range(8)]
        events += watchers.observe(samples, float(loop))
    kinds = {(event.kind, event.gpu) for event in events}
    assert (EventKind.FABRIC_UNREGISTERED, 2) in kinds and (EventKind.NVLINK_DOWN, 5) in kinds
    snapshot = build_snapshot(AgentConfig(), 3.0, samples, watchers, driver_version=None, policy=())
    assert snapshot.health[2].state is HealthState.UNHEALTHY
    assert snapshot.health[5].state is HealthState.DEGRADED
    assert snapshot.health[0].state is HealthState.HEALTHY


# -- status ----------------------------------------------------------------------------------------


def test_status_shows_memory_as_nvidia_smi_and_an_activity_line_per_gpu() -> None:
    from snapshots import node_snapshot, telemetry_gpus

    from agent.documents import snapshot_document
    from agent.textview import status_text

    text = status_text(snapshot_document(node_snapshot(gpus=telemetry_gpus()), "daemon"))
    lines = {line.split(":")[0]: line for line in text.splitlines() if line.startswith("GPU ")}
    # the H200 under a bf16 matmul: nvidia-smi showed 1139 MiB used of 143771 MiB
    assert lines["GPU 0"] == "GPU 0: memory 1139/143771 MiB (615 MiB reserved); SM 96% tensor 94% DRAM 17%; HBM 49 C"
    assert "activity: not supported" in lines["GPU 2"]
    assert "GPU 3" not in lines  # lost: no readings
