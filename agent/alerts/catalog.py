"""The catalogue of gpu-agent's alerts: one list that the shipped Prometheus rules
(packaging/prometheus/gpu-agent-alerts.yaml, written by `python -m agent.alerts`) and the agent's own
pushes to Alertmanager (agent/daemon/alert_book.py) are both made of.

Each alert has one name, one severity from {critical, warning, info}, one condition (an `AlertExpr`
over the verdict series `/metrics` exports; the few only Prometheus can judge, about the agent
itself, as PromQL), how long the condition must hold (`for`), its text and its runbook section in
docs/alerts.md. The agent evaluates the same condition over its own samples and pushes an alert with
the same labels, so an Alertmanager that hears both takes them for one alert.

Severity: critical = capacity is lost or about to be (page); warning = needs a look in working hours;
info = for dashboards and tickets. `alert_severity` is the one mapping from an event's or the Xid
catalog's severity (`fatal` is critical).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from agent.alerts.expr import AlertExpr, Compare, CompareOp, series
from agent.events import EventKind, Severity
from agent.names.alerts import DEFAULT_JOB, DEFAULT_RUNBOOK_URL


class AlertSeverity(str, Enum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


_SEVERITY = {
    Severity.FATAL: AlertSeverity.CRITICAL,
    Severity.CRITICAL: AlertSeverity.CRITICAL,
    Severity.WARNING: AlertSeverity.WARNING,
    Severity.INFO: AlertSeverity.INFO,
}


def alert_severity(severity: Severity) -> AlertSeverity:
    """The one mapping of an event's (or the Xid catalog's) severity to an alert's: fatal pages as critical."""
    return _SEVERITY[severity]


def severities_of(alert: AlertSeverity) -> str:
    """The Xid catalog severities that map to `alert`, as a PromQL regular expression (`critical|fatal`)."""
    return "|".join(sorted(s.value for s in Severity if alert_severity(s) is alert))


#: The rule groups of the shipped file, in order: the agent and its node's GPUs, then the services.
NODE_GROUP = "gpu-agent"
INFERENCE_GROUP = "gpu-agent-inference"
#: The node problems (agent.verdict.NodeProblem) that are the node's as a whole; GPUs missing one by
#: one (gpus_missing) are GpuLost's.
NODE_PROBLEMS = ("backend_unreadable", "no_gpus")


@dataclass(frozen=True)
class AlertSpec:
    """One alert. `expr` a string: only Prometheus judges it (the agent cannot say it is dead or stuck)."""

    name: str
    severity: AlertSeverity
    expr: AlertExpr | str
    summary: str  # Prometheus template text: {{ $labels.NAME }}, {{ if $labels.NAME }}...{{ else }}...{{ end }}
    description: str
    for_seconds: float = 0.0
    group: str = NODE_GROUP
    #: Events whose rule step `alertmanager` raises this alert at once, without waiting for `for`.
    raised_by: frozenset[EventKind] = frozenset()
    comment: str = ""  # why the condition is what it is, written above the rule

    @property
    def pushed(self) -> bool:
        """The agent can judge it itself, and pushes it."""
        return isinstance(self.expr, AlertExpr)

    @property
    def anchor(self) -> str:
        """Its section in docs/alerts.md (a `### Name` heading)."""
        return self.name.lower()

    def runbook_url(self, base_url: str = DEFAULT_RUNBOOK_URL) -> str:
        return f"{base_url}#{self.anchor}"


def _when(name: str, op: CompareOp, value: float, *, drop: tuple[str, ...] = (), **where: str) -> AlertExpr:
    return AlertExpr(Compare(series(name, **where), op, value), drop=drop)


def _fault(cause: str) -> AlertExpr:
    """An open fault of a GPU (gpu_agent_gpu_fault{cause}), labels gpu and uuid."""
    return _when("gpu_agent_gpu_fault", "==", 1, drop=("cause",), cause=cause)


def _xid(severity: AlertSeverity) -> AlertExpr:
    """An Xid the agent holds open (not fixed, not acknowledged, within its health window) whose code
    the agent's Xid catalog classes as `severity`, with the catalog's action."""
    return AlertExpr(
        Compare(series("gpu_agent_xid_open"), "==", 1),
        join=series("gpu_agent_xid_catalog_info", severity="~" + severities_of(severity)),
        on=("xid",),
        take=("action",),
    )


