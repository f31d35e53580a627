"""Which lane a decided action runs on and which GPUs it touches: what the action worker keeps it
apart from (agent.daemon.lanes).

Both come from the action's kind (agent/rules/actions/registry.py): a kind on the `notify` lane
touches no GPU, one on the `node` lane the whole node, and one on the `gpus` lane the GPUs its
`touches` reads off the decision, as its handler would (a restart the GPUs of the services it
restarts, a reset its GPU and every GPU of the services it stops first).
"""

from __future__ import annotations

from agent.config import AgentConfig
from agent.rules.actions.kind import Footprint, Lane
from agent.rules.actions.registry import KINDS
from agent.rules.model import Decision


def lane(decision: Decision) -> Lane:
    """The lane of the decision's kind (a decision without an action runs nothing: notify)."""
    return Lane.NOTIFY if decision.action is None else KINDS[decision.action.kind].lane


def footprint(decision: Decision, config: AgentConfig) -> Footprint:
    """The GPUs `decision` touches: none on the notify lane, the whole node (None) on the node lane."""
    if decision.action is None:
        return frozenset()
    kind = KINDS[decision.action.kind]
    if kind.lane is Lane.NOTIFY:
        return frozenset()
    if kind.touches is None:  # the node lane
        return None
    return kind.touches(decision, config)
