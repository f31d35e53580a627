"""The GPU and the host as policy items see them (`GpuContext`, `HostContext`), and how a GPU error
reads to an operator. What every item produces, a plan (desired vs actual) and, when enforced, a
result, is `agent.policy.plan`.

The item contract itself (plan, apply, restore) is `agent.policy.item`. `plan` only reads;
`apply` is the only code that writes, and the engine calls it only for items in enforce mode
whose plan says DRIFT.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, GpuErrorKind
from agent.host.paths import HostPaths
from agent.host.processes import run_process

#: Operator wording for each error kind; the kind's value follows it in brackets for grepping.
ERROR_LABELS: dict[GpuErrorKind, str] = {
    GpuErrorKind.NOT_SUPPORTED: "not supported by this board",
    GpuErrorKind.NO_PERMISSION: "no permission (changing GPU settings needs root)",
    GpuErrorKind.GPU_LOST: "GPU lost (fell off the bus)",
    GpuErrorKind.RESET_REQUIRED: "GPU needs a reset",
    GpuErrorKind.TIMEOUT: "GPU call timed out",
    GpuErrorKind.IN_USE: "GPU in use",
    GpuErrorKind.INVALID_ARGUMENT: "the driver rejected the value",
    GpuErrorKind.DRIVER_NOT_LOADED: "NVIDIA driver not loaded",
    GpuErrorKind.LIBRARY_NOT_FOUND: "NVML library not found",
    GpuErrorKind.VERSION_MISMATCH: "NVML library and kernel driver differ (driver upgraded, not reloaded)",
    GpuErrorKind.UNINITIALIZED: "NVML not initialised",
    GpuErrorKind.UNKNOWN: "unknown GPU error",
}


def describe_error(exc: GpuError) -> str:
    """`GPU lost (fell off the bus) [gpu_lost]: GPU 0: GPU is lost (nvmlDeviceGetPowerUsage)`."""
    return f"{ERROR_LABELS[exc.kind]} [{exc.kind.value}]: {exc}"


@dataclass
class GpuContext:
    """One GPU as a policy item sees it. `item_state` survives between loops of the daemon."""

    backend: GpuBackend
    gpu: int
    identity: GpuIdentity
    item_state: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    ran: bool
    returncode: int | None  # None: not run, or killed at the timeout
    output: str  # its last words (agent.host.processes keeps a bounded tail)

    @property
    def ended(self) -> str:
        """How a command that ran ended: `exit 3`, or `timed out`."""
        return "timed out" if self.returncode is None else f"exit {self.returncode}"


@dataclass
class HostContext:
    """The host as node policy items see it.

    Commands with host-wide effect (rebuilding the initramfs, reloading systemd) only run when
    `host_root` is the real `/`: against a temporary tree they are planned and reported, never
    executed, so a test or the demo cannot touch the machine it runs on.
    """

    paths: HostPaths
    command_timeout_seconds: float = 600.0
    #: For node items that read the driver (report-only); the engine sets it. Setters stay behind
    #: the backend's write guard like every other write.
    backend: GpuBackend | None = None
    #: How long a plan waits for the next-boot check, which runs on a worker of its own
    #: (agent.policy.next_boot). One-shot commands wait for the answer; the daemon waits briefly:
    #: its policy step also drives the fans.
    boot_check_wait_seconds: float = 60.0

    @property
    def is_real_root(self) -> bool:
        return self.paths.root.resolve() == Path("/")

    def run_command(self, argv: Sequence[str], outside_sandbox: bool = False) -> CommandResult:
        """Run a host-wide command through agent.host.processes (scrubbed environment, its group
        killed at `command_timeout_seconds`, the tail of its output). `outside_sandbox`: when the
        agent runs as a hardened systemd service (it cannot write /boot or read the module tree),
        run the command as a transient unit of its own, `systemd-run --wait --pipe --collect`, with
        the host's full view. Raises OSError when the program cannot be executed."""
        if not self.is_real_root:
            return CommandResult(
                tuple(argv), ran=False, returncode=None, output=f"not run: host_root is {self.paths.root}"
            )
        if outside_sandbox and os.environ.get("INVOCATION_ID") and shutil.which("systemd-run"):
            argv = ["systemd-run", "--wait", "--pipe", "--collect", "--quiet", "--", *argv]
        result = run_process(argv, self.command_timeout_seconds)
        return CommandResult(result.argv, ran=True, returncode=result.returncode, output=result.output)