def _drift(enforced: float) -> AlertExpr:
    return AlertExpr(
        Compare(series("gpu_agent_policy_drift", item="!~driver|vbios|next_boot"), "==", 1),
        only_if=Compare(series("gpu_agent_policy_enforced"), "==", enforced),
        on=("item",),
    )


_GPU = "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }}"
_EVENTS = "`gpu-agent events --since 1h` on the node"

_AGENT: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuAgentDown",
        AlertSeverity.CRITICAL,
        f'up{{job="{DEFAULT_JOB}"}} == 0',
        "gpu-agent on {{ $labels.instance }} cannot be scraped",
        "Prometheus has failed to scrape gpu-agent on {{ $labels.instance }} for 2 minutes: nothing on this node is "
        "watched or repaired, and its open alerts keep firing for 10 minutes from what it last said. Check "
        "`systemctl status gpu-agent` and `journalctl -u gpu-agent` on the node, and that the metrics port (9481 by "
        "default) is reachable from Prometheus. Resolves at the next successful scrape.",
        for_seconds=120,
        comment=(
            f'The job the targets are scraped under ("{DEFAULT_JOB}"; `python -m agent.alerts --job NAME` writes '
            "another). A target that service discovery dropped has no `up` series: catch that with your "
            "discovery's own target-count alert."
        ),
    ),
    AlertSpec(
        "GpuAgentNotCollecting",
        AlertSeverity.WARNING,
        "gpu_agent_up == 0 or (time() - gpu_agent_snapshot_timestamp_seconds) > 120",
        "gpu-agent on {{ $labels.instance }} serves no fresh GPU data",
        "gpu-agent on {{ $labels.instance }} answers scrapes but has not completed a collection loop in the last 2 "
        "minutes (or never since it started), so every GPU metric from it is frozen. Look for hung NVML calls in "
        "`journalctl -u gpu-agent`; `nvidia-smi` hanging too points at the driver. Resolves when a loop completes.",
        for_seconds=300,
    ),
    AlertSpec(
        "GpuAgentCollectorFailing",
        AlertSeverity.WARNING,
        _when("gpu_agent_collector_success", "==", 0),
        "gpu-agent collector {{ $labels.collector }} failing on {{ $labels.instance }}",
        "The {{ $labels.collector }} collector of gpu-agent on {{ $labels.instance }} has failed for 10 minutes; "
        "what it watches (Xids from the kernel log, service probes, policy, alert delivery, ...) is not being "
        "checked. `gpu-agent status` shows the collector's last error. Resolves at its next successful run.",
        for_seconds=600,
    ),
    AlertSpec(
        "GpuAgentRemediationFailing",
        AlertSeverity.WARNING,
        _when("gpu_agent_remediation_failing", "==", 1),
        "gpu-agent rule {{ $labels.rule }} cannot fix its fault on {{ $labels.instance }} ({{ $labels.cause }})",
        "Remediation rule {{ $labels.rule }} on {{ $labels.instance }} is {{ $labels.cause }} (failed: its last action "
        "went wrong; refused: a safety check said no; exhausted: its attempts ran out and it stopped acting), so the "
        "fault it reacted to is probably still there. "
        f"See {_EVENTS} for the reason and repair by hand. Resolves when the rule's next attempt succeeds, or "
        "with `gpu-agent ack {{ $labels.rule }}` on the node.",
        comment="The agent's state (the store's last outcome per rule and target, open circuits): an agent restart "
        "neither clears nor repeats it.",
    ),
    AlertSpec(
        "GpuAgentWouldRemediate",
        AlertSeverity.INFO,
        'increase(gpu_agent_remediations_total{outcome="dry_run"}[30m]) > 0\nor\n'
        '(gpu_agent_remediations_total{outcome="dry_run"} > 0\n'
        ' unless gpu_agent_remediations_total{outcome="dry_run"} offset 30m)',
        "gpu-agent would {{ $labels.action }} on {{ $labels.instance }} (observe mode)",
        "Rule {{ $labels.rule }} on {{ $labels.instance }} decided to {{ $labels.action }} in the last 30 minutes but "
        "only recorded it (observe mode or a dry-run rule). `gpu-agent status` on the node shows what it would have "
        "done and to what; do it by hand, or let the agent act (mode: enforce). Resolves 30 minutes after the last "
        "such decision.",
        comment="What the agent would have done in the last 30 minutes (a counter's first value counts too).",
    ),
    AlertSpec(
        "GpuAgentConfigNeedsAttention",
        AlertSeverity.WARNING,
        _when("gpu_agent_attention", ">", 0, cause="~no_rules|config"),
        "gpu-agent on {{ $labels.instance }} needs its config looked at ({{ $labels.cause }})",
        "gpu-agent on {{ $labels.instance }} has reported {{ $labels.cause }} for 10 minutes: no_rules means it runs "
        "with no remediation rules (a typo in remediation.rules_dirs, an empty rules directory), so faults are "
        "reported but never acted on; config means a reload failed or a change waits for a restart. `gpu-agent "
        "status` on the node says which, `gpu-agent check-config` checks the files. Resolves once a reload or "
        "restart applies a good config.",
        for_seconds=600,
    ),
)

