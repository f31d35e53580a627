"""recommend_reboot: `<state_dir>/reboot-recommended` written (JSON), and GpuRebootRecommended raised.

The flag says why, for which rule, event and GPU, on which boot, and whether the kernel that boots
next would bring the GPUs back (as reboot checks it). When an Alertmanager is configured it raises
GpuRebootRecommended at once, held until the reboot or `gpu-agent ack reboot`, and the alert of the fault it
recommends the reboot for (GpuLost for a lost GPU) at once too, before it: the shipped inhibitions hold
the recommendation back while that fault's alert fires, and Alertmanager can only do so if the fault's alert
arrives no later than the recommendation (GpuLost's own `for` is a minute, the recommendation has none, and
Alertmanager's group_wait would ticket the recommendation alone). Nothing on the node changes: it runs in
observe mode too, one per node in an evaluation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar, Final

from pydantic import field_validator

from agent.defaults import REBOOT_FLAG_NAME
from agent.events import iso_utc
from agent.rules.actions.base import Result, gpu_of, success, uuid_of, xid_of
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, Lane, Once
from agent.rules.actions.kinds.reboot import next_boot_problem_of
from agent.rules.actions.raise_alert import alertmanager_urls, alerts_of, raise_alerts
from agent.rules.model import Decision
from agent.rules.params import ActionParams, http_url

REBOOT_ALERTNAME = "GpuRebootRecommended"


class RecommendRebootParams(ActionParams):
    kind: ClassVar[str] = "recommend_reboot"

    reason: str | None = None  # None: the event's message
    url: str | None = None  # an Alertmanager for GpuRebootRecommended besides remediation.alertmanager_url's

    _check_url = field_validator("url")(http_url)


def recommend_reboot(decision: Decision, params: RecommendRebootParams, ctx: ActionContext) -> Result:
    now = ctx.clock()
    not_ready = next_boot_problem_of(ctx)
    event = decision.event
    flag = {
        "reason": params.reason or event.message,
        "rule": decision.rule,
        "event": event.kind.value,
        "gpu": gpu_of(decision),
        "uuid": uuid_of(decision),
        "xid": xid_of(event),
        "time_seconds": now,
        "time": iso_utc(now),
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
    raised = []
    fault_alerts, match = alerts_of(decision)
    if fault_alerts:  # first: it inhibits the recommendation only if Alertmanager has it when that arrives
        raised.append(raise_alerts(decision, fault_alerts, match, params.url, {}, ctx))
    raised.append(raise_alerts(decision, [REBOOT_ALERTNAME], {}, params.url, {}, ctx))
    return success("; ".join((detail, *raised)))


ACTION: Final = ActionType(
    RecommendRebootParams,
    recommend_reboot,
    does=(
        f"Writes `state_dir/{REBOOT_FLAG_NAME}` (why, and whether the kernel that boots next would bring the GPUs "
        f"back) and raises `{REBOOT_ALERTNAME}` at once when an Alertmanager is set (`remediation.alertmanager_url`, "
        "and `url`), held until the reboot or `gpu-agent ack reboot`; the fault's own alert (`GpuLost` for a lost "
        "GPU) is raised at once with it, so the shipped inhibitions hold the recommendation back while it fires."
    ),
    changes_node=False,  # a flag file and an alert: nothing on the node changes
    lane=Lane.NOTIFY,
    once=Once.PER_NODE,
)
