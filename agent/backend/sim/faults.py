"""Fault injection and the simulated world: changes to a `MachineState` that no NVML call makes.

Each function checks its arguments against the profile first (a GPU index the node lacks,
retired pages on a board that remaps rows, a link width the board cannot train to) and raises
ValueError for a nonsensical injection; the backend wraps each in one state-file mutation.
"""

from __future__ import annotations

from agent.backend.base import GpuEvent, GpuEventKind
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.profiles import NodeProfile
from agent.backend.sim.state import NVLINK_COUNTERS, PROTOCOL_METHODS, GpuState, MachineState

# nvmlEventType* bits
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_TYPE_BITS = {
    GpuEventKind.XID: EVENT_XID,
    GpuEventKind.SINGLE_BIT_ECC: EVENT_SINGLE_BIT_ECC,
    GpuEventKind.DOUBLE_BIT_ECC: EVENT_DOUBLE_BIT_ECC,
}
#: Library-level calls: a fault on them is injected for every GPU (gpu None).
LIBRARY_METHODS = frozenset({"init", "shutdown", "driver_version", "device_count", "wait_events"})


def gpu_state(machine: MachineState, profile: NodeProfile, gpu: int) -> GpuState:
    if not 0 <= gpu < len(machine.gpus):
        raise ValueError(f"no GPU {gpu} in profile {profile.name} ({len(machine.gpus)} GPUs)")
    return machine.gpus[gpu]


def queue_event(
    machine: MachineState, profile: NodeProfile, gpu: int, kind: GpuEventKind, data: int, now_seconds: float
) -> None:
    gpu_state(machine, profile, gpu)
    model = profile.models[gpu]
    if not model.supported_event_types & EVENT_TYPE_BITS[kind]:
        raise ValueError(f"{model.name} does not report {kind.value} events")
    machine.events.append(GpuEvent(gpu=gpu, kind=kind, data=data, timestamp_seconds=now_seconds))


def count_ecc(state: GpuState, corrected: int, uncorrected: int) -> None:
    if corrected < 0 or uncorrected < 0:
        raise ValueError("ECC error counts only grow")
    state.ecc_volatile_corrected += corrected
    state.ecc_aggregate_corrected += corrected
    state.ecc_volatile_uncorrected += uncorrected
    state.ecc_aggregate_uncorrected += uncorrected


def set_clock_event_reasons(state: GpuState, profile: NodeProfile, gpu: int, mask: int | None) -> None:
    supported = profile.models[gpu].supported_clock_event_reasons
    if mask is not None and mask & ~supported:
        raise ValueError(f"clock event reasons {mask:#x} outside the supported {supported:#x}")
    state.reasons_override = mask


def set_remapped_rows(
    state: GpuState, profile: NodeProfile, gpu: int, correctable: int, uncorrectable: int, pending: bool, failed: bool
) -> None:
    if not profile.models[gpu].remapped_rows_supported:
        raise ValueError(f"{profile.models[gpu].name} has no row remapping")
    state.remapped_correctable = correctable
    state.remapped_uncorrectable = uncorrectable
    state.remapped_pending = pending
    state.remapped_failed = failed


def set_retired_pages_pending(state: GpuState, profile: NodeProfile, gpu: int, pending: bool) -> None:
    if not profile.models[gpu].retired_pages_supported:
        raise ValueError(f"{profile.models[gpu].name} has no page retirement (it remaps rows)")
    state.retired_pages_pending = pending


def set_pcie_link(state: GpuState, profile: NodeProfile, gpu: int, generation: int, width: int) -> None:
    model = profile.models[gpu]
    if not 1 <= generation <= model.pcie_max_generation or width not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"PCIe gen{generation} x{width} is not a link this GPU can train to")
    if width > model.pcie_max_width:
        raise ValueError(f"PCIe width x{width} exceeds the board's x{model.pcie_max_width}")
    state.pcie_generation = generation
    state.pcie_width = width


def add_pcie_errors(state: GpuState, replays: int = 0, correctable: int = 0, fatal: int = 0) -> None:
    if min(replays, correctable, fatal) < 0:
        raise ValueError("PCIe error counters only grow")
    state.pcie_replays += replays
    state.pcie_correctable_errors += correctable
    state.pcie_fatal_errors += fatal


def nvlink(profile: NodeProfile, gpu: int, link: int) -> int:
    """The link index checked against what the GPU has in this node."""
    links = profile.nvlink_links(gpu)
    if not links:
        raise ValueError(f"GPU {gpu} has no NVLink in profile {profile.name}")
    if not 0 <= link < links:
        raise ValueError(f"no NVLink {link} on GPU {gpu} (links 0-{links - 1})")
    return link


def add_nvlink_errors(state: GpuState, profile: NodeProfile, gpu: int, link: int, counter: str, count: int) -> None:
    if counter not in NVLINK_COUNTERS:
        raise ValueError(f"unknown NVLink counter '{counter}' (one of: {', '.join(NVLINK_COUNTERS)})")
    if count < 0:
        raise ValueError("NVLink error counters only grow")
    state.nvlinks[nvlink(profile, gpu, link)].errors[counter] += count


def set_nvlink_up(state: GpuState, profile: NodeProfile, gpu: int, link: int, up: bool) -> None:
    state.nvlinks[nvlink(profile, gpu, link)].up = up


def check_method(gpu: int | None, method: str) -> None:
    if method not in PROTOCOL_METHODS:
        raise ValueError(f"'{method}' is not a GpuBackend method (one of: {', '.join(sorted(PROTOCOL_METHODS))})")
    if gpu is not None and method in LIBRARY_METHODS:
        raise ValueError(f"{method} is a library call, not a per-GPU one: pass gpu=None")


def fail_call(
    machine: MachineState, profile: NodeProfile, gpu: int | None, method: str, kind: GpuErrorKind | None
) -> None:
    check_method(gpu, method)
    calls = machine.fail_calls if gpu is None else gpu_state(machine, profile, gpu).fail_calls
    if kind is None:
        calls.pop(method, None)
    else:
        calls[method] = GpuErrorKind(kind)


def hang_call(machine: MachineState, profile: NodeProfile, gpu: int | None, method: str, seconds: float | None) -> None:
    check_method(gpu, method)
    if seconds is not None and seconds < 0:
        raise ValueError("a hang lasts zero seconds or more")
    calls = machine.hang_calls if gpu is None else gpu_state(machine, profile, gpu).hang_calls
    if seconds is None:
        calls.pop(method, None)
    else:
        calls[method] = float(seconds)


def reboot(machine: MachineState, profile: NodeProfile) -> None:
    """Pending modes apply, settings and counters return to boot, faults clear; memory damage stays."""
    fresh = MachineState.boot(profile)
    for model, old, new in zip(profile.models, machine.gpus, fresh.gpus):
        new.ecc_current = new.ecc_pending = old.ecc_pending
        new.mig_current = new.mig_pending = old.mig_pending
        # Memory damage survives a reboot; a pending remap is applied by it.
        new.ecc_aggregate_corrected = old.ecc_aggregate_corrected
        new.ecc_aggregate_uncorrected = old.ecc_aggregate_uncorrected
        new.remapped_correctable = old.remapped_correctable
        new.remapped_uncorrectable = old.remapped_uncorrectable
        new.remapped_failed = old.remapped_failed
        new.energy_mj = model.energy_at_boot_mj
    machine.gpus = fresh.gpus
    machine.events = []
    machine.fail_calls = {}
    machine.hang_calls = {}
