"""The advisor's documents: what was asked, what each step measured, what it recommends.

Every dataclass turns into the JSON the API, `--json` and the store carry (`to_json`), and back
(`from_json`) where the CLI or recovery reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from agent.tune.defaults import (
    DEFAULT_MAX_TRAFFIC_CHANGE,
    DEFAULT_MIN_REQUEST_RATE,
    DEFAULT_SETTLE_SECONDS,
    DEFAULT_THROUGHPUT_TOLERANCE,
)

TuneKind = Literal["power", "clocks"]
_Document = TypeVar("_Document", bound="_AsItIs")


@dataclass(frozen=True)
class TuneRequest:
    kind: TuneKind
    service: str
    start: float  # --from (W or MHz)
    stop: float  # --to
    step: float  # --step, > 0; the direction comes from start and stop
    dwell_seconds: float
    gpus: tuple[int, ...] | None = None  # None: the service's GPUs
    throughput_tolerance: float = DEFAULT_THROUGHPUT_TOLERANCE
    min_request_rate: float = DEFAULT_MIN_REQUEST_RATE
    max_traffic_change: float = DEFAULT_MAX_TRAFFIC_CHANGE
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    force: bool = False  # sweep a strained or unhealthy subject anyway (--force)

    def settings(self) -> list[float]:
        """The values the sweep sets, in order: start, start -/+ step, ... up to stop (included when on the grid)."""
        direction = -1.0 if self.stop < self.start else 1.0
        values: list[float] = []
        value = self.start
        while (value - self.stop) * direction <= 1e-9:
            values.append(round(value, 3))
            value += direction * self.step
        return values

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["gpus"] = list(self.gpus) if self.gpus is not None else None
        return document

    @staticmethod
    def from_json(document: dict[str, Any]) -> TuneRequest:
        values = dict(document)
        gpus = values.get("gpus")
        values["gpus"] = tuple(int(g) for g in gpus) if gpus is not None else None
        return TuneRequest(**values)


@dataclass(frozen=True)
class StepReading:
    """One setting, measured over the dwell."""

    setting: float  # the power limit (W) or locked graphics clock (MHz) set at this step
    baseline: bool  # the setting the node ran at before the sweep
    seconds: float  # the span measured
    mean_power_watts: float  # summed over the service's GPUs (the measured ones): the total
    mean_sm_mhz: float  # mean over samples and GPUs
    tokens_per_second: float | None
    tokens_per_joule: float | None
    e2e_p95_seconds: float | None
    ttft_p95_seconds: float | None
    max_temperature_celsius: int | None
    throttle_reasons: tuple[str, ...]
    request_rate: float | None  # requests finished per second
    requests_in_flight: float | None  # running + waiting, mean of the scrapes
    requests: float  # requests finished inside the dwell
    slo_breaches: tuple[str, ...] = ()  # "e2e_p95 1.92 s > 1.5 s"
    gpu_power_watts: tuple[float, ...] = ()  # each measured GPU's mean power, in the document's measured order

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["throttle_reasons"] = list(self.throttle_reasons)
        document["slo_breaches"] = list(self.slo_breaches)
        document["gpu_power_watts"] = list(self.gpu_power_watts)
        return document

    @staticmethod
    def from_json(document: dict[str, Any]) -> StepReading:
        values = dict(document)
        values["throttle_reasons"] = tuple(values.get("throttle_reasons", ()))
        values["slo_breaches"] = tuple(values.get("slo_breaches", ()))
        values["gpu_power_watts"] = tuple(values.get("gpu_power_watts", ()))
        return StepReading(**values)


@dataclass(frozen=True)
class _AsItIs:
    """A document whose JSON is its fields as they are: none of them a tuple that JSON makes a list,
    so nothing needs turning back."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls: type[_Document], document: dict[str, Any]) -> _Document:
        return cls(**document)


@dataclass(frozen=True)
class Recommendation(_AsItIs):
    setting: float
    gpu_model: str
    snippet: str  # the agent.yaml lines that make it the policy, written against the profile in force
    tokens_per_joule_change_ratio: float | None  # against the baseline: 0.12 = 12 % more tokens per joule
    tokens_per_second_change_ratio: float | None
    e2e_p95_change_seconds: float | None
    reason: str  # "450 W: " and the rule
    rule: str = ""  # the rule applied: "most tokens per joule with p95 under the objective and ..."
    sm_clock_change_ratio: float | None = None  # the headroom given up: -0.3 = the SM clock 30 % lower
    edge: str = ""  # the step is at the edge of the range measured: which way to extend it
    tradeoff: str = ""  # what the step with the most tokens per joule would cost, when not chosen
    targets: str = ""  # what `gpu-agent tune apply` puts it on: "GPU 0 (GPU-...)", "every NVIDIA H200"


