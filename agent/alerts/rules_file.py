"""What is written from the catalogue: the Prometheus alert rules file (`python -m agent.alerts >
packaging/prometheus/gpu-agent-alerts.yaml`; `--job` and `--runbook-url` write it for a fleet whose
job or docs live elsewhere) and the alerts' runbook sections, the end of docs/alerts.md (`python -m
agent.alerts --runbooks`). tests/alerts/ fail while either differs from what is shipped."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator

from agent.alerts.catalog import CATALOGUE, INFERENCE_GROUP, NODE_GROUP, AlertSpec
from agent.alerts.expr import KEEP_FIRING, AlertExpr
from agent.names.alerts import DEFAULT_JOB, DEFAULT_RUNBOOK_URL

_WIDTH = 110
_NO_BREAK = "\x00"


def _header(job: str) -> str:
    return f"""\
# Prometheus alert rules for gpu-agent (metrics on :9481/metrics).
#
# Written from gpu-agent's alert catalogue (agent/alerts/catalog.py) by `python -m agent.alerts`; do not
# edit: the agent pushes the same alerts to Alertmanager (remediation.alertmanager_url) with the same
# names and labels, so an Alertmanager that hears both takes them for one. docs/alerts.md has each
# alert's runbook, docs/monitoring.md how to wire Prometheus, Alertmanager and Grafana to the agent.
#
# Load with `rule_files: [/usr/share/gpu-agent/prometheus/gpu-agent-*.yaml]`; check with
# `promtool check rules`. The job the agent's targets are scraped under is "{job}" (GpuAgentDown).
#
# - Every alert keeps the target's labels (instance, job, and what your fleet adds: cluster, rack...)
#   plus the fault's own (gpu and uuid, service, ...), and its severity: critical = capacity is lost or
#   will be soon (page); warning = needs attention in working hours; info = for dashboards and tickets.
# - The alerts judge by the verdicts the agent exports (gpu_agent_gpu_fault, _gpu_health, _xid_open,
#   _gpu_throttled, _remediation_failing, _reboot_recommended, ...), so they follow what the agent
#   did: a fault it fixed (a reset, a restart) resolves at the next evaluation, one still there keeps
#   firing.
# - A node whose agent is down (or restarting, or before its first loop) keeps its open alerts firing
#   for {KEEP_FIRING} from what it last said (the `last_over_time ... unless on (instance, job)
#   gpu_agent_up == 1` in each expression), while GpuAgentDown pages; `keep_firing_for` would also
#   hold the alert of a fault the agent has since fixed.
groups:
"""


def _duration(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 60}m" if whole % 60 == 0 else f"{whole}s"


def _folded(text: str, indent: int) -> str:
    """`text` wrapped for a folded block, never inside a template action."""
    pad = " " * indent
    kept = re.sub(r"\{\{.*?\}\}", lambda action: action.group(0).replace(" ", _NO_BREAK), text)
    lines = textwrap.wrap(kept, _WIDTH - indent, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)
    return "\n".join(lines).replace(_NO_BREAK, " ")


def _comment(text: str) -> str:
    return "\n".join(textwrap.wrap(text, _WIDTH - 6, initial_indent="      # ", subsequent_indent="      # "))


def expression(spec: AlertSpec, job: str = DEFAULT_JOB) -> str:
    if isinstance(spec.expr, AlertExpr):
        return spec.expr.promql()
    return spec.expr.replace(f'job="{DEFAULT_JOB}"', f'job="{job}"')


def _rule(spec: AlertSpec, job: str, runbook_url: str) -> str:
    lines = []
    if spec.comment:
        lines.append(_comment(spec.comment))
    lines.append(f"      - alert: {spec.name}")
    lines.append("        expr: |-")
    lines.extend("          " + line for line in expression(spec, job).splitlines())
    if spec.for_seconds:
        lines.append(f"        for: {_duration(spec.for_seconds)}")
    lines.append("        labels:")
    lines.append(f"          severity: {spec.severity.value}")
    lines.append("        annotations:")
    lines.append(f"          summary: {json.dumps(spec.summary)}")
    lines.append("          description: >-")
    lines.append(_folded(spec.description, 12))
    lines.append(f"          runbook_url: {json.dumps(spec.runbook_url(runbook_url))}")
    return "\n".join(lines) + "\n"


def _groups(job: str, runbook_url: str) -> Iterator[str]:
    for group in (NODE_GROUP, INFERENCE_GROUP):
        yield f"  - name: {group}\n    rules:\n"
        for spec in CATALOGUE:
            if spec.group == group:
                yield _rule(spec, job, runbook_url)


def alert_rules(job: str = DEFAULT_JOB, runbook_url: str = DEFAULT_RUNBOOK_URL) -> str:
    """The whole rules file."""
    return _header(job) + "".join(_groups(job, runbook_url))


#: Where docs/alerts.md's generated part begins: everything after this line is `runbooks()`.
RUNBOOKS_MARK = "<!-- The sections below are written by `python -m agent.alerts --runbooks`: edit the catalogue. -->"


def _placeholders(template: str) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda found: f"<{found.group(1)}>", template)


def _condition(spec: AlertSpec) -> str:
    if not isinstance(spec.expr, AlertExpr):
        first, *more = spec.expr.splitlines()
        return f"`{first}`{' ...' if more else ''}; judged by Prometheus only (about the agent itself)"
    expr = spec.expr
    found = f"`{expr.when.series.promql()} {expr.when.op} {expr.when.value:g}`"
    if expr.only_if is not None:
        found += f" where `{expr.only_if.series.promql()} {expr.only_if.op} {expr.only_if.value:g}`"
    if expr.join is not None:
        found += f", with `{expr.join.promql()}`'s {', '.join(expr.take)}"
    return found + "; judged by Prometheus and pushed by the agent"


def runbooks() -> str:
    """One section per alert, in the catalogue's order: severity, `for`, condition, what to do."""
    sections = [RUNBOOKS_MARK]
    for spec in CATALOGUE:
        waits = f"for {_duration(spec.for_seconds)}" if spec.for_seconds else "at once"
        sections.append(
            f"### {spec.name}\n\n**{spec.severity.value}**, {waits}: {_condition(spec)}.\n\n"
            f"{_placeholders(spec.description)}"
        )
    return "\n\n".join(sections) + "\n"
