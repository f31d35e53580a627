"""The advisor's last measurements, for the fleet: `gpu-agent tune`'s last measured sweep of each
service and kind (agent.tune.runner `results`), step by step, and the setting it recommends.

Labels: `service`, `gpu_model` (the swept GPUs' NVML name), `kind` (`power`: the setting is a power
limit in W; `clocks`: a locked graphics clock in MHz) and `setting` (the step's value, as the sweep
set it). Series per node: for each service and kind a sweep has measured, three per step of its
last sweep (tokens per joule, tokens/s, p95; at most 65 steps), one for the recommendation and one
for when it finished; nothing on a node no sweep has measured. The best power limit per GPU model
across the fleet is one query:

    count by (gpu_model, setting) (gpu_agent_tune_recommended{kind="power"})
"""

from __future__ import annotations

from agent.metrics.families import Families
from agent.state import NodeSnapshot


def tune(out: Families, snap: NodeSnapshot) -> None:
    for result in snap.tunes:
        labels = {"service": result.service, "gpu_model": result.gpu_model, "kind": result.kind}
        for step in result.steps:
            at = {**labels, "setting": f"{step.setting:g}"}
            out.gauge(
                "gpu_agent_tune_tokens_per_joule",
                "Generated tokens per joule of the service's GPUs at each step of its last measured gpu-agent"
                " tune sweep (setting: the power limit in W, or the locked graphics clock in MHz, as kind says).",
                at,
                step.tokens_per_joule,
                family="tune",
            )
            out.gauge(
                "gpu_agent_tune_tokens_per_second",
                "Generated tokens per second of the service at each step of its last measured gpu-agent tune sweep.",
                at,
                step.tokens_per_second,
                family="tune",
            )
            out.gauge(
                "gpu_agent_tune_e2e_p95_seconds",
                "The service's p95 end-to-end latency at each step of its last measured gpu-agent tune sweep.",
                at,
                step.e2e_p95_seconds,
                family="tune",
            )
        if result.recommended is not None:
            out.gauge(
                "gpu_agent_tune_recommended",
                "1 for the setting the last measured gpu-agent tune sweep of the service recommends (absent: none).",
                {**labels, "setting": f"{result.recommended:g}"},
                1,
                family="tune",
            )
        out.gauge(
            "gpu_agent_tune_finished_timestamp_seconds",
            "When the service's last measured gpu-agent tune sweep of this kind ended (Unix time).",
            labels,
            result.finished_seconds,
            family="tune",
        )
