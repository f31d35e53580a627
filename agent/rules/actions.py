"""The one place that acts: carries out the Decisions the rule engine made.

`execute(decision, ctx)` runs one decision and says how it went (an `ActionOutcome`); it never
raises, so one broken action cannot take the daemon down. It blocks: restart_service and reset_gpu
wait until the services answer again (up to `ready_timeout_seconds`, 600 s by default, since a
large model loads for minutes), so the daemon calls it from a worker, not from its collection loop.

What runs when
--------------
- A suppressed decision (no action) is SUPPRESSED and a dry-run decision is DRY_RUN: nothing runs.
- In observe mode (`mode: observe`, the default) the actions that change the node, namely
  `restart_service`, `reset_gpu` and `reboot`, are REFUSED. The others still run: `webhook`,
  `alertmanager`, `recommend_reboot` (a flag file and an alert) and `run_hook` tell people and
  systems about a fault without touching the GPUs or the services, which is what observing is for.
  A hook runs whatever its owner wrote, so an operator who wants nothing run at all does not
  configure hooks.

The actions
-----------
- restart_service: the decision's service (target, `params.service`/`params.services`, or
  `event.data["service"]`), else every service using the target GPU; restarted through its
  manager, then healthy within `ready_timeout_seconds` (a params override is allowed) or FAILED.
- reset_gpu, the safe sequence: refused for Xid 79 / a lost GPU (a reset cannot bring it back:
  reboot territory), for MIG enabled or pending (a reset destroys the instances or changes the
  mode), for a GPU whose index now names another uuid. Otherwise: stop the services using the GPU;
  wait (bounded) until NVML lists no compute process on it, else start the services again and
  refuse; reset; re-apply the node policy (a reset returns settings to defaults); start the
  services; wait until healthy. The outcome's detail lists every step.
- run_hook: `params.argv` run directly (never a shell) with the event as JSON on stdin, a minimal
  environment plus `GPU_AGENT_{EVENT_KIND,GPU,GPU_UUID,XID,RULE,SEVERITY,SERVICE}` (empty when
  unknown), a timeout that kills its process group, output captured.
  The hook file must not be group/world writable (nor its directories, unless sticky) and, when the
  agent runs as root, must be owned by root (as must its directories).
- webhook: POST the event as JSON to `params.url` with `params.headers`; header values and the URL
  path and query (tokens live there) never appear in details or logs; redirects are not followed
  (they would carry the headers elsewhere); non-2xx is FAILED.
- alertmanager: POST one alert to `<url>/api/v2/alerts`; the `AlertTracker` in the context
  remembers it, re-sends it on `refresh()` (Alertmanager resolves an alert it has not heard about
  for `resolve_timeout`, 5 m by default) and resolves it when the condition clears.
- recommend_reboot: writes `<state_dir>/reboot-recommended` (JSON) and raises an alert when an
  Alertmanager is configured.
- reboot: only with `remediation.allow_reboot: true`; runs `reboot_command` through the host
  context, which runs nothing unless `host_root` is the real `/`.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.backend.base import GpuBackend
from agent.backend.errors import GpuError, GpuErrorKind, WriteRefused
from agent.config import AgentConfig, Mode, ServiceConfig
from agent.events import CLEARS, Event, EventKind
from agent.policy.base import HostContext
from agent.policy.base import Outcome as ItemOutcome
from agent.policy.engine import PolicyEngine
from agent.rules.model import ActionKind, ActionOutcome, Decision, Outcome
from agent.services import MINIMAL_ENV, HealthProber, ServiceError, ServiceManager, run_process

log = logging.getLogger(__name__)

#: Xid 79, "GPU has fallen off the bus": a reset cannot bring it back, only a reboot (or a repair).
XID_FALLEN_OFF_BUS = 79
REBOOT_FLAG_NAME = "reboot-recommended"
ALERTS_API_PATH = "/api/v2/alerts"
DEFAULT_HOOK_TIMEOUT_SECONDS = 60.0
DEFAULT_HTTP_TIMEOUT_SECONDS = 10.0
#: Actions that change the node; observe mode refuses them.
NODE_CHANGING_ACTIONS = frozenset({ActionKind.RESTART_SERVICE, ActionKind.RESET_GPU, ActionKind.REBOOT})
#: A clearing event -> the kinds whose alerts it resolves.
_IDENTITY_LABELS = ("service", "uuid", "gpu", "reason")


class ActionError(Exception):
    """An action could not be carried out (FAILED)."""


# -- HTTP -------------------------------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        # Following it would send our headers (tokens) to wherever the redirect points.
        return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def redacted_url(url: str) -> str:
    """scheme://host[:port]/… : enough to tell where it went, without the path's tokens."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" + ("/…" if parts.path.strip("/") else "")


