"""An action kind, described once: the `ActionType` its module under agent/rules/actions/kinds/ declares.

Every list of action kinds is read from these descriptions (agent/rules/actions/registry.py): the
steps a rules file may write (agent/rules/config.py), what the engine aims a step at and how many
of a kind one evaluation decides (agent/rules/engine.py), the handler `execute` runs and what
observe mode does with it (dispatch.py), the lane and GPUs the action worker gives it
(footprint.py), what `gpu-agent check-config` checks, and README's table of actions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.rules.actions.base import Result
from agent.rules.actions.context import ActionContext
from agent.rules.model import Decision
from agent.rules.params import ActionParams, ServiceParams


class Lane(str, Enum):
    """Where the action worker runs a kind (agent.daemon.lanes), by what it touches."""

    NOTIFY = "notify"  # tells someone and changes nothing: never waits for a job on the node
    GPUS = "gpus"  # changes some GPUs and the services on them: waits only for a job on those GPUs
    NODE = "node"  # may change anything on the node: waits for every job, and ends a sweep


class Targets(str, Enum):
    """What the engine aims a kind's step at (agent.rules.engine)."""

    FAULT = "fault"  # the fault's own target: its GPU, its service, or the node
    GPU = "gpu"  # the fault's GPU: nothing runs for a fault that names none (nor in a service_unhealthy rule)
    #: Each service using the fault's GPU (or the service the step names), one decision and one
    #: attempt count per service; an app-level Xid only its faulting process's service. Its
    #: parameters are `ServiceParams`.
    SERVICES = "services"


class ClearsXids(str, Enum):
    """What a success of a kind fixed, taken out of the Xid health window (agent.watch.xid): the
    verdict and the Xid alerts no longer hold it; the counters stay."""

    NOTHING = "nothing"
    GPU = "gpu"  # the GPU starts afresh (a reset): every Xid of the decision's GPU
    #: The services it restarted answer again: the app-level Xids (catalog action restart_service) of
    #: the GPUs it touched were their processes' own faults.
    APP_LEVEL = "app_level"


class Once(str, Enum):
    """How many of a kind one evaluation decides, whichever rules ask; the rest are suppressed as duplicates."""

    PER_TARGET = "target"  # one per rule and target (storm protection counts them)
    PER_GPU = "gpu"  # one per GPU
    PER_NODE = "node"  # one per node


#: The GPUs a decision touches; None: the whole node.
Footprint = frozenset[int] | None


def gpus_of(services: Iterable[ServiceConfig], gpus: Iterable[int] = ()) -> Footprint:
    """`gpus` and every GPU of `services`: the whole node (None) when one of them uses all."""
    found = set(gpus)
    for service in services:
        if service.gpus == "all":
            return None
        found.update(service.gpus)
    return frozenset(found)


P = TypeVar("P", bound=ActionParams)


@dataclass(frozen=True)
class ActionType(Generic[P]):
    """One action kind: its parameters and handler, and everything the rest of the agent asks of it.

    A kind's module declares one, as `ACTION`, and is named for the kind (`kinds/reset_gpu.py`)."""

    #: Its parameter model; `params.kind` is the kind's name, as rules files spell it.
    params: type[P]
    #: The handler: carries the decision out and says how it went; blocks (the action worker calls
    #: it); ActionError for a failure it can name.
    run: Callable[[Decision, P, ActionContext], Result]
    #: What it does, in a sentence (README's table of actions).
    does: str
    #: The agent itself changes the node with it (a service, a GPU, the machine). In observe mode
    #: such an action is not run: it is recorded as a dry run, what the agent would have done
    #: (agent.rules.actions.dispatch `observe_mode`). Every other kind runs in either mode.
    changes_node: bool
    #: Where the action worker runs it (agent.daemon.lanes).
    lane: Lane
    #: On the gpus lane: the GPUs a decision of this kind touches, read off it as `run` would.
    touches: Callable[[Decision, AgentConfig], Footprint] | None = None
    targets: Targets = Targets.FAULT
    once: Once = Once.PER_TARGET
    #: A rule may use it only with `remediation.allow_reboot: true` (refused when the rules load).
    needs_allow_reboot: bool = False
    #: What a success fixed, out of the Xid health window.
    clears_xids: ClearsXids = ClearsXids.NOTHING
    #: What `gpu-agent check-config` checks of a step now rather than when a fault needs it:
    #: (field, problem) for each problem found.
    check: Callable[[P], list[tuple[str, str]]] | None = None

    def __post_init__(self) -> None:
        name = getattr(self.params, "kind", None)
        if not isinstance(name, str):
            raise TypeError(f"{self.params.__name__} names no kind (kind: ClassVar[str] = ...)")
        if (self.lane is Lane.GPUS) != (self.touches is not None):
            raise TypeError(f"{name}: a kind on the gpus lane says which GPUs it touches (touches=), no other does")
        if (self.targets is Targets.SERVICES) != issubclass(self.params, ServiceParams):
            raise TypeError(f"{name}: a kind aimed at services takes ServiceParams, no other does")

    @property
    def name(self) -> str:
        return self.params.kind

    def execute(self, decision: Decision, params: ActionParams, ctx: ActionContext) -> Result:
        """Run the handler on `params`, which must be this kind's model."""
        return self.run(decision, self._own(params), ctx)

    def problems(self, params: ActionParams) -> list[tuple[str, str]]:
        """What check-config finds wrong with a step's parameters (`check`): (field, problem) each."""
        return [] if self.check is None else self.check(self._own(params))

    def ignored_fields(self, params: ActionParams) -> list[tuple[str, str]]:
        """The fields a step sets that do nothing any more: its parameters marked `deprecated` (kept from
        an earlier release so that an upgrade loads the admin's rules; the loader warns of each), as
        (field, why). The README's table leaves them out by the same mark."""
        own = self._own(params)
        fields = type(own).model_fields
        set_fields = [name for name, field in fields.items() if field.deprecated and name in own.model_fields_set]
        return [(name, fields[name].deprecation_message or "ignored") for name in set_fields]

    def _own(self, params: ActionParams) -> P:
        if not isinstance(params, self.params):
            raise TypeError(f"{self.name} got {type(params).__name__}")
        return params