_NODE: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuNodeProblem",
        AlertSeverity.CRITICAL,
        _when("gpu_agent_node_problem", "==", 1, cause="~" + "|".join(NODE_PROBLEMS)),
        "GPUs on {{ $labels.instance }} cannot be judged: {{ $labels.cause }}",
        "gpu-agent on {{ $labels.instance }} runs but cannot read its GPUs as a whole ({{ $labels.cause }}: the "
        "NVIDIA driver or NVML is unreadable, or no GPU is visible). `gpu-agent status` on the node names the "
        "cause; check `nvidia-smi`, `lsmod | grep nvidia` and the kernel log, and drain the node until it is "
        "resolved. Resolves when the agent reads its GPUs again.",
        for_seconds=120,
        comment="GPUs missing one by one are GpuLost's, one alert per GPU.",
    ),
    AlertSpec(
        "GpuLost",
        AlertSeverity.CRITICAL,
        _when("gpu_agent_gpu_up", "==", 0),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is lost",
        f"{_GPU} does not answer: it fell off the bus (Xid 79), needs a reset, or left the node. Drain the node; a GPU "
        "lost from the bus needs a reboot, and a reseat or replacement if it happens again (`gpu-agent xid explain "
        "79`). Resolves when the GPU answers again, or when `gpu-agent ack gpu:{{ $labels.uuid }}` acknowledges it "
        "gone.",
        for_seconds=60,
        raised_by=frozenset({EventKind.GPU_LOST, EventKind.GPU_REMOVED, EventKind.GPU_RESET_REQUIRED}),
    ),
    AlertSpec(
        "GpuStale",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_stale", "==", 1),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} does not answer in time",
        f"NVML calls to {_GPU} have hung or timed out for 5 minutes; its metrics are from an earlier loop. A hanging "
        "driver usually precedes a lost GPU: check `nvidia-smi -i {{ $labels.gpu }}` and the kernel log for Xids. "
        "Resolves when the GPU answers in time again.",
        for_seconds=300,
    ),
    AlertSpec(
        "GpuUnhealthy",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_health", "==", 1, drop=("state",), state="unhealthy"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is unhealthy",
        f"gpu-agent has judged {_GPU} unhealthy for 5 minutes: it should not take work until acted on. `gpu-agent "
        "status` on the node gives the reason and the suggested action; the alert of the fault itself says more. "
        "Resolves when the agent judges the GPU healthy again (the fault fixed, or acknowledged with `gpu-agent ack "
        "gpu:{{ $labels.gpu }}`).",
        for_seconds=300,
    ),
    AlertSpec(
        "GpuDegraded",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_health", "==", 1, drop=("state",), state="degraded"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is degraded",
        f"gpu-agent has judged {_GPU} degraded for 15 minutes: it works, but something needs attention (throttling, "
        "a degraded link, a pending remap, an Xid that needs a look). gpu_agent_gpu_health_info and `gpu-agent "
        "status` give the reason. Resolves when the agent judges the GPU healthy again.",
        for_seconds=900,
    ),
    AlertSpec(
        "GpuRebootRecommended",
        AlertSeverity.WARNING,
        _when("gpu_agent_reboot_recommended", "==", 1),
        "gpu-agent recommends rebooting {{ $labels.instance }}",
        "A gpu-agent rule on {{ $labels.instance }} recommends a reboot (after a {{ $labels.cause }} event; the reason "
        "is in `gpu-agent status`). Drain the node and reboot it when convenient. Resolves after the reboot, or "
        "with `gpu-agent ack reboot` on the node once it has been dealt with otherwise.",
    ),
    AlertSpec(
        "GpuRecoveryActionRequired",
        AlertSeverity.CRITICAL,
        _when("gpu_agent_gpu_recovery_action", "==", 1, action="!none"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} needs {{ $labels.action }}",
        f"The driver reports that {_GPU} needs recovery action {{{{ $labels.action }}}} (Xid 154). Drain the GPU, "
        "then reset it (gpu_reset, drain_and_reset), reboot the node (node_reboot) or stop peer-to-peer work "
        "(drain_p2p). Resolves when the driver reports no recovery action.",
        for_seconds=60,
        raised_by=frozenset({EventKind.RECOVERY_ACTION}),
    ),
)