@dataclass(frozen=True)
class SweptGpu(_AsItIs):
    """A swept GPU as the sweep found it: what `tune apply` checks is still so, and what the snippet
    is written against (the profile in force, apart from an earlier `tune apply`'s drop-in)."""

    gpu: int
    uuid: str
    model: str
    whole_model: bool  # every GPU of its model on the node is swept: `tune apply` matches the model
    profile: int | None  # its profile in policy.gpus (None: none matches)
    profile_alone: bool  # that profile applies to no GPU outside the sweep: the snippet edits it in place
    profile_match: str  # that profile's match as agent.yaml spells it
    settings: dict[str, Any] = field(default_factory=dict)  # the settings in force for it, as agent.yaml spells them


@dataclass(frozen=True)
class Original:
    """A GPU's setting before the sweep, what restoring puts back."""

    gpu: int
    power_limit_watts: float | None = None  # power sweeps
    locked_graphics_mhz: tuple[int, int] | None = None  # clock sweeps: None = unlocked
    locked: bool = False  # clock sweeps: whether a lock was in place

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["locked_graphics_mhz"] = list(self.locked_graphics_mhz) if self.locked_graphics_mhz else None
        return document

    @staticmethod
    def from_json(document: dict[str, Any]) -> Original:
        lock = document.get("locked_graphics_mhz")
        return Original(
            gpu=int(document["gpu"]),
            power_limit_watts=document.get("power_limit_watts"),
            locked_graphics_mhz=(int(lock[0]), int(lock[1])) if lock else None,
            locked=bool(document.get("locked", False)),
        )


@dataclass
class TuneDocument:
    """The whole tune: what `tune status`, `--json`, `status` and the store show."""

    id: int
    request: TuneRequest
    gpus: tuple[int, ...]
    originals: tuple[Original, ...]
    state: Literal["running", "done", "stopped", "aborted", "failed", "interrupted"]
    started_seconds: float
    finished_seconds: float | None = None
    detail: str = ""
    steps: list[StepReading] = field(default_factory=list)
    recommendation: Recommendation | None = None
    progress: dict[str, Any] = field(default_factory=dict)  # step i of n, seconds left, what it does now
    slo: dict[str, float] = field(default_factory=dict)  # the objectives the steps were held to
    # Every GPU of the service: measured at each step (its tokens come from all of them), while
    # only `gpus` are swept.
    service_gpus: tuple[int, ...] = ()
    swept: tuple[SweptGpu, ...] = ()  # the swept GPUs as the sweep found them
    setting_range: tuple[float, float] | None = None  # what every swept GPU accepts (W or MHz), lowest and highest

    @property
    def measured_gpus(self) -> tuple[int, ...]:
        return self.service_gpus or self.gpus

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "id": self.id,
            "request": self.request.to_json(),
            "gpus": list(self.gpus),
            "originals": [o.to_json() for o in self.originals],
            "state": self.state,
            "started_seconds": self.started_seconds,
            "finished_seconds": self.finished_seconds,
            "detail": self.detail,
            "steps": [s.to_json() for s in self.steps],
            "recommendation": self.recommendation.to_json() if self.recommendation else None,
            "progress": dict(self.progress),
            "slo": dict(self.slo),
            "service_gpus": list(self.service_gpus),
            "swept": [g.to_json() for g in self.swept],
            "setting_range": list(self.setting_range) if self.setting_range is not None else None,
        }

    @staticmethod
    def from_json(document: dict[str, Any]) -> TuneDocument:
        recommendation = document.get("recommendation")
        return TuneDocument(
            id=int(document["id"]),
            request=TuneRequest.from_json(document["request"]),
            gpus=tuple(int(g) for g in document["gpus"]),
            originals=tuple(Original.from_json(o) for o in document["originals"]),
            state=document["state"],
            started_seconds=float(document["started_seconds"]),
            finished_seconds=document.get("finished_seconds"),
            detail=str(document.get("detail", "")),
            steps=[StepReading.from_json(s) for s in document.get("steps", [])],
            recommendation=Recommendation.from_json(recommendation) if recommendation else None,
            progress=dict(document.get("progress", {})),
            slo=dict(document.get("slo", {})),
            service_gpus=tuple(int(g) for g in document.get("service_gpus", ())),
            swept=tuple(SweptGpu.from_json(g) for g in document.get("swept", ())),
            setting_range=_range(document.get("setting_range")),
        )

    def swept_power_watts(self, step: StepReading) -> float | None:
        """The mean power per swept GPU at `step` (what the limit caps), None for a step measured
        before per-GPU figures were kept."""
        measured = list(self.measured_gpus)
        watts = [step.gpu_power_watts[measured.index(g)] for g in self.gpus if g in measured]
        if len(step.gpu_power_watts) != len(measured) or not watts:
            return None
        return sum(watts) / len(watts)


def _range(value: Any) -> tuple[float, float] | None:
    return (float(value[0]), float(value[1])) if value else None
