"""Fault injection and the simulated world: the changes to the machine that no NVML call makes.

`FaultInjection` is the part of `SimulatedBackend` that injects faults and moves the world
(time, reboots, processes); each call is one change of the shared state file, so it reaches a
daemon running on the same state_dir. Every call first checks its arguments against the
profile (a GPU index the node lacks, retired pages on a board that remaps rows, a link width
the board cannot train to) and raises ValueError for a nonsensical injection, changing nothing.
Injection needs neither init() nor a writable item.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator
from typing import TypeVar

from agent.backend.base import (
    MAX_XID,
    NVLINK_ERROR_COUNTERS,
    FabricState,
    GpuEvent,
    GpuEventKind,
    RecoveryAction,
)
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.profiles import NodeProfile
from agent.backend.sim.state import PROTOCOL_METHODS, GpuState, MachineState

# nvmlEventType* bits
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_TYPE_BITS = {
    GpuEventKind.XID: EVENT_XID,
    GpuEventKind.SINGLE_BIT_ECC: EVENT_SINGLE_BIT_ECC,
    GpuEventKind.DOUBLE_BIT_ECC: EVENT_DOUBLE_BIT_ECC,
}
V = TypeVar("V")
MAX_TEMPERATURE_C = 255  # NVML reports an unsigned int; a GPU shuts down long before
MAX_ECC_COUNT = 2**64 - 1  # NVML counts ECC errors in an unsigned long long
#: Library-level calls: a fault on them is injected for every GPU (gpu None).
LIBRARY_METHODS = frozenset({"init", "shutdown", "driver_version", "device_count", "wait_events"})


def _count_ecc(state: GpuState, corrected: int, uncorrected: int) -> None:
    if corrected < 0 or uncorrected < 0:
        raise ValueError("ECC error counts only grow")
    if max(state.ecc_aggregate_corrected + corrected, state.ecc_aggregate_uncorrected + uncorrected) > MAX_ECC_COUNT:
        raise ValueError(f"an ECC error counter holds at most {MAX_ECC_COUNT} (NVML's unsigned long long)")
    state.ecc_volatile_corrected += corrected
    state.ecc_aggregate_corrected += corrected
    state.ecc_volatile_uncorrected += uncorrected
    state.ecc_aggregate_uncorrected += uncorrected


def _set_or_clear(calls: dict[str, V], method: str, value: V | None) -> None:
    if value is None:
        calls.pop(method, None)
    else:
        calls[method] = value


def _check_method(gpu: int | None, method: str) -> None:
    if method not in PROTOCOL_METHODS:
        raise ValueError(f"'{method}' is not a GpuBackend method (one of: {', '.join(sorted(PROTOCOL_METHODS))})")
    if gpu is not None and method in LIBRARY_METHODS:
        raise ValueError(f"{method} is a library call, not a per-GPU one: pass gpu=None")


def check_xid(xid: int) -> None:
    """ValueError for a code no driver reports, whichever path (NVML event, kernel log) it takes."""
    if not 1 <= xid <= MAX_XID:
        raise ValueError(f"Xid {xid} is not a code the driver reports (1-{MAX_XID})")


class FaultInjection(abc.ABC):
    """The simulated world's API on SimulatedBackend; the backend provides the state mutation."""

    profile: NodeProfile

    @abc.abstractmethod
    def _mutation(self) -> contextlib.AbstractContextManager[MachineState]:
        """The machine state, changed under the state file's lock and written back afterwards."""

    @abc.abstractmethod
    def _now_seconds(self) -> float:
        """The clock event timestamps come from."""

    @abc.abstractmethod
    def _advance_all(self, machine: MachineState, seconds: float) -> None:
        """`seconds` of simulated time pass for every GPU on the bus."""

    def _gpu_state(self, machine: MachineState, gpu: int) -> GpuState:
        if not 0 <= gpu < len(machine.gpus):
            raise ValueError(f"no GPU {gpu} in profile {self.profile.name} ({len(machine.gpus)} GPUs)")
        return machine.gpus[gpu]

    @contextlib.contextmanager
    def _gpu_mutation(self, gpu: int) -> Iterator[GpuState]:
        with self._mutation() as machine:
            yield self._gpu_state(machine, gpu)

    def _queue_event(self, machine: MachineState, gpu: int, kind: GpuEventKind, data: int) -> None:
        self._gpu_state(machine, gpu)
        model = self.profile.models[gpu]
        if not model.supported_event_types & EVENT_TYPE_BITS[kind]:
            raise ValueError(f"{model.name} does not report {kind.value} events")
        machine.events.append(GpuEvent(gpu=gpu, kind=kind, data=data, timestamp_seconds=self._now_seconds()))

    def _nvlink(self, gpu: int, link: int) -> int:
        links = self.profile.nvlink_links(gpu)
        if not links:
            raise ValueError(f"GPU {gpu} has no NVLink in profile {self.profile.name}")
        if not 0 <= link < links:
            raise ValueError(f"no NVLink {link} on GPU {gpu} (links 0-{links - 1})")
        return link

    # -- events and counters ----------------------------------------------------------------

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Queue an Xid; wait_events delivers it as GpuEvent(kind=XID, data=xid)."""
        check_xid(xid)
        with self._mutation() as machine:
            self._queue_event(machine, gpu, GpuEventKind.XID, xid)

    def inject_ecc_event(self, gpu: int, uncorrected: bool) -> None:
        """Queue a single-bit (corrected) or double-bit (uncorrected) ECC event and count the error."""
        kind = GpuEventKind.DOUBLE_BIT_ECC if uncorrected else GpuEventKind.SINGLE_BIT_ECC
        with self._mutation() as machine:
            self._queue_event(machine, gpu, kind, 0)
            _count_ecc(machine.gpus[gpu], corrected=int(not uncorrected), uncorrected=int(uncorrected))

    def add_ecc_errors(self, gpu: int, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors (volatile and aggregate) without an event."""
        if corrected < 0 or uncorrected < 0:
            raise ValueError("ECC error counters only grow: give a count of 0 or more")
        with self._gpu_mutation(gpu) as state:
            _count_ecc(state, corrected, uncorrected)

    def set_remapped_rows(
        self, gpu: int, correctable: int = 0, uncorrectable: int = 0, pending: bool = False, failed: bool = False
    ) -> None:
        with self._gpu_mutation(gpu) as state:
            if not self.profile.models[gpu].remapped_rows_supported:
                raise ValueError(f"{self.profile.models[gpu].name} has no row remapping")
            state.remapped_correctable = correctable
            state.remapped_uncorrectable = uncorrectable
            state.remapped_pending = pending
            state.remapped_failed = failed

    def set_retired_pages_pending(self, gpu: int, pending: bool) -> None:
        with self._gpu_mutation(gpu) as state:
            if not self.profile.models[gpu].retired_pages_supported:
                raise ValueError(f"{self.profile.models[gpu].name} has no page retirement (it remaps rows)")
            state.retired_pages_pending = pending

    def add_pcie_replays(self, gpu: int, count: int) -> None:
        self.add_pcie_errors(gpu, replays=count)

    def add_pcie_errors(self, gpu: int, correctable: int = 0, fatal: int = 0, replays: int = 0) -> None:
        """Count PCIe errors: NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS, _FATAL_ERROR, the replay counter."""
        if min(correctable, fatal, replays) < 0:
            raise ValueError("PCIe error counters only grow")
        with self._gpu_mutation(gpu) as state:
            state.pcie_correctable_errors += correctable
            state.pcie_fatal_errors += fatal
            state.pcie_replays += replays

    def add_nvlink_errors(self, gpu: int, link: int, counter: str, count: int) -> None:
        """Count NVLink errors on one link: counter crc_flit, crc_data, replay or recovery."""
        if counter not in NVLINK_ERROR_COUNTERS:
            raise ValueError(f"unknown NVLink counter '{counter}' (one of: {', '.join(NVLINK_ERROR_COUNTERS)})")
        if count < 0:
            raise ValueError("NVLink error counters only grow")
        with self._gpu_mutation(gpu) as state:
            state.nvlink_errors[counter][self._nvlink(gpu, link)] += count

    # -- conditions ---------------------------------------------------------------------------

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        """The GPU falls off the bus: every call on it raises GPU_LOST, wait_events raises it once."""
        with self._gpu_mutation(gpu) as state:
            state.lost = lost
            state.lost_reported = False

    def set_reset_required(self, gpu: int, required: bool = True) -> None:
        with self._gpu_mutation(gpu) as state:
            state.reset_required = required

    def set_recovery_action(self, gpu: int, action: RecoveryAction) -> None:
        """What the driver reports the GPU needs (Xid 154 carries the same); a reset clears it."""
        with self._gpu_mutation(gpu) as state:
            state.recovery_action = int(action)

    def set_temperature(self, gpu: int, celsius: int | None) -> None:
        """Override the GPU temperature (None: back to the derived value)."""
        if celsius is not None and not 0 <= celsius <= MAX_TEMPERATURE_C:
            raise ValueError(f"{celsius} C is not a temperature NVML reports (0-{MAX_TEMPERATURE_C}, unsigned)")
        with self._gpu_mutation(gpu) as state:
            state.temperature_override_c = celsius

    def set_power_usage(self, gpu: int, watts: float | None) -> None:
        """Override the power draw (None: back to the derived value)."""
        with self._gpu_mutation(gpu) as state:
            state.power_override_mw = None if watts is None else round(watts * 1000)

    def set_clock_event_reasons(self, gpu: int, mask: int | None) -> None:
        """Override the active clock-event reasons (None: back to the derived mask)."""
        with self._gpu_mutation(gpu) as state:
            supported = self.profile.models[gpu].supported_clock_event_reasons
            if mask is not None and mask & ~supported:
                raise ValueError(f"clock event reasons {mask:#x} outside the supported {supported:#x}")
            state.reasons_override = mask

    def set_pcie_link(self, gpu: int, generation: int, width: int) -> None:
        """The link trained down (or back): current generation and width."""
        with self._gpu_mutation(gpu) as state:
            model = self.profile.models[gpu]
            if not 1 <= generation <= model.pcie_max_generation or width not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"PCIe gen{generation} x{width} is not a link this GPU can train to")
            if width > model.pcie_max_width:
                raise ValueError(f"PCIe width x{width} exceeds the board's x{model.pcie_max_width}")
            state.pcie_generation = generation
            state.pcie_width = width

    def set_nvlink_up(self, gpu: int, link: int, up: bool) -> None:
        with self._gpu_mutation(gpu) as state:
            self._nvlink(gpu, link)
            down = set(state.nvlinks_down) - {link} if up else set(state.nvlinks_down) | {link}
            state.nvlinks_down = sorted(down)

    def set_fabric_state(self, gpu: int, state: FabricState, status: int = 0) -> None:
        """The GPU's NVSwitch fabric registration: state and the nvmlReturn_t it ended with (0: success)."""
        with self._gpu_mutation(gpu) as gpu_state:
            if not self.profile.nvswitch_fabric:
                raise ValueError(f"profile {self.profile.name} has no NVSwitch fabric")
            gpu_state.fabric_state = int(FabricState(state))
            gpu_state.fabric_status = status

    def set_processes(self, gpu: int, pids: list[int]) -> None:
        """The compute processes on the GPU; a GPU with processes is busy (draws load power, clocks up)."""
        with self._gpu_mutation(gpu) as state:
            state.processes = list(pids)

    # -- failing and hanging calls ------------------------------------------------------------

    def fail_call(self, gpu: int | None, method: str, kind: GpuErrorKind | None) -> None:
        """Make a protocol method raise GpuError(kind) on one GPU or (gpu None) on all; None clears."""
        _check_method(gpu, method)
        with self._mutation() as machine:
            owner = machine if gpu is None else self._gpu_state(machine, gpu)
            _set_or_clear(owner.fail_calls, method, None if kind is None else GpuErrorKind(kind))

    def hang_call(self, gpu: int | None, method: str, seconds: float | None) -> None:
        """Make a protocol method sleep `seconds` before answering, on one GPU or all; None clears."""
        _check_method(gpu, method)
        if seconds is not None and not 0 <= seconds < math.inf:
            raise ValueError("a hang lasts a finite number of seconds, zero or more")
        with self._mutation() as machine:
            owner = machine if gpu is None else self._gpu_state(machine, gpu)
            _set_or_clear(owner.hang_calls, method, None if seconds is None else float(seconds))

    # -- time and reboots ---------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Simulated time passes: violation and reason durations grow for the active reasons, energy
        with power, GPM counters with the activity (see agent.backend.sim.physics)."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        with self._mutation() as machine:
            self._advance_all(machine, seconds)

    def reboot(self) -> None:
        """The machine reboots: pending modes apply, settings and counters return to boot, faults
        clear; memory damage (aggregate ECC, remapped rows) survives and a pending remap applies."""
        with self._mutation() as machine:
            fresh = MachineState.boot(self.profile)
            for model, old, new in zip(self.profile.models, machine.gpus, fresh.gpus):
                new.ecc_current = new.ecc_pending = old.ecc_pending
                new.mig_current = new.mig_pending = old.mig_pending
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