_XID: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuXidCritical",
        AlertSeverity.CRITICAL,
        _xid(AlertSeverity.CRITICAL),
        "Critical Xid {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"The driver reported Xid {{{{ $labels.xid }}}} for {_GPU} and the GPU has not been fixed since; gpu-agent's "
        "catalog says {{ $labels.action }}. These codes need a GPU reset or a reboot (79: the GPU fell off the bus), "
        "or a hardware check. Run `gpu-agent xid explain {{ $labels.xid }}` for NVIDIA's resolution and drain the "
        "GPU. Resolves when the agent's reset of the GPU succeeds, after a reboot, or with `gpu-agent ack "
        "xid:{{ $labels.xid }}@{{ $labels.gpu }}`.",
        raised_by=frozenset({EventKind.XID}),
        comment=(
            "An Xid is open from its report until the agent fixed it (a reset that succeeded, the restart of the "
            "service whose process faulted), an operator acknowledged it, or its health window (1 h) ended. Which "
            "codes are critical comes from gpu-agent's Xid catalog (gpu_agent_xid_catalog_info): no code list is "
            "copied here."
        ),
    ),
    AlertSpec(
        "GpuXidError",
        AlertSeverity.WARNING,
        _xid(AlertSeverity.WARNING),
        "Xid {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"The driver reported Xid {{{{ $labels.xid }}}} for {_GPU}; gpu-agent's catalog says {{{{ $labels.action }}}}. "
        "Most of these are application faults that the agent answers by restarting the service whose process "
        "faulted; `gpu-agent xid explain {{ $labels.xid }}` says which. Resolves when that restart succeeds, with "
        "`gpu-agent ack xid:{{ $labels.xid }}@{{ $labels.gpu }}`, or an hour after the last report.",
        raised_by=frozenset({EventKind.XID}),
    ),
)

_THERMAL_REASONS = "hw_thermal_slowdown|sw_thermal_slowdown"

_CLOCKS: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuThermalSlowdown",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_throttled", "==", 1, drop=("reason",), reason="~" + _THERMAL_REASONS),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is thermally throttled",
        f"{_GPU} has run below its clocks for 5 minutes because it is too hot. Check cooling: inlet temperature, "
        "fans, airflow, blocked filters; a single hot GPU in a cool chassis points at its heatsink or thermal paste. "
        "Resolves when the slowdown ends.",
        for_seconds=300,
        raised_by=frozenset({EventKind.THROTTLE_STARTED}),
    ),
    AlertSpec(
        "GpuHwSlowdown",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_throttled", "==", 1, drop=("reason",), reason="hw_slowdown"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is in hardware slowdown",
        f"{_GPU} has had hardware slowdown engaged for 5 minutes (clocks halved or worse): temperature, an external "
        "power-brake signal or a power excursion. Check temperatures, power supplies and the BMC event log. "
        "Resolves when the slowdown ends.",
        for_seconds=300,
        raised_by=frozenset({EventKind.THROTTLE_STARTED}),
    ),
    AlertSpec(
        "GpuPowerBrake",
        AlertSeverity.CRITICAL,
        _when("gpu_agent_gpu_throttled", "==", 1, drop=("reason",), reason="hw_power_brake_slowdown"),
        "Power brake on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"The system asserted the power brake on {_GPU} for 1 minute: clocks are at their minimum. This is a "
        "power-delivery problem (failed or missing power supply, BMC power capping): check the PSUs and the BMC "
        "event log. Resolves when the brake is released.",
        for_seconds=60,
        raised_by=frozenset({EventKind.THROTTLE_STARTED}),
    ),
    AlertSpec(
        "GpuTemperatureHigh",
        AlertSeverity.WARNING,
        _fault("temperature_margin"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is near its slowdown temperature",
        f"{_GPU} has been within 5 C of its slowdown threshold for 10 minutes; throttling is next. Check cooling "
        "before it starts (`gpu-agent status` shows the temperature and the threshold). Resolves 2 C below that line.",
        for_seconds=600,
        raised_by=frozenset({EventKind.TEMPERATURE_MARGIN_LOW}),
    ),
)

