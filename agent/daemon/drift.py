"""What the policy loop says about the items it fixed: drift events, counted per item, and why an
item could not be applied.

A drift the agent put back that comes back again is counted (`reappeared`): something on the node
keeps changing the setting, and a rule can act on that. The fan curve is the exception: the agent
itself moves the fans as the temperature moves, and that step of the curve is not drift. Only fans
someone else changed (the target unchanged since the agent set it, or a fan back on automatic) are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from agent.backend.base import GpuIdentity
from agent.events import Event, EventKind, Severity
from agent.logs import get_logger
from agent.names.policy_items import FAN_CURVE
from agent.policy.plan import ItemPlan

log = get_logger()

ItemKey = tuple[str, int | None]


class DriftBook:
    def __init__(self) -> None:
        self.reappeared: dict[ItemKey, int] = {}  # item -> times drift came back after a fix
        self._fixed_to: dict[ItemKey, str] = {}  # item -> the desired value of its last fix
        self._apply_failures: dict[ItemKey, str] = {}  # item -> why the last apply failed

    def fixed(self, fixed: Sequence[ItemPlan], identities: Mapping[int, GpuIdentity], now: float) -> list[Event]:
        """One POLICY_DRIFT event per item the agent put back, except the fan curve's own steps."""
        events = []
        for plan in fixed:
            key = (plan.item, plan.gpu)
            curve_step = self._curve_step(plan)
            self._fixed_to[key] = plan.desired
            if curve_step:
                log.debug("fan curve step", gpu=plan.gpu, desired=plan.desired, actual=plan.actual)
                continue
            count = self.reappeared.get(key, -1) + 1
            self.reappeared[key] = count
            identity = identities.get(plan.gpu) if plan.gpu is not None else None
            log.info("policy drift corrected", item=plan.item, gpu=plan.gpu, desired=plan.desired, actual=plan.actual)
            events.append(_drift_event(plan, count, identity, now))
        return events

    def _curve_step(self, plan: ItemPlan) -> bool:
        """The agent's fans on the curve, the target moved since the agent set them: a step, not drift."""
        if plan.item != FAN_CURVE:
            return False
        previous = self._fixed_to.get((plan.item, plan.gpu))
        return previous is not None and previous != plan.desired and "automatic" not in plan.actual

    def note_apply_failures(self, plans: tuple[ItemPlan, ...], failed: Mapping[ItemKey, str]) -> tuple[ItemPlan, ...]:
        """A drift that could not be put back says why, in the plan and (once per reason) in the log."""
        for key, detail in failed.items():
            if self._apply_failures.get(key) != detail:
                log.warning("policy item could not be applied", item=key[0], gpu=key[1], error=detail)
        planned = {(p.item, p.gpu) for p in plans}
        self._apply_failures = {
            **{k: v for k, v in self._apply_failures.items() if k not in planned},
            **failed,
        }
        return tuple(
            replace(p, detail="; ".join(filter(None, (p.detail, f"not applied: {failed[(p.item, p.gpu)]}"))))
            if (p.item, p.gpu) in failed
            else p
            for p in plans
        )


def _drift_event(plan: ItemPlan, count: int, identity: GpuIdentity | None, now: float) -> Event:
    return Event(
        EventKind.POLICY_DRIFT,
        Severity.WARNING if count else Severity.INFO,
        plan.gpu,
        identity.uuid if identity else None,
        f"{plan.item} drifted ({plan.actual}, want {plan.desired}) and was corrected"
        + (f"; it came back {count} time(s)" if count else ""),
        now,
        "policy",
        f"drift:{plan.item}:{plan.gpu}:{now}",
        {"item": plan.item, "reappeared": count, "desired": plan.desired, "actual": plan.actual},
    )