def post_json(url: str, payload: Any, timeout_seconds: float, headers: Mapping[str, str] | None = None) -> int:
    """POST payload as JSON; returns the 2xx status, raises ActionError otherwise (no secrets in it)."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ActionError(f"not an http(s) URL: {redacted_url(url)}")
    body = json.dumps(payload, default=str).encode()
    parts = urllib.parse.urlsplit(url)
    credentials = None
    if parts.username is not None:
        # urllib takes user:password@ for part of the host name: send it as basic auth instead.
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        credentials = "Basic " + base64.b64encode(userinfo.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    request = urllib.request.Request(url, data=body, method="POST")  # noqa: S310 (scheme checked above)
    request.add_header("Content-Type", "application/json")
    request.add_header("User-Agent", "gpu-agent")
    if credentials is not None:
        request.add_header("Authorization", credentials)
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    where = redacted_url(url)
    try:
        with _OPENER.open(request, timeout=timeout_seconds) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        raise ActionError(f"POST {where}: HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise ActionError(f"POST {where}: {exc.reason}") from None
    except (TimeoutError, OSError) as exc:
        raise ActionError(f"POST {where}: {exc}") from None
    if not 200 <= status < 300:
        raise ActionError(f"POST {where}: HTTP {status}")
    return status


# -- event payloads ---------------------------------------------------------------------------------


def event_payload(decision: Decision, hostname: str) -> dict[str, Any]:
    """What hooks (stdin) and webhooks (body) receive: the decision and its event, as JSON."""
    event = decision.event
    return {
        "host": hostname,
        "rule": decision.rule,
        "action": decision.action.kind.value if decision.action else None,
        "step": decision.step,
        "attempt": decision.attempt,
        "reason": decision.reason,
        "target": {"gpu": decision.target.gpu, "uuid": decision.target.uuid, "service": decision.target.service},
        "event": {
            "kind": event.kind.value,
            "severity": event.severity.value,
            "gpu": event.gpu,
            "uuid": event.uuid,
            "message": event.message,
            "timestamp_seconds": event.timestamp_seconds,
            "source": event.source,
            "key": event.key,
            "data": event.data,
            "suggested_action": event.suggested_action.value,
        },
    }


def _gpu_of(decision: Decision) -> int | None:
    return decision.target.gpu if decision.target.gpu is not None else decision.event.gpu


def _uuid_of(decision: Decision) -> str | None:
    return decision.target.uuid or decision.event.uuid


def _xid_of(event: Event) -> int | None:
    xid = event.data.get("xid")
    return xid if isinstance(xid, int) and not isinstance(xid, bool) else None


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")


# -- alerts -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    """One Alertmanager alert; its labels are its identity."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at_seconds: float

    @property
    def key(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.labels.items())

    def to_json(self, ends_at_seconds: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "startsAt": _iso(self.starts_at_seconds),
        }
        if ends_at_seconds is not None:
            body["endsAt"] = _iso(ends_at_seconds)
        return body


