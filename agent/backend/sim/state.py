"""What the simulated GPUs remember, and the file in state_dir that several processes share.

`GpuState` holds settings, counters and injected faults of one GPU (never a derived reading);
`MachineState` the GPUs plus the event queue and machine-wide faults. `StateFile` persists the
machine in `<state_dir>/simulated-gpus.json`: replaced atomically (temporary file, fsync,
rename) and changed under an flock on a side file, re-read whenever its (inode, mtime, size)
changed, so the daemon, `gpu-agent inject` and `gpu-agent plan` on one state_dir see one
machine. A corrupt file is moved aside to `.corrupt` and the machine boots from the profile;
a file written for another profile is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from agent.backend.base import (
    NVLINK_ERROR_COUNTERS,
    VIOLATION_REASONS,
    GpuBackend,
    GpuEvent,
    RecoveryAction,
    ViolationPolicy,
)
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim.profiles import GpuModel, NodeProfile

STATE_FILE_NAME = "simulated-gpus.json"
STATE_VERSION: Literal[2] = 2

#: Every callable of the GpuBackend protocol: what fail_call/hang_call may target.
PROTOCOL_METHODS = frozenset(
    name for name, value in vars(GpuBackend).items() if callable(value) and not name.startswith("_")
)

_Calls = TypeVar("_Calls", bound=Mapping[str, object])


class _State(BaseModel):
    # Strict: a state file is data we wrote, so anything that does not read back exactly is corrupt.
    model_config = ConfigDict(extra="forbid", strict=True)


class GpmCounters(_State):
    """Cumulative GPM activity, as the counters behind nvmlGpmSampleGet: two samples, differenced
    and divided by the time between them, give the activity over that interval."""

    elapsed_ns: int = 0  # simulated time the counters cover
    sm_active_seconds: float = 0.0  # ratio x seconds
    sm_occupancy_seconds: float = 0.0
    tensor_active_seconds: float = 0.0
    dram_active_seconds: float = 0.0
    graphics_active_seconds: float = 0.0
    pcie_tx_bytes: int = 0
    pcie_rx_bytes: int = 0
    nvlink_tx_bytes: int = 0
    nvlink_rx_bytes: int = 0


def _protocol_calls(calls: _Calls) -> _Calls:
    if not set(calls) <= PROTOCOL_METHODS:
        raise ValueError("not a map of protocol methods")
    return calls


#: Injected faults, by protocol method: the error to raise, the seconds to hang (per GPU or machine-wide).
FailCalls = Annotated[dict[str, GpuErrorKind], AfterValidator(_protocol_calls)]
HangCalls = Annotated[dict[str, float], AfterValidator(_protocol_calls)]

#: GpuState's counter maps by field: the keys each must have exactly, and what the error calls them.
_COUNTER_NAMES: dict[str, tuple[frozenset[str], str]] = {
    "violation_ns": (frozenset(p.name for p in ViolationPolicy), "violation"),
    "reason_ns": (frozenset(VIOLATION_REASONS), "reason"),
    "nvlink_errors": (frozenset(NVLINK_ERROR_COUNTERS), "NVLink"),
}


class GpuState(_State):
    """What one GPU remembers: settings, counters and injected faults (readings are derived)."""

    power_limit_mw: int
    locked_graphics_mhz: tuple[int, int] | None = None
    locked_memory_mhz: tuple[int, int] | None = None
    fan_manual: list[bool]
    fan_speed_percent: list[int]
    persistence: bool
    ecc_current: bool
    ecc_pending: bool
    mig_current: bool
    mig_pending: bool
    energy_mj: int
    violation_ns: dict[str, int] = Field(default_factory=lambda: {p.name: 0 for p in ViolationPolicy})
    reason_ns: dict[str, int] = Field(default_factory=lambda: dict.fromkeys(VIOLATION_REASONS, 0))
    gpm: GpmCounters = Field(default_factory=GpmCounters)
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remapped_pending: bool = False
    remapped_failed: bool = False
    retired_pages_pending: bool = False
    pcie_replays: int = 0
    pcie_correctable_errors: int = 0
    pcie_fatal_errors: int = 0
    pcie_generation: int | None = None  # None: trained at the board's maximum
    pcie_width: int | None = None
    # Per link, in link order; kept as plain lists (not a model per link): an HGX node has 144 links.
    nvlink_errors: dict[str, list[int]]
    nvlinks_down: list[int] = Field(default_factory=list)
    fabric_state: int = 3  # nvmlGpuFabricState_t: registered with the fabric manager (COMPLETED)
    fabric_status: int = 0  # nvmlReturn_t of the registration: NVML_SUCCESS
    processes: list[int] = Field(default_factory=list)
    temperature_override_c: int | None = None
    power_override_mw: int | None = None
    reasons_override: int | None = None
    lost: bool = False
    lost_reported: bool = False
    reset_required: bool = False
    recovery_action: int = 0  # RecoveryAction value the driver reports
    fail_calls: FailCalls = Field(default_factory=dict)
    hang_calls: HangCalls = Field(default_factory=dict)

    @field_validator("violation_ns", "reason_ns", "nvlink_errors")
    @classmethod
    def _every_counter(cls, counters: dict[str, object], info: ValidationInfo) -> dict[str, object]:
        names, what = _COUNTER_NAMES[info.field_name or ""]
        if set(counters) != names:
            raise ValueError(f"{what} counters differ")
        return counters

    @classmethod
    def boot(cls, model: GpuModel, nvlink_links: int) -> GpuState:
        return cls(
            power_limit_mw=model.power_limit_default_mw,
            fan_manual=[False] * model.fan_count,
            fan_speed_percent=[0] * model.fan_count,
            persistence=model.persistence_default,
            ecc_current=model.ecc_default,
            ecc_pending=model.ecc_default,
            mig_current=model.mig_default,
            mig_pending=model.mig_default,
            energy_mj=model.energy_at_boot_mj,
            nvlink_errors={c: [0] * nvlink_links for c in NVLINK_ERROR_COUNTERS},
        )

    def fits(self, model: GpuModel, nvlink_links: int) -> bool:
        """Whether this state can belong to a GPU of `model` (the shapes the model fixes)."""
        fans = model.fan_count
        links = {len(counts) for counts in self.nvlink_errors.values()}
        in_range = all(0 <= link < nvlink_links for link in self.nvlinks_down)
        return len(self.fan_manual) == len(self.fan_speed_percent) == fans and links == {nvlink_links} and in_range

    def restore_defaults(self, model: GpuModel) -> None:
        """Settings back to boot defaults, as after a GPU reset (ECC and MIG pending modes apply)."""
        self.power_limit_mw = model.power_limit_default_mw
        self.locked_graphics_mhz = None
        self.locked_memory_mhz = None
        self.fan_manual = [False] * model.fan_count
        self.fan_speed_percent = [0] * model.fan_count
        self.ecc_current = self.ecc_pending
        self.mig_current = self.mig_pending
        self.ecc_volatile_corrected = 0
        self.ecc_volatile_uncorrected = 0
        self.remapped_pending = False
        self.retired_pages_pending = False
        self.reset_required = False
        self.recovery_action = RecoveryAction.NONE


class MachineState(_State):
    gpus: list[GpuState]
    events: list[GpuEvent] = Field(default_factory=list)
    # fail/hang entries for every GPU and for library-level calls (gpu None)
    fail_calls: FailCalls = Field(default_factory=dict)
    hang_calls: HangCalls = Field(default_factory=dict)
    # With a counter clock: its reading up to which the counters have taken in the time passed.
    advanced_at_seconds: float | None = None

    @classmethod
    def boot(cls, profile: NodeProfile) -> MachineState:
        return cls(gpus=[GpuState.boot(m, profile.nvlink_links(i)) for i, m in enumerate(profile.models)])


class Fingerprint(_State):
    profile: str
    models: list[str]


class _File(MachineState):
    """The file: the machine state, its format version and the profile it belongs to."""

    version: Literal[2]
    machine: Fingerprint


class StateFile:
    """The machine state of one profile in `<state_dir>/simulated-gpus.json`, shared between processes.

    Not thread-safe by itself: the backend serialises calls under its own lock.
    """

    def __init__(self, profile: NodeProfile, state_dir: Path) -> None:
        self.profile = profile
        self.state_dir = state_dir
        self.path = state_dir / STATE_FILE_NAME
        self.fingerprint = Fingerprint(profile=profile.name, models=[m.name for m in profile.models])
        self.state = MachineState.boot(profile)
        self._holding_lock = False
        self._loaded_signature: tuple[int, int, int] | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        except PermissionError:
            raise self._no_permission() from None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _no_permission(self) -> GpuError:
        """As NVML answers a user who may not open the device: this user may not read the simulated GPUs."""
        return GpuError(GpuErrorKind.NO_PERMISSION, f"the simulated GPUs in {self.path} are not readable by this user")

    def _parse(self, text: str) -> MachineState | None:
        """The state in a file, None when it was written for another profile; raises when corrupt."""
        parsed = _File.model_validate_json(text)
        if parsed.machine != self.fingerprint:
            return None
        gpus = parsed.gpus
        if len(gpus) != len(self.profile.models) or not all(
            g.fits(m, self.profile.nvlink_links(i)) for i, (g, m) in enumerate(zip(gpus, self.profile.models))
        ):
            raise ValueError("GPU state does not match the profile")
        return MachineState(**{name: getattr(parsed, name) for name in MachineState.model_fields})

    def refresh(self) -> bool:
        """Re-read the file if another process replaced it since we last read or wrote it."""
        signature = self._signature()
        if signature is None or signature == self._loaded_signature:
            return False
        try:
            parsed = self._parse(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        except PermissionError:  # not a corrupt file: never set aside
            raise self._no_permission() from None
        except (OSError, UnicodeDecodeError, ValueError, ValidationError):
            self._set_aside_corrupt(signature)
            self.state = MachineState.boot(self.profile)
            return True
        self._loaded_signature = signature
        self.state = parsed if parsed is not None else MachineState.boot(self.profile)
        return True

    def _set_aside_corrupt(self, signature: tuple[int, int, int]) -> None:
        with self.lock():
            # Another process may have replaced the bad file with a good one meanwhile.
            if self._signature() == signature:
                os.replace(self.path, self.path.with_name(STATE_FILE_NAME + ".corrupt"))
        self._loaded_signature = None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Serialise read-modify-write of the file between processes (flock on a side file)."""
        if self._holding_lock:
            yield
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / (STATE_FILE_NAME + ".lock"), "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self._holding_lock = True
            try:
                yield
            finally:
                self._holding_lock = False
                fcntl.flock(handle, fcntl.LOCK_UN)

    def save(self) -> None:
        """Write the state atomically: a reader sees the old file or the new one, never a torn one."""
        state = self.state
        fields = {name: getattr(state, name) for name in MachineState.model_fields}
        text = _File(version=STATE_VERSION, machine=self.fingerprint, **fields).model_dump_json(indent=1)
        tmp = self.state_dir / f".{STATE_FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        self._loaded_signature = self._signature()
