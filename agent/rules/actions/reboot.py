"""recommend_reboot and reboot.

recommend_reboot writes `<state_dir>/reboot-recommended` (JSON) and raises an alert when an
Alertmanager is configured. reboot runs only with `remediation.allow_reboot: true`, through the
host context, which runs nothing unless `host_root` is the real `/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agent.rules.actions.alertmanager import alert_for
from agent.rules.actions.base import ActionError, Result, failed, gpu_of, iso, refused, success, uuid_of, xid_of
from agent.rules.actions.context import ActionContext
from agent.rules.actions.notify import alertmanager_url
from agent.rules.model import Decision
from agent.rules.params import AlertmanagerParams, RebootParams, RecommendRebootParams

REBOOT_FLAG_NAME = "reboot-recommended"
REBOOT_ALERTNAME = "GpuAgentRebootRecommended"


def _boot_id(ctx: ActionContext) -> str | None:
    try:
        return ctx.host.paths.read_text("/proc/sys/kernel/random/boot_id").strip() or None
    except OSError:
        return None


def recommend_reboot(decision: Decision, params: RecommendRebootParams, ctx: ActionContext) -> Result:
    now = ctx.clock()
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
        "boot_id": _boot_id(ctx),
    }
    path = Path(ctx.config.state_dir) / REBOOT_FLAG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(flag, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    detail = f"reboot recommended: wrote {path}"
    url = alertmanager_url(params.url, ctx)
    if url is None:
        return success(detail)
    alert = alert_for(decision, ctx.hostname, AlertmanagerParams(alertname=REBOOT_ALERTNAME))
    try:
        ctx.alerts.fire(url, alert)
    except ActionError as exc:
        return failed(f"{detail}; alert not delivered: {exc}")
    return success(f"{detail}; alert {alert.labels['alertname']} sent")


def reboot(decision: Decision, params: RebootParams, ctx: ActionContext) -> Result:
    if not ctx.config.remediation.allow_reboot:
        return refused("reboot is not allowed (remediation.allow_reboot is false)")
    result = ctx.host.run_command(ctx.config.remediation.reboot_command)
    if not result.ran:
        return refused(f"reboot not run: {result.output}")
    command = " ".join(result.argv)
    if result.returncode != 0:
        return failed(f"{command}: exit {result.returncode}: {result.output}")
    return success(f"{command}: reboot started")