_MEMORY: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuUncorrectableEcc",
        AlertSeverity.CRITICAL,
        _fault("ecc_uncorrected"),
        "Uncorrectable ECC errors on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"{_GPU} counted uncorrectable ECC errors since its last reset; work on it may have read corrupt memory. "
        "Drain it and reset it so the affected row is remapped; if remapping fails or errors recur, replace the "
        "GPU. Resolves when a GPU reset (the agent's or yours) or a reboot clears the count.",
        raised_by=frozenset({EventKind.ECC_UNCORRECTED}),
        comment="Open until the volatile count is cleared by a reset: the fault is there until then.",
    ),
    AlertSpec(
        "GpuRowRemapFailed",
        AlertSeverity.CRITICAL,
        _fault("row_remap_failed"),
        "Row remapping failed on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"{_GPU} could not remap a failing memory row (no spare rows left, Xid 64). Take the GPU out of service and "
        "have it replaced (RMA). Resolves only when the board no longer reports it (a replaced board).",
        raised_by=frozenset({EventKind.ROW_REMAP_FAILED}),
    ),
    AlertSpec(
        "GpuRowRemapPending",
        AlertSeverity.WARNING,
        _fault("row_remap_pending"),
        "Row remap pending on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"{_GPU} has a memory row remap waiting for a GPU reset. Drain the GPU and reset it (`nvidia-smi -r -i "
        "{{ $labels.gpu }}`) or reboot the node when convenient; until then the bad row stays in use. Resolves at "
        "the reset.",
        for_seconds=300,
        raised_by=frozenset({EventKind.ROW_REMAP_PENDING}),
    ),
)

_LINKS: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuPcieDegraded",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_pcie_degraded", "==", 1),
        "PCIe link of GPU {{ $labels.gpu }} on {{ $labels.instance }} is degraded",
        f"The PCIe link of {_GPU} has run below its maximum generation or width for 10 minutes while in use, "
        "slowing host-device transfers (model loading, KV offload). Reseat the GPU or riser and check the slot. "
        "Resolves when the link trains back up.",
        for_seconds=600,
        raised_by=frozenset({EventKind.PCIE_DEGRADED}),
        comment="The agent's verdict: an idle GPU trains its link down to save power, and that is not degradation.",
    ),
    AlertSpec(
        "GpuNvlinkErrors",
        AlertSeverity.WARNING,
        _fault("nvlink_errors"),
        "NVLink errors on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
        f"{_GPU} counted NVLink data CRC, replay or recovery errors in the last 10 minutes. Collectives over a "
        "marginal link slow down or fail; see gpu_agent_gpu_nvlink_link_errors_total for the links with errors, "
        "`nvidia-smi nvlink -e -i {{ $labels.gpu }}`, and reset the GPU or reseat the baseboard if they keep "
        "growing. Resolves 10 minutes after the last new error.",
        raised_by=frozenset({EventKind.NVLINK_ERRORS}),
    ),
    AlertSpec(
        "GpuNvlinkDown",
        AlertSeverity.WARNING,
        _when("gpu_agent_gpu_nvlink_up", "==", 0),
        "NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} on {{ $labels.instance }} is down",
        f"NVLink link {{{{ $labels.link }}}} of {_GPU} has been down for 5 minutes: traffic to its peer takes a "
        "slower path or collectives hang. Drain the node and reset the GPU (`nvidia-smi -r -i {{ $labels.gpu }}`); "
        "a link that stays down needs a hardware check. Resolves when the link is up again.",
        for_seconds=300,
        raised_by=frozenset({EventKind.NVLINK_DOWN}),
    ),
    AlertSpec(
        "GpuFabricNotRegistered",
        AlertSeverity.CRITICAL,
        _fault("fabric"),
        "GPU {{ $labels.gpu }} on {{ $labels.instance }} is not registered with the NVSwitch fabric",
        f"{_GPU} has not completed its NVSwitch fabric registration for 5 minutes: CUDA cannot run on it. Check the "
        "fabric manager: `systemctl status nvidia-fabricmanager` and its log, restart it (`systemctl restart "
        "nvidia-fabricmanager`). Resolves when the registration completes.",
        for_seconds=300,
        raised_by=frozenset({EventKind.FABRIC_UNREGISTERED}),
    ),
)

