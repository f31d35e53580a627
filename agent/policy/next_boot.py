"""Next-boot readiness (report-only): will the GPUs come back after a reboot?

Checked for the kernel that boots next (agent.host.boot_readiness): the NVIDIA module for the running
driver exists for it, is signed when Secure Boot is on, and its initramfs keeps nouveau out.
Unset in the config, it is checked whenever the backend is nvml (`policy.node.next_boot: ignore`
turns it off; `ready` turns it on for any backend). Reading a module means decompressing ~100 MB,
so a verdict is kept until /boot or the module trees change, and at most an hour.

The check reads files anyone with write access to /boot may have planted, on disks that may hang:
it runs on a worker thread of its own with a deadline, never in the policy step that waits for it
(that step also drives the fans). Its failure, or its running past the wait, is this item's
reported error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Final, Literal

from agent.backend.errors import GpuError
from agent.config import AgentConfig
from agent.config.desired import NodePolicy
from agent.host.boot_readiness import NOT_MANAGED, BootReadiness, boot_signature, check_next_boot, host_tool_runner
from agent.host.paths import HostPaths
from agent.policy.base import HostContext
from agent.policy.item import HostItem, Planned, planned
from agent.policy.plan import ItemPlan, PlanStatus
from agent.policy.report_only import OperatorTask, refuse

RECHECK_SECONDS = 3600.0
#: A check still running after this long is reported as hung (a FIFO is refused at once; a hung disk
#: is not): its worker is left to finish, and no second check of that host starts until it does.
CHECK_DEADLINE_SECONDS = 120.0

Ready = Literal["ready"]
_Key = tuple[str, str | None]


class BootCheckFailed(OSError):
    """The check raised, is still running, or hung: the next_boot item's reported error."""


class _Running:
    def __init__(self, key: _Key, started: float) -> None:
        self.key = key
        self.started = started
        self.done = threading.Event()
        self.verdict: BootReadiness | None = None
        self.error: BaseException | None = None


class _Checks:
    """The next-boot check of each host root on a worker thread of its own, with a deadline.

    A caller waits for a check at most `wait_seconds` counted from that check's start: a check is
    waited for once, not again by every later plan. While it runs on, callers get the last verdict
    of the same host and driver, else `BootCheckFailed`. Verdicts are kept per (host root, driver
    version) with the /boot signature they were read at (read on the worker too: a stat can hang).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdicts: dict[_Key, tuple[tuple[float, ...], float, BootReadiness]] = {}
        self._running: dict[str, _Running] = {}

    def verdict(self, paths: HostPaths, driver: str | None, wait_seconds: float) -> BootReadiness:
        key = (str(paths.root), driver)
        with self._lock:
            running = self._running.get(key[0])
            if running is None or running.done.is_set():
                running = self._running[key[0]] = _Running(key, time.monotonic())
                threading.Thread(
                    target=self._check, args=(paths, running), name="gpu-agent-next-boot", daemon=True
                ).start()
        running.done.wait(max(0.0, running.started + wait_seconds - time.monotonic()))
        elapsed = time.monotonic() - running.started
        if running.done.is_set() and running.key == key:
            if running.verdict is not None:
                return running.verdict
            raise BootCheckFailed(f"the next-boot check failed: {running.error}")
        if not running.done.is_set() and elapsed > CHECK_DEADLINE_SECONDS:
            raise BootCheckFailed(
                f"the next-boot check has not finished in {elapsed:.0f} s (a hung disk or file under /boot "
                "or the module tree?); no new check starts until it does"
            )
        with self._lock:
            last = self._verdicts.get(key)
        if last is not None:
            return last[2]
        raise BootCheckFailed(f"the next-boot check is still running ({elapsed:.0f} s so far)")

    def _check(self, paths: HostPaths, running: _Running) -> None:
        try:
            running.verdict = self._fresh(paths, running.key)
        except Exception as exc:  # the check's own failure is its reported error, never the caller's crash
            running.error = exc
        finally:
            running.done.set()

    def _fresh(self, paths: HostPaths, key: _Key) -> BootReadiness:
        signature = boot_signature(paths)
        now = time.monotonic()
        with self._lock:
            cached = self._verdicts.get(key)
        if cached is not None and cached[0] == signature and now - cached[1] < RECHECK_SECONDS:
            return cached[2]
        verdict = check_next_boot(paths, key[1], host_tool_runner(paths))
        with self._lock:
            self._verdicts[key] = (signature, now, verdict)
        return verdict


_CHECKS = _Checks()


def readiness(ctx: HostContext) -> BootReadiness:
    """The next boot's verdict for this host (cached; see the module docstring); `BootCheckFailed`
    when the check failed, hung, or runs longer than `ctx.boot_check_wait_seconds`."""
    driver = None
    if ctx.backend is not None:
        try:
            driver = ctx.backend.driver_version()
        except GpuError:
            driver = None
    return _CHECKS.verdict(ctx.paths, driver, ctx.boot_check_wait_seconds)


def problem_cause(verdict: BootReadiness) -> str:
    """The first problem of a not-ready next boot as a bounded code (what `/metrics` labels it by;
    the problem's text, with versions and paths, stays in `status`); "none" when it is ready."""
    if verdict.ready:
        return "none"
    module, initramfs = verdict.module, verdict.initramfs
    if verdict.kernel is None:
        return "no_kernel"
    if module is None:
        return "module_missing"
    if verdict.driver_version is not None and module.version not in (None, verdict.driver_version):
        return "module_version"
    if verdict.secure_boot and module.version is not None and not module.signed:
        return "module_unsigned"
    if initramfs is not None and initramfs.verdict == "missing":
        return "no_initramfs"
    return "initramfs_nouveau"


class NextBootItem(HostItem[Ready, OperatorTask]):
    name: Final = "next_boot"

    def desired(self, node: NodePolicy, config: AgentConfig) -> Ready | None:
        if node.next_boot == "ignore":
            return None
        if node.next_boot == "ready" or config.backend == "nvml":
            return "ready"
        return None

    def plan(self, ctx: HostContext, want: Ready) -> Planned[OperatorTask]:
        try:
            verdict = readiness(ctx)
        except BootCheckFailed as exc:
            return planned(ItemPlan(self.name, None, PlanStatus.ERROR, want, "unknown", str(exc)))
        if not verdict.managed_here:
            return planned(ItemPlan(self.name, None, PlanStatus.NOT_APPLICABLE, want, "no local kernel", NOT_MANAGED))
        kernel = verdict.kernel.release if verdict.kernel else "?"
        notes = "; ".join(verdict.notes)
        facts = (
            ("kernel", kernel),
            ("reason", "; ".join(verdict.problems)),
            ("cause", problem_cause(verdict)),
            ("summary", verdict.summary()),
        )
        if verdict.ready:
            return planned(ItemPlan(self.name, None, PlanStatus.IN_SYNC, want, f"{kernel}: ready", notes, facts=facts))
        tasks = [OperatorTask(f"{kernel}: {problem}", "fix before rebooting") for problem in verdict.problems]
        plan = ItemPlan(self.name, None, PlanStatus.DRIFT, want, f"{kernel}: not ready", notes, facts=facts)
        return planned(plan, tasks)

    def apply(self, ctx: HostContext, changes: Sequence[OperatorTask]) -> str:
        return refuse(changes)


ITEM: Final = NextBootItem()
