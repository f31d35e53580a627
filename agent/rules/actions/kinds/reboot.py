"""reboot: the node rebooted, only when the operator allows it and the next boot would bring the GPUs back.

Runs `remediation.reboot_command` through the host context, which runs nothing unless `host_root`
is the real `/`. A rule may use it only with `remediation.allow_reboot: true` (refused when the
rules load, and again here). Like recommend_reboot it looks at the next boot first (the `next_boot`
policy item): while the kernel that boots next would not bring the GPUs back, it is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Final

from agent.events import SuggestedAction
from agent.policy import next_boot
from agent.policy.base import HostContext
from agent.rules.actions.base import Result, failed, refused, success
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, Lane, Once
from agent.rules.model import Decision
from agent.rules.params import ActionParams


class RebootParams(ActionParams):
    # Spelled as the remedy it carries out (SuggestedAction), as a rule's `xid: {catalog_action: ...}` names it.
    kind: ClassVar[str] = SuggestedAction.REBOOT.value


def next_boot_problem(host: HostContext) -> str | None:
    """Why the kernel that boots next would not bring the GPUs back (`6.8.0-50-generic — nvidia
    580.159.04 module missing`), or None when it is ready."""
    try:
        verdict = next_boot.readiness(host)
    except next_boot.BootCheckFailed as exc:
        return f"could not be checked: {exc}"
    return None if verdict.ready else verdict.summary()


def next_boot_problem_of(ctx: ActionContext) -> str | None:
    """`next_boot_problem`, only where the next-boot item is checked (the nvml backend, or `next_boot: ready`)."""
    if next_boot.ITEM.desired(ctx.config.policy.node, ctx.config) is None:
        return None
    return next_boot_problem(replace(ctx.host, backend=ctx.backend))


def reboot(decision: Decision, params: RebootParams, ctx: ActionContext) -> Result:
    if not ctx.config.remediation.allow_reboot:
        return refused("reboot is not allowed (remediation.allow_reboot is false)")
    not_ready = next_boot_problem_of(ctx)
    if not_ready is not None:
        return refused(f"the next boot is not ready: {not_ready}")
    result = ctx.host.run_command(ctx.config.remediation.reboot_command)
    if not result.ran:
        return refused(f"reboot not run: {result.output}")
    command = " ".join(result.argv)
    if result.returncode != 0:
        return failed(f"{command}: {result.ended}: {result.output}")
    return success(f"{command}: reboot started")


ACTION: Final = ActionType(
    RebootParams,
    reboot,
    does=(
        "Runs `remediation.reboot_command` (`systemctl reboot` by default); refused while the kernel that boots next "
        "would not bring the GPUs back."
    ),
    changes_node=True,
    lane=Lane.NODE,
    once=Once.PER_NODE,
    needs_allow_reboot=True,
)