def _camel(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_"))


def alert_for(decision: Decision, hostname: str, params: Mapping[str, Any]) -> Alert:
    """The alert for a decision. Labels: alertname (`params.alertname`, else `GpuAgent<EventKind>`),
    severity, instance, event, rule, and gpu, uuid, service, xid, reason where known, plus
    `params.labels`. Annotations: summary, description, suggested_action, plus `params.annotations`."""
    event = decision.event
    gpu, uuid = _gpu_of(decision), _uuid_of(decision)
    service = decision.target.service or event.data.get("service")
    reason = event.data.get("reason")
    xid = _xid_of(event)
    labels: dict[str, str] = {
        "alertname": str(params.get("alertname") or f"GpuAgent{_camel(event.kind.value)}"),
        "severity": str(params.get("severity") or event.severity.value),
        "instance": hostname,
        "event": event.kind.value,
        "rule": decision.rule,
    }
    optional = {"gpu": gpu, "uuid": uuid, "service": service, "xid": xid, "reason": reason}
    labels.update({name: str(value) for name, value in optional.items() if value is not None and value != ""})
    labels.update({str(k): str(v) for k, v in dict(params.get("labels") or {}).items()})
    annotations = {
        "summary": str(params.get("summary") or event.message),
        "description": str(params.get("description") or f"{decision.rule}: {decision.reason}"),
        "suggested_action": event.suggested_action.value,
    }
    annotations.update({str(k): str(v) for k, v in dict(params.get("annotations") or {}).items()})
    return Alert(labels, annotations, event.timestamp_seconds)


def alerts_url(base_url: str) -> str:
    return base_url.rstrip("/") + ALERTS_API_PATH


def post_alert(base_url: str, alert: Alert, timeout_seconds: float = DEFAULT_HTTP_TIMEOUT_SECONDS) -> None:
    post_json(alerts_url(base_url), [alert.to_json()], timeout_seconds)


def resolve_alert(
    base_url: str, alert: Alert, now_seconds: float, timeout_seconds: float = DEFAULT_HTTP_TIMEOUT_SECONDS
) -> None:
    """Tell Alertmanager the alert ended now: the same labels with `endsAt`."""
    post_json(alerts_url(base_url), [alert.to_json(ends_at_seconds=now_seconds)], timeout_seconds)


class AlertTracker:
    """The alerts the agent raised and has not resolved yet, and where each went."""

    def __init__(
        self, timeout_seconds: float = DEFAULT_HTTP_TIMEOUT_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._active: dict[frozenset[tuple[str, str]], tuple[str, Alert]] = {}

    def fire(self, base_url: str, alert: Alert) -> Alert:
        """Post the alert (raises ActionError) and remember it; an alert already active keeps its start."""
        with self._lock:
            known = self._active.get(alert.key)
        if known is not None:
            alert = Alert(alert.labels, alert.annotations, known[1].starts_at_seconds)
        post_alert(base_url, alert, self.timeout_seconds)
        with self._lock:
            self._active[alert.key] = (base_url, alert)
        return alert

    def active(self) -> list[Alert]:
        with self._lock:
            return [alert for _, alert in self._active.values()]

    def resolve(self, match: Mapping[str, str]) -> list[Alert]:
        """Resolve every active alert whose labels include `match`; returns those resolved. One
        that could not be posted stays active and is tried again by the next call."""
        with self._lock:
            chosen = [
                (key, url, alert)
                for key, (url, alert) in self._active.items()
                if all(alert.labels.get(k) == v for k, v in match.items())
            ]
        resolved: list[Alert] = []
        for key, url, alert in chosen:
            try:
                resolve_alert(url, alert, self.clock(), self.timeout_seconds)
            except ActionError as exc:
                log.warning("could not resolve alert %s: %s", alert.labels.get("alertname"), exc)
                continue
            with self._lock:
                self._active.pop(key, None)
            resolved.append(alert)
        return resolved

    def resolve_cleared(self, event: Event) -> list[Alert]:
        """Resolve the alerts a clearing event ends (SERVICE_HEALTHY ends SERVICE_UNHEALTHY for that
        service, THROTTLE_ENDED the same reason's THROTTLE_STARTED, ...: see CLEARS)."""
        cleared = CLEARS.get(event.kind)
        if not cleared:
            return []
        identity = {
            "service": event.data.get("service"),
            "uuid": event.uuid,
            "gpu": event.gpu,
            "reason": event.data.get("reason"),
        }
        match = {k: str(v) for k, v in identity.items() if v is not None and v != ""}
        resolved: list[Alert] = []
        for kind in sorted(cleared, key=lambda k: k.value):
            resolved += self.resolve({**match, "event": kind.value})
        return resolved

    def refresh(self) -> list[str]:
        """Re-send every active alert so Alertmanager does not time it out; returns the errors."""
        errors: list[str] = []
        with self._lock:
            active = list(self._active.values())
        for url, alert in active:
            try:
                post_alert(url, alert, self.timeout_seconds)
            except ActionError as exc:
                errors.append(str(exc))
        return errors


# -- context ----------------------------------------------------------------------------------------


@dataclass
class ActionContext:
    """Everything actions reach. `managers` maps service names to their manager (a service without
    one cannot be restarted: see agent.services.build_managers)."""

    config: AgentConfig
    backend: GpuBackend
    policy: PolicyEngine
    host: HostContext
    managers: Mapping[str, ServiceManager]
    prober: HealthProber | None = None
    alerts: AlertTracker = field(default_factory=AlertTracker)
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    hostname: str = field(default_factory=socket.gethostname)
    #: How long a GPU reset waits for the GPU's processes to exit after the services stopped.
    drain_timeout_seconds: float = 30.0
    drain_poll_seconds: float = 0.5


@dataclass(frozen=True)
class _Result:
    outcome: Outcome
    detail: str


def _refused(detail: str) -> _Result:
    return _Result(Outcome.REFUSED, detail)


def _failed(detail: str) -> _Result:
    return _Result(Outcome.FAILED, detail)


def _success(detail: str) -> _Result:
    return _Result(Outcome.SUCCESS, detail)


def execute(decision: Decision, ctx: ActionContext) -> ActionOutcome:
    """Carry out one decision. Never raises: an unexpected error is a FAILED outcome."""
    started = ctx.clock()
    result = _dispatch(decision, ctx)
    finished = ctx.clock()
    log.info(
        "action %s for rule %s on %s: %s (%s)",
        decision.action.kind.value if decision.action else "none",
        decision.rule,
        decision.target.key,
        result.outcome.value,
        result.detail,
    )
    return ActionOutcome(decision, result.outcome, result.detail, started, finished)


def _dispatch(decision: Decision, ctx: ActionContext) -> _Result:
    action = decision.action
    if action is None:
        return _Result(Outcome.SUPPRESSED, decision.reason)
    if decision.dry_run:
        return _Result(Outcome.DRY_RUN, f"dry run: would {action.kind.value} ({decision.target.key})")
    if action.kind in NODE_CHANGING_ACTIONS and ctx.config.mode is Mode.OBSERVE:
        return _refused(f"observe mode: {action.kind.value} changes the node (set mode: enforce to allow it)")
    handler = _HANDLERS[action.kind]
    try:
        return handler(decision, action.params, ctx)
    except ActionError as exc:
        return _failed(str(exc))
    except Exception as exc:  # the backstop: one broken action must not take the daemon down
        log.exception("action %s failed unexpectedly", action.kind.value)
        return _failed(f"internal error: {type(exc).__name__}: {exc}")


# -- services ---------------------------------------------------------------------------------------


def services_for_gpu(config: AgentConfig, gpu: int) -> list[ServiceConfig]:
    return [s for s in config.services if s.gpus == "all" or gpu in s.gpus]


def _named_services(decision: Decision, params: Mapping[str, Any], config: AgentConfig) -> list[ServiceConfig]:
    names: list[str] = []
    if params.get("services"):
        names = [str(n) for n in params["services"]]
    elif params.get("service"):
        names = [str(params["service"])]
    elif decision.target.service:
        names = [decision.target.service]
    elif decision.event.data.get("service"):
        names = [str(decision.event.data["service"])]
    if not names:
        gpu = _gpu_of(decision)
        return services_for_gpu(config, gpu) if gpu is not None else []
    known = {s.name: s for s in config.services}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ActionError(f"unknown service(s) {', '.join(unknown)} (not in services:)")
    return [known[n] for n in names]


def _managers_for(services: Sequence[ServiceConfig], ctx: ActionContext) -> dict[str, ServiceManager] | str:
    """Each service's manager, or why one is missing."""
    missing = [s.name for s in services if s.name not in ctx.managers]
    if missing:
        return (
            f"no service manager for {', '.join(missing)} "
            f"(systemd units are only driven when host_root is /; host_root is {ctx.config.host_root})"
        )
    return {s.name: ctx.managers[s.name] for s in services}


def _ready_timeout(service: ServiceConfig, params: Mapping[str, Any]) -> float:
    return float(params.get("ready_timeout_seconds", service.ready_timeout_seconds))


def _verify_healthy(service: ServiceConfig, params: Mapping[str, Any], ctx: ActionContext) -> tuple[bool, str]:
    """Wait until the restarted service is healthy; (ok, what happened)."""
    if ctx.prober is None or not ctx.prober.can_probe(service.name):
        return True, f"{service.name} started (no health check configured)"
    timeout = _ready_timeout(service, params)
    began = ctx.clock()
    result = ctx.prober.wait_healthy(service.name, timeout)
    if result.ok:
        return True, f"{service.name} healthy after {ctx.clock() - began:.1f} s"
    return False, f"{service.name} not healthy within {timeout:g} s ({result.detail})"


def _restart_service(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    services = _named_services(decision, params, ctx.config)
    if not services:
        return _failed("no service to restart: the decision names none and no service uses its GPU")
    managers = _managers_for(services, ctx)
    if isinstance(managers, str):
        return _refused(managers)
    steps: list[str] = []
    ok = True
    for service in services:
        if ctx.prober is not None:
            ctx.prober.expect_down(service.name, service.command_timeout_seconds + _ready_timeout(service, params))
        try:
            managers[service.name].restart(service)
        except ServiceError as exc:
            ok = False
            steps.append(f"restart {service.name} failed: {exc}")
            if ctx.prober is not None:
                ctx.prober.expect_down(service.name, 0)
            continue
        healthy, what = _verify_healthy(service, params, ctx)
        ok = ok and healthy
        steps.append(f"restarted {service.name}; {what}")
    return _Result(Outcome.SUCCESS if ok else Outcome.FAILED, "; ".join(steps))


# -- GPU reset --------------------------------------------------------------------------------------


def _reset_refusal(decision: Decision, gpu: int, ctx: ActionContext) -> str | None:
    """Why the GPU must not be reset, or None."""
    event = decision.event
    if event.kind is EventKind.GPU_LOST or _xid_of(event) == XID_FALLEN_OFF_BUS:
        return f"Xid {XID_FALLEN_OFF_BUS} / GPU lost: a reset cannot recover GPU {gpu}; it needs a reboot"
    try:
        identity = ctx.backend.identity(gpu)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.GPU_LOST:
            return f"GPU {gpu} has fallen off the bus: a reset cannot recover it; it needs a reboot"
        return f"cannot identify GPU {gpu}: {exc}"
    uuid = _uuid_of(decision)
    if uuid and uuid.lower() != identity.uuid.lower():
        return f"GPU index {gpu} is now {identity.uuid}, not {uuid}: the GPUs were re-enumerated"
    try:
        mig = ctx.backend.mig_mode(gpu)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.NOT_SUPPORTED:
            return None
        if exc.kind is GpuErrorKind.GPU_LOST:
            return f"GPU {gpu} has fallen off the bus: a reset cannot recover it; it needs a reboot"
        return f"cannot read the MIG mode of GPU {gpu}: {exc}"
    if mig.current:
        return f"MIG is enabled on GPU {gpu}: a reset destroys its MIG instances"
    if mig.pending:
        return f"a MIG mode change is pending on GPU {gpu}: a reset would apply it"
    return None


def _process_names(pids: Sequence[int], ctx: ActionContext) -> str:
    named = []
    for pid in pids:
        try:
            comm = ctx.host.paths.read_text(f"/proc/{pid}/comm").strip()
        except OSError:
            comm = ""
        named.append(f"{pid} ({comm})" if comm else str(pid))
    return ", ".join(named)


def _wait_idle(gpu: int, ctx: ActionContext) -> tuple[list[int], float]:
    """Poll NVML's process list until it is empty or the drain timeout passes: (remaining pids, waited)."""
    began = ctx.clock()
    deadline = began + ctx.drain_timeout_seconds
    while True:
        pids = [p.pid for p in ctx.backend.compute_processes(gpu)]
        now = ctx.clock()
        if not pids or now >= deadline:
            return pids, now - began
        ctx.sleep(min(ctx.drain_poll_seconds, deadline - now))


def _bring_back(
    services: Sequence[ServiceConfig],
    managers: Mapping[str, ServiceManager],
    params: Mapping[str, Any],
    ctx: ActionContext,
    steps: list[str],
) -> bool:
    """Start the stopped services again and wait until they are healthy; False if any is not."""
    ok = True
    for service in services:
        try:
            managers[service.name].start(service)
        except ServiceError as exc:
            ok = False
            steps.append(f"start {service.name} failed: {exc}")
            if ctx.prober is not None:
                ctx.prober.expect_down(service.name, 0)  # its outage is real now: let the probes count
            continue
        steps.append(f"started {service.name}")
        healthy, what = _verify_healthy(service, params, ctx)
        ok = ok and healthy
        steps.append(what)
    return ok


def _reset_gpu(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    gpu = _gpu_of(decision)
    if gpu is None:
        return _failed("reset_gpu needs a GPU target")
    refusal = _reset_refusal(decision, gpu, ctx)
    if refusal is not None:
        return _refused(refusal)
    services = services_for_gpu(ctx.config, gpu)
    managers = _managers_for(services, ctx)
    if isinstance(managers, str):
        return _refused(f"cannot stop the services on GPU {gpu}: {managers}")
    steps: list[str] = []
    stopped: list[ServiceConfig] = []
    for service in services:
        if ctx.prober is not None:
            budget = ctx.drain_timeout_seconds + 2 * service.command_timeout_seconds + _ready_timeout(service, params)
            ctx.prober.expect_down(service.name, budget)
        try:
            managers[service.name].stop(service)
        except ServiceError as exc:
            steps.append(f"stop {service.name} failed: {exc}")
            if ctx.prober is not None:
                ctx.prober.expect_down(service.name, 0)
            _bring_back(stopped, managers, params, ctx, steps)
            return _failed("; ".join(steps))
        stopped.append(service)
        steps.append(f"stopped {service.name}")

    try:
        outcome = _reset_idle_gpu(gpu, ctx, steps)
    except Exception as exc:  # whatever went wrong, the stopped services must come back
        log.exception("GPU %d reset sequence failed unexpectedly", gpu)
        steps.append(f"unexpected error: {type(exc).__name__}: {exc}")
        outcome = Outcome.FAILED
    back = _bring_back(stopped, managers, params, ctx, steps)
    if outcome is Outcome.SUCCESS and not back:
        outcome = Outcome.FAILED
    return _Result(outcome, "; ".join(steps))


def _reset_idle_gpu(gpu: int, ctx: ActionContext, steps: list[str]) -> Outcome:
    """With the services stopped: wait until the GPU is idle, reset it, re-apply the policy."""
    try:
        remaining, waited = _wait_idle(gpu, ctx)
    except GpuError as exc:
        steps.append(f"cannot list the processes on GPU {gpu}: {exc}")
        return Outcome.FAILED
    if remaining:
        steps.append(f"processes {_process_names(remaining, ctx)} still on GPU {gpu} after {waited:.1f} s")
        return Outcome.REFUSED
    steps.append(f"GPU {gpu} idle after {waited:.1f} s")

    try:
        ctx.backend.reset_gpu(gpu)
    except (GpuError, WriteRefused) as exc:
        steps.append(f"reset of GPU {gpu} failed: {exc}")
        # IN_USE: something grabbed the GPU between our check and the reset; a safety refusal.
        return Outcome.REFUSED if isinstance(exc, GpuError) and exc.kind is GpuErrorKind.IN_USE else Outcome.FAILED
    steps.append(f"reset GPU {gpu}")

    try:
        report = ctx.policy.apply()
    except GpuError as exc:
        steps.append(f"policy re-apply failed: {exc}")
        return Outcome.FAILED
    failures = [r for r in report.results if r.outcome is ItemOutcome.FAILED]
    if failures:
        listed = "; ".join(
            f"{r.plan.item}{'' if r.plan.gpu is None else f' GPU {r.plan.gpu}'}: {r.detail}" for r in failures
        )
        steps.append(f"policy re-applied with {len(failures)} failure(s): {listed}")
        return Outcome.FAILED
    applied = sum(1 for r in report.results if r.outcome is ItemOutcome.APPLIED)
    steps.append(f"policy re-applied ({applied} item(s) set)")
    return Outcome.SUCCESS


# -- hooks ------------------------------------------------------------------------------------------


def hook_path_problem(program: str, running_as_root: bool | None = None) -> str | None:
    """Why a hook program must not run, or None. A file someone other than root could change would
    let them run code as the agent; so would a directory above it they could write to."""
    if not program.startswith("/"):
        return f"hook program must be an absolute path, not {program!r}"
    as_root = os.geteuid() == 0 if running_as_root is None else running_as_root
    try:
        real = Path(program).resolve(strict=True)
        info = real.stat()
    except OSError as exc:
        return f"hook {program}: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"hook {real} is not a regular file"
    if info.st_mode & 0o022:
        return f"hook {real} is group or world writable (mode {stat.S_IMODE(info.st_mode):04o})"
    if as_root and info.st_uid != 0:
        return f"hook {real} is not owned by root (uid {info.st_uid})"
    for directory in real.parents:
        dir_info = directory.stat()
        if dir_info.st_mode & 0o022 and not dir_info.st_mode & stat.S_ISVTX:
            return f"directory {directory} of hook {real} is group or world writable"
        if as_root and dir_info.st_uid != 0:
            return f"directory {directory} of hook {real} is not owned by root (uid {dir_info.st_uid})"
    return None


def hook_env(decision: Decision) -> dict[str, str]:
    event = decision.event
    gpu, uuid, xid = _gpu_of(decision), _uuid_of(decision), _xid_of(event)
    service = decision.target.service or event.data.get("service")
    return {
        **MINIMAL_ENV,
        "GPU_AGENT_EVENT_KIND": event.kind.value,
        "GPU_AGENT_GPU": "" if gpu is None else str(gpu),
        "GPU_AGENT_GPU_UUID": uuid or "",
        "GPU_AGENT_XID": "" if xid is None else str(xid),
        "GPU_AGENT_RULE": decision.rule,
        "GPU_AGENT_SEVERITY": event.severity.value,
        "GPU_AGENT_SERVICE": "" if service is None else str(service),
    }


def _run_hook(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    argv = params.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return _failed("run_hook needs params.argv, a non-empty list of strings")
    problem = hook_path_problem(argv[0])
    if problem is not None:
        return _refused(problem)
    timeout = float(params.get("timeout_seconds", DEFAULT_HOOK_TIMEOUT_SECONDS))
    stdin = json.dumps(event_payload(decision, ctx.hostname), default=str).encode()
    try:
        result = run_process(argv, timeout, stdin=stdin, env=hook_env(decision))
    except OSError as exc:
        return _failed(f"cannot run hook {argv[0]}: {exc.strerror or exc}")
    if result.timed_out:
        return _failed(f"hook {argv[0]} timed out after {timeout:g} s (process group killed): {result.output}")
    detail = f"hook {argv[0]} {result.describe()}"
    return _success(detail) if result.returncode == 0 else _failed(detail)


# -- notifications ----------------------------------------------------------------------------------


def _webhook(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    url = params.get("url")
    if not isinstance(url, str) or not url:
        return _failed("webhook needs params.url")
    headers = {str(k): str(v) for k, v in dict(params.get("headers") or {}).items()}
    timeout = float(params.get("timeout_seconds", DEFAULT_HTTP_TIMEOUT_SECONDS))
    try:
        status = post_json(url, event_payload(decision, ctx.hostname), timeout, headers)
    except ActionError as exc:
        return _failed(str(exc))
    return _success(f"POST {redacted_url(url)}: HTTP {status}")


def _alertmanager_url(params: Mapping[str, Any], ctx: ActionContext) -> str | None:
    url = params.get("url") or ctx.config.remediation.alertmanager_url
    return str(url) if url else None


def _alertmanager(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    url = _alertmanager_url(params, ctx)
    if url is None:
        return _failed("no Alertmanager: set remediation.alertmanager_url or params.url")
    alert = alert_for(decision, ctx.hostname, params)
    try:
        ctx.alerts.fire(url, alert)
    except ActionError as exc:
        return _failed(str(exc))
    return _success(f"alert {alert.labels['alertname']} sent to {redacted_url(url)}")


def _recommend_reboot(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    now = ctx.clock()
    event = decision.event
    flag = {
        "reason": str(params.get("reason") or event.message),
        "rule": decision.rule,
        "event": event.kind.value,
        "gpu": _gpu_of(decision),
        "uuid": _uuid_of(decision),
        "xid": _xid_of(event),
        "time_seconds": now,
        "time": _iso(now),
        # So a reader can tell a flag written before the last boot (and so already acted on).
        "boot_id": _boot_id(ctx),
    }
    path = Path(ctx.config.state_dir) / REBOOT_FLAG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(flag, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    detail = f"reboot recommended: wrote {path}"
    url = _alertmanager_url(params, ctx)
    if url is None:
        return _success(detail)
    alert_params = {"alertname": "GpuAgentRebootRecommended", **params}
    alert = alert_for(decision, ctx.hostname, alert_params)
    try:
        ctx.alerts.fire(url, alert)
    except ActionError as exc:
        return _failed(f"{detail}; alert not delivered: {exc}")
    return _success(f"{detail}; alert {alert.labels['alertname']} sent")


def _boot_id(ctx: ActionContext) -> str | None:
    try:
        return ctx.host.paths.read_text("/proc/sys/kernel/random/boot_id").strip() or None
    except OSError:
        return None


def _reboot(decision: Decision, params: Mapping[str, Any], ctx: ActionContext) -> _Result:
    if not ctx.config.remediation.allow_reboot:
        return _refused("reboot is not allowed (remediation.allow_reboot is false)")
    result = ctx.host.run_command(ctx.config.remediation.reboot_command)
    if not result.ran:
        return _refused(f"reboot not run: {result.output}")
    command = " ".join(result.argv)
    if result.returncode != 0:
        return _failed(f"{command}: exit {result.returncode}: {result.output}")
    return _success(f"{command}: reboot started")


_Handler = Callable[[Decision, Mapping[str, Any], ActionContext], _Result]
_HANDLERS: dict[ActionKind, _Handler] = {
    ActionKind.RESTART_SERVICE: _restart_service,
    ActionKind.RESET_GPU: _reset_gpu,
    ActionKind.RUN_HOOK: _run_hook,
    ActionKind.WEBHOOK: _webhook,
    ActionKind.ALERTMANAGER: _alertmanager,
    ActionKind.RECOMMEND_REBOOT: _recommend_reboot,
    ActionKind.REBOOT: _reboot,
}
