"""One classification of GPU errors for every backend.

NVML reports failures as numeric return codes; the rest of the agent only ever sees
`GpuError` with a `GpuErrorKind`, so policy items, watchers and the CLI decide on the
kind ("not applicable", "GPU lost", ...) and never on backend-specific codes.
"""

from __future__ import annotations

from enum import Enum


class GpuErrorKind(str, Enum):
    NOT_SUPPORTED = "not_supported"  # the board has no such feature (fans on an SXM H200)
    NO_PERMISSION = "no_permission"  # setters need root
    GPU_LOST = "gpu_lost"  # fell off the bus
    RESET_REQUIRED = "reset_required"
    TIMEOUT = "timeout"  # the call did not return in time (or an event wait timed out)
    IN_USE = "in_use"
    INVALID_ARGUMENT = "invalid_argument"
    DRIVER_NOT_LOADED = "driver_not_loaded"
    LIBRARY_NOT_FOUND = "library_not_found"
    VERSION_MISMATCH = "version_mismatch"  # library and kernel module differ (driver upgraded, not reloaded)
    UNINITIALIZED = "uninitialized"
    UNKNOWN = "unknown"


#: Kinds meaning "there is no usable GPU stack on this machine": the CLI prints one line, no traceback.
NO_DRIVER_KINDS = frozenset(
    {GpuErrorKind.DRIVER_NOT_LOADED, GpuErrorKind.LIBRARY_NOT_FOUND, GpuErrorKind.VERSION_MISMATCH}
)


class GpuError(Exception):
    """A GPU call failed; `kind` says how, `gpu` which device (None for library-level calls)."""

    def __init__(self, kind: GpuErrorKind, message: str, gpu: int | None = None, call: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.gpu = gpu
        self.call = call

    def __str__(self) -> str:
        where = f"GPU {self.gpu}: " if self.gpu is not None else ""
        call = f" ({self.call})" if self.call else ""
        return f"{where}{self.args[0]}{call}"


class WriteRefused(Exception):
    """A setter was called for a policy item the agent may not change (observe mode).

    Raised by the backend itself, below the policy layer, so no code path can change a
    card's settings unless the operator put that item in enforce mode.
    """

    def __init__(self, item: str, operation: str) -> None:
        super().__init__(f"refused to {operation}: policy item '{item}' is in observe mode")
        self.item = item
        self.operation = operation
