"""recommend_reboot and reboot.

recommend_reboot writes `<state_dir>/reboot-recommended` (JSON) and, when an Alertmanager is
configured, raises GpuRebootRecommended at once (it holds until the reboot or `gpu-agent ack
reboot`). reboot runs only with `remediation.allow_reboot: true`, through the host context, which
runs nothing unless `host_root` is the real `/`.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from agent.defaults import REBOOT_FLAG_NAME
from agent.policy import next_boot
from agent.policy.base import HostContext
from agent.rules.actions.alertmanager import alertmanager_urls, raise_alerts
from agent.rules.actions.base import Result, failed, gpu_of, iso, refused, success, uuid_of, xid_of
from agent.rules.actions.context import ActionContext
from agent.rules.model import Decision
from agent.rules.params import RebootParams, RecommendRebootParams

REBOOT_ALERTNAME = "GpuRebootRecommended"


def next_boot_problem(host: HostContext) -> str | None:
    """Why the kernel that boots next would not bring the GPUs back (`6.8.0-50-generic — nvidia
    580.159.04 module missing`), or None when it is ready."""
    try:
        verdict = next_boot.readiness(host)
    except next_boot.BootCheckFailed as exc:
        return f"could not be checked: {exc}"
    return None if verdict.ready else verdict.summary()


def _next_boot_problem(ctx: ActionContext) -> str | None:
    """Only where the next-boot item is checked (the nvml backend, or `next_boot: ready`)."""
    if next_boot.ITEM.desired(ctx.config.policy.node, ctx.config) is None:
        return None
    return next_boot_problem(replace(ctx.host, backend=ctx.backend))


def recommend_reboot(decision: Decision, params: RecommendRebootParams, ctx: ActionContext) -> Result:
    now = ctx.clock()
    not_ready = _next_boot_problem(ctx)
    event = decision.event
    flag = {
        "reason": params.reason or event.message,
        "rule": decision.rule,
        "event": event.kind.value,
        "gpu": gpu_of(decision),
        "uuid": uuid_of(decision),
        "xid": xid_of(event),
        "time_seconds": now,
        "time": iso(now),
        # So a reader can tell a flag written before the last boot (and so already acted on).
        "boot_id": ctx.host.paths.boot_id() or None,
        # A reboot now would not bring the GPUs back: fix this first.
        "next_boot_not_ready": not_ready,
    }
    path = Path(ctx.config.state_dir) / REBOOT_FLAG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(flag, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    detail = f"reboot recommended: wrote {path}"
    if not_ready is not None:
        detail += f"; but the next boot is not ready: {not_ready}"
    if not alertmanager_urls(params.url, ctx):
        return success(detail)
    return success(f"{detail}; {raise_alerts(decision, [REBOOT_ALERTNAME], {}, params.url, {}, ctx)}")


def reboot(decision: Decision, params: RebootParams, ctx: ActionContext) -> Result:
    if not ctx.config.remediation.allow_reboot:
        return refused("reboot is not allowed (remediation.allow_reboot is false)")
    not_ready = _next_boot_problem(ctx)
    if not_ready is not None:
        return refused(f"the next boot is not ready: {not_ready}")
    result = ctx.host.run_command(ctx.config.remediation.reboot_command)
    if not result.ran:
        return refused(f"reboot not run: {result.output}")
    command = " ".join(result.argv)
    if result.returncode != 0:
        return failed(f"{command}: {result.ended}: {result.output}")
    return success(f"{command}: reboot started")
