"""What a sweep checks before anything is journaled or changed, beyond the request itself
(agent.tune.runner `checked_request`), and what it writes down about the GPUs it is about to sweep.

- Every step is a setting every swept GPU accepts (its power limit range, its supported graphics
  clocks): `--to 100` on a 200-700 W board is refused here, before a step is set or a row written.
- The subject is well: a sweep of a service whose GPUs are not healthy (an uncorrected ECC error,
  an Xid, a thermal slowdown), or whose server is strained now (a KV cache near full, a waiting queue
  still growing: agent.services.latency_cause `strain`), would measure the fault or the strain, not
  the setting. Refused unless the request says `force`.
- The swept GPUs as they are: identity, whether every GPU of their model is swept, and the profile
  in force for each apart from an earlier `tune apply` (agent.tune.model `SweptGpu`): the snippet is
  written against it, and `tune apply` refuses a recommendation whose GPUs or profile have changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.api import ApiError
from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError
from agent.config import PolicyConfig
from agent.events import HealthState
from agent.policy.dropins import without_dropin
from agent.policy.profiles import match_text, resolve_profile
from agent.services.latency_cause import strain
from agent.state import NodeSnapshot, ServiceFigures
from agent.tune.defaults import KNOB_UNITS
from agent.tune.model import SweptGpu, TuneRequest


def setting_range(backend: GpuBackend, request: TuneRequest, gpus: Sequence[int]) -> tuple[float, float]:
    """What every swept GPU accepts, lowest and highest; ApiError naming the first step one refuses."""
    settings = request.settings()
    if not settings:
        raise ApiError("refused: no settings between --from and --to")
    unit = KNOB_UNITS[request.kind]
    lows: list[float] = []
    highs: list[float] = []
    for gpu in gpus:
        try:
            if request.kind == "power":
                low, high = backend.power_limit_constraints_watts(gpu)
                outside = [s for s in settings if not low <= s <= high]
                if outside:
                    raise ApiError(
                        f"refused: {outside[0]:g} {unit} is outside GPU {gpu}'s power limit range {low:g}-{high:g} W"
                    )
            else:
                memory = backend.supported_memory_clocks_mhz(gpu)[0]
                supported = backend.supported_graphics_clocks_mhz(gpu, memory)
                unsupported = [s for s in settings if int(s) != s or int(s) not in supported]
                if unsupported:
                    raise ApiError(
                        f"refused: {unsupported[0]:g} MHz is not a supported graphics clock of GPU {gpu}"
                        f" ({min(supported)}-{max(supported)} MHz, in its own steps)"
                    )
                low, high = float(min(supported)), float(max(supported))
        except GpuError as exc:
            raise ApiError(f"refused: cannot read GPU {gpu}'s {unit} range: {exc}") from exc
        lows.append(low)
        highs.append(high)
    return max(lows), min(highs)


def sick_subject(
    snapshot: NodeSnapshot, service: str, gpus: Sequence[int], figures: ServiceFigures | None
) -> list[str]:
    """Why the service is no subject to measure now, one line each (see the module docstring)."""
    found: list[str] = []
    samples = {sample.index: sample for sample in snapshot.gpus}
    for gpu in gpus:
        sample = samples.get(gpu)
        health = snapshot.health.get(gpu)
        if sample is None or not sample.up:
            found.append(f"GPU {gpu} does not answer")
        elif gpu in snapshot.stale_gpus:
            found.append(f"GPU {gpu}'s readings are stale (a call hung)")
        elif health is not None and health.state is not HealthState.HEALTHY:
            found.append(f"GPU {gpu} is {health.state.value}: {health.reason}")
    if figures is not None:
        found += [f"service {service}: {line}" for line in strain(figures)]
    return found


def identities(snapshot: NodeSnapshot) -> dict[int, GpuIdentity]:
    """The GPUs that answered in the snapshot, as the policy matches them."""
    return {
        sample.index: GpuIdentity(sample.index, sample.uuid, sample.name, sample.pci_bus_id, "", "", 0)
        for sample in snapshot.gpus
        if sample.up
    }


def swept_gpus(policy: PolicyConfig, node: Mapping[int, GpuIdentity], gpus: Sequence[int]) -> tuple[SweptGpu, ...]:
    """The swept GPUs as they are now (see the module docstring); ApiError for one that does not answer."""
    mine = without_dropin(policy)
    resolved = {index: resolve_profile(mine, identity) for index, identity in node.items()}
    numbers = {index: found.number if found is not None else None for index, found in resolved.items()}
    swept: list[SweptGpu] = []
    for gpu in gpus:
        identity = node.get(gpu)
        if identity is None:
            raise ApiError(f"refused: GPU {gpu} does not answer")
        found = resolved[gpu]
        number = None if found is None else found.number
        profile = found.profile if found is not None else None
        swept.append(
            SweptGpu(
                gpu=gpu,
                uuid=identity.uuid,
                model=identity.name,
                whole_model=all(i in gpus for i, other in node.items() if other.name == identity.name),
                profile=number,
                profile_alone=number is not None and all(i in gpus for i, n in numbers.items() if n == number),
                profile_match=match_text(policy.gpus[number].match) if number is not None else "",
                settings=profile.model_dump(mode="json", exclude_none=True, exclude={"match"}) if profile else {},
            )
        )
    return tuple(swept)
