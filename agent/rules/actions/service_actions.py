"""What the actions on services share (restart_service, reset_gpu): which services, their managers,
draining them before they stop, waiting until they answer again."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.logs import get_logger
from agent.rules.actions.base import ActionError, event_payload, gpu_of
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kinds.run_hook import hook_env
from agent.rules.actions.steps import DRAINED, DRAINING, STARTED, step
from agent.rules.model import Decision
from agent.rules.params import ServiceParams
from agent.services.drain import wait_until_idle
from agent.services.managers import ServiceError, ServiceManager
from agent.trust import UntrustedError, run_trusted

log = get_logger()


def services_for_gpu(config: AgentConfig, gpu: int) -> list[ServiceConfig]:
    return [s for s in config.services if s.gpus == "all" or gpu in s.gpus]


def named_services(decision: Decision, params: ServiceParams, config: AgentConfig) -> list[ServiceConfig]:
    """The step's service, else the decision's, else every service using the decision's GPU."""
    name = params.service or decision.target.service or decision.event.data.get("service")
    if not name:
        gpu = gpu_of(decision)
        return services_for_gpu(config, gpu) if gpu is not None else []
    known = {s.name: s for s in config.services}
    if name not in known:
        raise ActionError(f"unknown service(s) {name} (not in services:)")
    return [known[str(name)]]


def managers_for(services: Sequence[ServiceConfig], ctx: ActionContext) -> dict[str, ServiceManager] | str:
    """Each service's manager, or why one is missing."""
    missing = [s.name for s in services if s.name not in ctx.managers]
    if missing:
        return (
            f"no service manager for {', '.join(missing)} "
            f"(systemd units are only driven when host_root is /; host_root is {ctx.config.host_root})"
        )
    return {s.name: ctx.managers[s.name] for s in services}


def ready_timeout(service: ServiceConfig, override_seconds: float | None) -> float:
    return service.ready_timeout_seconds if override_seconds is None else override_seconds


def verify_healthy(service: ServiceConfig, override_seconds: float | None, ctx: ActionContext) -> tuple[bool, str]:
    """Wait until the (re)started service is healthy; (ok, what happened)."""
    if ctx.prober is None or not ctx.prober.can_probe(service.name):
        return True, f"{service.name} started (no health check configured)"
    timeout = ready_timeout(service, override_seconds)
    began = ctx.monotonic()
    result = ctx.prober.wait_healthy(service.name, timeout)
    if result.ok:
        return True, f"{service.name} healthy after {ctx.monotonic() - began:.1f} s"
    return False, f"{service.name} not healthy within {timeout:g} s ({result.detail})"


def drain_timeout(service: ServiceConfig) -> float:
    """How long draining may hold the service's stop back (0 without `drain`)."""
    return 0.0 if service.drain is None else service.drain.timeout_seconds


def drain_service(service: ServiceConfig, decision: Decision, ctx: ActionContext, steps: list[str]) -> None:
    """Before a service with `drain` is stopped: run its hook (through the trusted hook runner, the
    event as JSON on stdin), then wait until its server runs no request; both within the drain
    timeout, on the monotonic clock. Journaled `draining NAME` before the hook and `drained NAME`
    after the wait. Whatever the hook or the wait does, whatever either raises, the stop goes ahead:
    a drain only ever delays it."""
    if service.drain is None:
        return
    ctx.journal(step(DRAINING, service.name))
    try:
        _drain(service, decision, ctx, steps)
    except Exception as exc:  # a reader's or a hook's error of any type: the restart still goes ahead
        log.exception("drain failed", service=service.name)
        steps.append(f"drain of {service.name} failed ({type(exc).__name__}: {exc}): not waited on")
    ctx.journal(step(DRAINED, service.name))


def _drain(service: ServiceConfig, decision: Decision, ctx: ActionContext, steps: list[str]) -> None:
    drain = service.drain
    assert drain is not None  # drain_service checked
    began = ctx.monotonic()
    program = drain.hook[0]
    stdin = json.dumps(event_payload(decision, ctx.hostname), default=str).encode()
    env = {**hook_env(decision), "GPU_AGENT_SERVICE": service.name}
    try:
        result = run_trusted(drain.hook, drain.timeout_seconds, stdin=stdin, extra_env=env)
    except UntrustedError as exc:
        steps.append(f"drain hook of {service.name} refused: {exc}")
    except OSError as exc:
        steps.append(f"cannot run the drain hook {program} of {service.name}: {exc.strerror or exc}")
    else:
        if result.timed_out:
            steps.append(f"drain hook {program} of {service.name} timed out after {drain.timeout_seconds:g} s")
        else:
            steps.append(f"drain hook {program} of {service.name} {result.describe()}")
    left = max(drain.timeout_seconds - (ctx.monotonic() - began), 0.0)
    waited = wait_until_idle(
        service, left, monotonic=ctx.monotonic, sleep=ctx.sleep, cancel=ctx.cancel, poll_seconds=ctx.drain_poll_seconds
    )
    steps.append(waited.describe(service.name))


def managed(
    call: Callable[[ServiceConfig], None], verb: str, service: ServiceConfig, ctx: ActionContext, steps: list[str]
) -> bool:
    """Run one service manager call; when it fails, say so in `steps` and return False."""
    try:
        call(service)
    except ServiceError as exc:
        steps.append(f"{verb} {service.name} failed: {exc}")
        if ctx.prober is not None:
            ctx.prober.expect_down(service.name, 0)  # its outage is real now: let the probes count
        return False
    return True


def start_again(
    services: Sequence[ServiceConfig], managers: Mapping[str, ServiceManager], ctx: ActionContext, steps: list[str]
) -> bool:
    """Start the stopped services again and wait until they are healthy; False if any is not."""
    ok = True
    for service in services:
        if not managed(managers[service.name].start, "start", service, ctx, steps):
            ok = False
            continue
        steps.append(step(STARTED, service.name))
        ctx.journal(step(STARTED, service.name))
        healthy, what = verify_healthy(service, None, ctx)
        ok = ok and healthy
        steps.append(what)
    return ok
