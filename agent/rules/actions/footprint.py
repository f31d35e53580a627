"""Which GPUs a decided action touches: what the action worker keeps it apart from (agent.daemon.lanes).

A kind's lane (agent.rules.params `ACTION_LANES`) says how far it reaches: `notify` touches no GPU,
`node` the whole node; a `gpus` kind touches the GPUs its handler would stop or change, each kind
reading them off the decision as its handler does: a restart the GPUs of the services it restarts,
a reset its GPU and every GPU of the services it stops first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agent.config import AgentConfig, ServiceConfig
from agent.rules.actions.base import ActionError, gpu_of
from agent.rules.actions.service_actions import named_services, services_for_gpu
from agent.rules.model import Decision
from agent.rules.params import ACTION_LANES, ActionKind, Lane, RestartServiceParams

#: The GPUs a decision touches; None: the whole node.
Footprint = frozenset[int] | None


def _gpus_of(services: Iterable[ServiceConfig], gpus: Iterable[int] = ()) -> Footprint:
    found = set(gpus)
    for service in services:
        if service.gpus == "all":
            return None
        found.update(service.gpus)
    return frozenset(found)


def _restart(decision: Decision, config: AgentConfig) -> Footprint:
    params = decision.action.options if decision.action is not None else None
    if not isinstance(params, RestartServiceParams):
        return None
    try:
        return _gpus_of(named_services(decision, params, config))
    except ActionError:  # an unknown service: the action fails at once, touching nothing
        return frozenset()


def _reset(decision: Decision, config: AgentConfig) -> Footprint:
    gpu = gpu_of(decision)
    return None if gpu is None else _gpus_of(services_for_gpu(config, gpu), (gpu,))


_GPU_FOOTPRINTS: dict[ActionKind, Callable[[Decision, AgentConfig], Footprint]] = {
    ActionKind.RESTART_SERVICE: _restart,
    ActionKind.RESET_GPU: _reset,
}
if {kind for kind, lane in ACTION_LANES.items() if lane is Lane.GPUS} != set(_GPU_FOOTPRINTS):
    raise ImportError("every action kind on the gpus lane needs its footprint here")


def footprint(decision: Decision, config: AgentConfig) -> Footprint:
    """The GPUs `decision` touches: none on the notify lane, the whole node (None) on the node lane."""
    if decision.action is None:
        return frozenset()
    lane = ACTION_LANES[decision.action.kind]
    if lane is Lane.NOTIFY:
        return frozenset()
    if lane is Lane.NODE:
        return None
    return _GPU_FOOTPRINTS[decision.action.kind](decision, config)