_POLICY: tuple[AlertSpec, ...] = (
    AlertSpec(
        "GpuPolicyDrift",
        AlertSeverity.WARNING,
        _drift(1),
        "Policy item {{ $labels.item }} out of sync on {{ $labels.instance }}",
        'Policy item {{ $labels.item }} (GPU "{{ $labels.gpu }}", empty for the node) on {{ $labels.instance }} has '
        "been off its declared state for 15 minutes although the agent enforces it: something keeps changing it, or "
        f"the agent cannot apply it. Run `gpu-agent plan` on the node and see {_EVENTS}. Resolves when the item is in "
        "sync again.",
        for_seconds=900,
        raised_by=frozenset({EventKind.POLICY_DRIFT}),
        comment=(
            "Real drift of an enforced item: not a setting waiting for a reboot, not the items of a lost GPU "
            "(GpuLost says that), not the report-only driver, vbios and next_boot, not a setting a running job "
            "drives (a gpu-agent tune sweep: policy status `held`; a hold that outlives its job is drift again, "
            "and fires)."
        ),
    ),
    AlertSpec(
        "GpuPolicyDriftObserved",
        AlertSeverity.INFO,
        _drift(0),
        "Policy item {{ $labels.item }} drifted on {{ $labels.instance }} (observe mode)",
        'Policy item {{ $labels.item }} (GPU "{{ $labels.gpu }}", empty for the node) on {{ $labels.instance }} is off '
        "its declared state; the item is in observe mode, so the agent only reports it. `gpu-agent plan` shows the "
        "change, `gpu-agent apply` makes it. Resolves when the item is in sync again.",
        for_seconds=900,
    ),
    AlertSpec(
        "GpuNextBootNotReady",
        AlertSeverity.WARNING,
        _when("gpu_agent_boot_ready", "==", 0),
        "{{ $labels.instance }} would not bring its GPUs back after a reboot",
        "The kernel that boots next on {{ $labels.instance }} is not ready ({{ $labels.cause }}; `gpu-agent plan` "
        "names the kernel and what is missing). Fix it before the node reboots (rebuild the DKMS module, sign it for "
        "Secure Boot, rebuild the initramfs); gpu-agent refuses its own reboot action meanwhile. Resolves when the "
        "next boot is ready.",
        for_seconds=600,
    ),
    AlertSpec(
        "GpuNodeNotAsDeclared",
        AlertSeverity.WARNING,
        _when("gpu_agent_policy_drift", "==", 1, item="~driver|vbios"),
        "{{ $labels.item }} on {{ $labels.instance }} is not the declared one",
        'The {{ $labels.item }} of {{ $labels.instance }} (GPU "{{ $labels.gpu }}", empty for the node) differs from '
        "the policy: an older or other driver, a driver too old for a service's CUDA version, a fabric manager that "
        "does not match the driver, or a VBIOS below the profile's minimum. gpu-agent never installs drivers or "
        "flashes a VBIOS: `gpu-agent plan` says what to install. Resolves when it matches.",
        for_seconds=900,
    ),
)

