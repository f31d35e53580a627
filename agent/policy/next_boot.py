"""Next-boot readiness (report-only): will the GPUs come back after a reboot?

Checked for the kernel that boots next (agent.host.boot): the NVIDIA module for the running
driver exists for it, is signed when Secure Boot is on, and its initramfs keeps nouveau out.
Unset in the config, it is checked whenever the backend is nvml (`policy.node.next_boot: ignore`
turns it off; `ready` turns it on for any backend). Reading a module means decompressing ~100 MB,
so a verdict is kept until /boot or the module trees change, and at most an hour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Final, Literal

from agent.backend.errors import GpuError
from agent.config import AgentConfig, NodePolicy
from agent.host.boot import NOT_MANAGED, BootReadiness, boot_signature, check_next_boot, host_tool_runner
from agent.policy.base import HostContext, ItemPlan, PlanStatus
from agent.policy.item import HostItem, Planned, planned
from agent.policy.report_only import OperatorTask, refuse

RECHECK_SECONDS = 3600.0

Ready = Literal["ready"]


class _Cache:
    """The last verdict per (host root, driver version), with the /boot signature it was read at."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str | None], tuple[tuple[float, ...], float, BootReadiness]] = {}

    def verdict(self, ctx: HostContext, driver: str | None) -> BootReadiness:
        key = (str(ctx.paths.root), driver)
        signature = boot_signature(ctx.paths)
        now = time.monotonic()
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None and cached[0] == signature and now - cached[1] < RECHECK_SECONDS:
                return cached[2]
        verdict = check_next_boot(ctx.paths, driver, host_tool_runner(ctx.paths))
        with self._lock:
            self._entries[key] = (signature, now, verdict)
        return verdict


_CACHE = _Cache()


def readiness(ctx: HostContext) -> BootReadiness:
    """The next boot's verdict for this host (cached; see the module docstring)."""
    driver = None
    if ctx.backend is not None:
        try:
            driver = ctx.backend.driver_version()
        except GpuError:
            driver = None
    return _CACHE.verdict(ctx, driver)


class NextBootItem(HostItem[Ready, OperatorTask]):
    name: Final = "next_boot"

    def desired(self, node: NodePolicy, config: AgentConfig) -> Ready | None:
        if node.next_boot == "ignore":
            return None
        if node.next_boot == "ready" or config.backend == "nvml":
            return "ready"
        return None

    def plan(self, ctx: HostContext, want: Ready) -> Planned[OperatorTask]:
        verdict = readiness(ctx)
        if not verdict.managed_here:
            return planned(ItemPlan(self.name, None, PlanStatus.NOT_APPLICABLE, want, "no local kernel", NOT_MANAGED))
        kernel = verdict.kernel.release if verdict.kernel else "?"
        notes = "; ".join(verdict.notes)
        facts = (("kernel", kernel), ("reason", "; ".join(verdict.problems)), ("summary", verdict.summary()))
        if verdict.ready:
            return planned(ItemPlan(self.name, None, PlanStatus.IN_SYNC, want, f"{kernel}: ready", notes, facts=facts))
        tasks = [OperatorTask(f"{kernel}: {problem}", "fix before rebooting") for problem in verdict.problems]
        plan = ItemPlan(self.name, None, PlanStatus.DRIFT, want, f"{kernel}: not ready", notes, facts=facts)
        return planned(plan, tasks)

    def apply(self, ctx: HostContext, changes: Sequence[OperatorTask]) -> str:
        return refuse(changes)


ITEM: Final = NextBootItem()