_SERVICES: tuple[AlertSpec, ...] = (
    AlertSpec(
        "InferenceServiceDown",
        AlertSeverity.CRITICAL,
        _when("gpu_agent_service_up", "==", 0, drop=("unit",)),
        "Inference service {{ $labels.service }} on {{ $labels.instance }} is down",
        "The health probe of {{ $labels.service }} on {{ $labels.instance }} has failed for 2 minutes. `gpu-agent "
        "status` on the node shows the probe's error and how the service is run (its systemd unit: `systemctl "
        "status` and its journal; a command: that command's own log). gpu-agent restarts it if a rule says so "
        f"({_EVENTS}). Resolves when the probe succeeds again.",
        for_seconds=120,
        group=INFERENCE_GROUP,
        raised_by=frozenset({EventKind.SERVICE_UNHEALTHY}),
    ),
    AlertSpec(
        "InferenceLatencyAboveSlo",
        AlertSeverity.WARNING,
        _when("gpu_agent_service_latency_slo_breached", "==", 1),
        "p95 {{ $labels.kind }} latency of {{ $labels.service }} on {{ $labels.instance }} is above its SLO",
        "The p95 {{ $labels.kind }} latency of {{ $labels.service }} on {{ $labels.instance }}, from the server's own "
        "histograms over the agent's 5-minute window, has been above its objective (services[].slo) for 5 minutes. "
        f"{_EVENTS[0].upper()}{_EVENTS[1:]} names the likely cause (service_latency_regression): thermal slowdown, "
        "power cap, low clocks, an Xid, memory near full, a full KV cache or queueing. Resolves when the p95 is back "
        "within the objective.",
        for_seconds=300,
        group=INFERENCE_GROUP,
        raised_by=frozenset({EventKind.SERVICE_LATENCY_REGRESSION}),
    ),
    AlertSpec(
        "InferenceKvCacheNearFull",
        AlertSeverity.WARNING,
        AlertExpr(
            Compare(series("gpu_agent_service_kv_cache_usage_ratio"), ">=", 0.95),
            only_if=Compare(series("gpu_agent_service_requests_waiting"), ">", 0),
            on=("service",),
        ),
        "KV cache of {{ $labels.service }} on {{ $labels.instance }} is near full with requests waiting",
        "The KV cache of {{ $labels.service }} on {{ $labels.instance }} has been at least 95 % full with requests "
        "waiting for 5 minutes: the server holds new requests back until running ones finish, so queue time and "
        "TTFT grow. Give it more KV room (a larger --mem-fraction-static / --gpu-memory-utilization, more GPUs) or "
        "cap its concurrency. Resolves when the cache has room or the queue is empty.",
        for_seconds=300,
        group=INFERENCE_GROUP,
        comment="Near full alone is a busy server; with requests waiting it is one that needs more KV room.",
    ),
    AlertSpec(
        "InferenceMetricsUnreadable",
        AlertSeverity.WARNING,
        _when("gpu_agent_service_metrics_up", "==", 0),
        "gpu-agent cannot read the metrics of {{ $labels.service }} on {{ $labels.instance }}",
        "gpu-agent on {{ $labels.instance }} has failed to scrape the /metrics page of {{ $labels.service }} for 10 "
        "minutes: its latency figures are stale and its SLO is not checked. sglang needs --enable-metrics; check "
        "services[].metrics_url and `gpu-agent status` for the scrape error. Resolves at the next readable page.",
        for_seconds=600,
        group=INFERENCE_GROUP,
    ),
)

#: Every alert, in the order the shipped rule file lists them.
CATALOGUE: tuple[AlertSpec, ...] = (*_AGENT, *_NODE, *_XID, *_CLOCKS, *_MEMORY, *_LINKS, *_POLICY, *_SERVICES)
BY_NAME: dict[str, AlertSpec] = {spec.name: spec for spec in CATALOGUE}
if len(BY_NAME) != len(CATALOGUE):
    raise ImportError("two alerts share a name")


def pushed() -> list[tuple[AlertSpec, AlertExpr]]:
    """The alerts the agent judges itself, and pushes, with their conditions."""
    return [(spec, spec.expr) for spec in CATALOGUE if isinstance(spec.expr, AlertExpr)]


def raised_by(kind: EventKind) -> list[str]:
    """The names of the alerts a rule's `alertmanager` step raises for an event of this kind."""
    return [spec.name for spec in CATALOGUE if kind in spec.raised_by]
